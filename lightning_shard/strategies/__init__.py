"""Lightning adapters over the sharding core. Importing this package registers the strategy names."""

from lightning.pytorch.strategies import StrategyRegistry

from .precision import ShardedPrecision
from .zero import Zero0Strategy, Zero1Strategy, Zero2Strategy, ZeroStrategy

ZeroStrategy.register_strategies(StrategyRegistry)

__all__ = ["ShardedPrecision", "Zero0Strategy", "Zero1Strategy", "Zero2Strategy", "ZeroStrategy"]
