"""lightning_shard: hand-written ZeRO sharding strategies for PyTorch Lightning.

Importing the package registers the strategy names (``Trainer(strategy="zero2")``).
"""

from .strategies import FSDPShardStrategy, Zero0Strategy, Zero1Strategy, Zero2Strategy, Zero3Strategy, ZeroStrategy

__version__ = "0.1.0"
__all__ = ["FSDPShardStrategy", "Zero3Strategy", "Zero0Strategy", "Zero1Strategy", "Zero2Strategy", "ZeroStrategy", "__version__"]
