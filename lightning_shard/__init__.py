"""lightning_shard: hand-written ZeRO sharding strategies for PyTorch Lightning.

``import lightning_shard`` imports the strategies, and with them torch and Lightning, and registers the strategy
names in Lightning's registries: ``Trainer(strategy="zero2")``, ``Fabric(strategy="zero3")`` (the table and the
registration are in ``lightning_shard/strategies/__init__.py``). Importing Lightning before or after makes no
difference. The classes are importable from here too: ``from lightning_shard import Zero2Strategy``.
"""

from . import strategies
from .strategies import *  # noqa: F403  (the strategy classes: strategies.__all__)
from .version import __version__

__all__ = [*strategies.__all__, "__version__"]
