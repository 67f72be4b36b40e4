"""Memory, communication and time cost model of the strategies; strategy advice (DESIGN.md sections 2-4).

    from lightning_shard.planner import plan, recommend_for, auto_policy
"""

from .config import Job, StrategyConfig, batch_split
from .recommend import PlanResult, Recommendation, auto_policy, plan, recommend_for

__all__ = ["Job", "PlanResult", "Recommendation", "StrategyConfig", "auto_policy", "batch_split", "plan",
           "recommend_for"]
