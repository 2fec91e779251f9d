from llm_pg.modules.base import PolicyGradientModule
from llm_pg.modules.grpo import GRPOModule
from llm_pg.modules.reinforce import ReinforceModule

__all__ = ["GRPOModule", "PolicyGradientModule", "ReinforceModule"]
