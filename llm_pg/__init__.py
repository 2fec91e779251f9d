"""llm_pg: reinforcement learning from verifiable rewards (GR-REINFORCE, GRPO) on PyTorch Lightning."""

__version__ = "0.1.0"
