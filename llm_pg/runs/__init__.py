"""A run's bookkeeping: its directory and lock (`directory`), the config a resume must share (`config`), the logs a
resume trims (`logs`), the loggers (`loggers`), what stops a bad run (`guards`) and the checks before any model
loads (`preflight`). Imports `llm_pg.models`, `llm_pg.data` and `llm_pg.core`; no Lightning module or callback.
"""
