"""Lightning adapters over the sharding core (Trainer and Fabric). Importing this package registers the strategy
names in both registries."""

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from ..checkpoint.io import ShardedCheckpointIO
from .auto import AutoStrategy
from .fabric import (
    FABRIC_CLASSES,
    FSDPShardFabricStrategy,
    Zero0FabricStrategy,
    Zero1FabricStrategy,
    Zero2FabricStrategy,
    Zero3FabricStrategy,
    ZeroFabricStrategy,
)
from .precision import ShardedPrecision
from .zero import Zero0Strategy, Zero1Strategy, Zero2Strategy, ZeroStrategy
from .zero3 import FSDPShardStrategy, Zero3Strategy

REGISTERED = {
    "zero0": (Zero0Strategy, "data parallel through the sharding engine (the honest baseline)", {}),
    "zero1": (Zero1Strategy, "ZeRO-1: sharded optimizer state", {}),
    "zero2": (Zero2Strategy, "ZeRO-2: sharded optimizer state and gradients", {}),
    "zero3": (Zero3Strategy, "ZeRO-3: optimizer state, gradients and parameters sharded per module", {}),
    "fsdp_shard": (FSDPShardStrategy, "FSDP-style units: blocks held in nn.ModuleLists become units",
                   {"wrap_classes": "auto"}),
    # hybrid presets: shard inside each island of the detected machine, replicate across islands
    "zero2_hybrid": (Zero2Strategy, "ZeRO-2 inside islands, replicated across",
                     {"shard_size": "auto", "topology": "detect"}),
    "zero3_hybrid": (Zero3Strategy, "ZeRO-3 inside islands, replicated across",
                     {"shard_size": "auto", "topology": "detect"}),
    "fsdp_shard_hybrid": (FSDPShardStrategy, "FSDP-style units inside islands, replicated across",
                          {"wrap_classes": "auto", "shard_size": "auto", "topology": "detect"}),
    # Lightning reserves "auto" for its own default strategy: the Hydra option strategy=auto maps here
    "zero_auto": (AutoStrategy, "the planner's recommendation for this model and machine", {}),
}
for _name, (_cls, _what, _params) in REGISTERED.items():
    if _name not in StrategyRegistry:
        StrategyRegistry.register(_name, _cls, description=f"lightning_shard {_what}", **_params)
    _fabric_cls = FABRIC_CLASSES.get(_name.replace("_hybrid", ""))  # Fabric: the same names, same knobs
    if _fabric_cls is not None and _name not in FABRIC_STRATEGY_REGISTRY:
        FABRIC_STRATEGY_REGISTRY.register(_name, _fabric_cls, description=f"lightning_shard {_what} (Fabric)",
                                          **_params)

__all__ = [
    "AutoStrategy",
    "FSDPShardFabricStrategy",
    "FSDPShardStrategy",
    "ShardedCheckpointIO",
    "ShardedPrecision",
    "Zero0FabricStrategy",
    "Zero0Strategy",
    "Zero1FabricStrategy",
    "Zero1Strategy",
    "Zero2FabricStrategy",
    "Zero2Strategy",
    "Zero3FabricStrategy",
    "Zero3Strategy",
    "ZeroFabricStrategy",
    "ZeroStrategy",
]
