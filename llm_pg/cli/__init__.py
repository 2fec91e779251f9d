"""The commands: `llm-pg` (`entry`), fit and validate through LightningCLI (`fit`), `sweep`, `report`, `bundle`, the
end-of-run summary (`summary`), Modal support for launch.py (`modal_support`). The top layer: it may import every
other, and none imports it.
"""
