"""lightning_shard: hand-written ZeRO sharding strategies for PyTorch Lightning.

``import lightning_shard`` imports the strategies, and with them torch and Lightning, and registers the strategy
names in Lightning's registries: ``Trainer(strategy="zero2")``, ``Fabric(strategy="zero3")`` (the table and the
registration are in ``lightning_shard/strategies/__init__.py``). Importing Lightning before or after makes no
difference. The classes are importable from here too: ``from lightning_shard import Zero2Strategy``.
"""

from .strategies import (
    AutoStrategy,
    FSDPShardFabricStrategy,
    FSDPShardStrategy,
    Zero0FabricStrategy,
    Zero0Strategy,
    Zero1FabricStrategy,
    Zero1Strategy,
    Zero2FabricStrategy,
    Zero2Strategy,
    Zero3FabricStrategy,
    Zero3Strategy,
    ZeroFabricStrategy,
    ZeroStrategy,
)
from .version import __version__

__all__ = [
    "AutoStrategy",
    "FSDPShardFabricStrategy",
    "FSDPShardStrategy",
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
    "__version__",
]
