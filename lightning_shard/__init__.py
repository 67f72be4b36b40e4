"""lightning_shard: hand-written ZeRO sharding strategies for PyTorch Lightning.

Importing the package registers the strategy names (``Trainer(strategy="zero2")``), without importing torch
itself: the strategies (and with them torch and Lightning) load when Lightning does, or when one of the
classes below is first used (``from lightning_shard import Zero2Strategy``). So the tools that need neither
(``lightning-shard --help``, ``lightning-shard topo``) start in well under a second.
"""

from __future__ import annotations

import importlib
import sys
from importlib.abc import MetaPathFinder
from typing import Any

__version__ = "0.1.0"
_STRATEGIES = ("FSDPShardStrategy", "Zero3Strategy", "Zero0Strategy", "Zero1Strategy", "Zero2Strategy", "ZeroStrategy")
__all__ = [*_STRATEGIES, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _STRATEGIES:
        value = getattr(importlib.import_module("lightning_shard.strategies"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_STRATEGIES))


def _register_strategies() -> None:
    """Import ``lightning_shard.strategies``, which registers the names in Lightning's StrategyRegistry."""
    _remove_hook()
    if "lightning_shard.strategies" not in sys.modules:  # else it is being imported and registers itself
        importlib.import_module("lightning_shard.strategies")


class _AfterLightningImport(MetaPathFinder):
    """Registers the strategy names right after the ``lightning`` package has been imported.

    ``lightning/__init__.py`` imports ``lightning.pytorch`` whole (Trainer included), so when it has run,
    ``lightning_shard.strategies`` can import what it needs. The finder only wraps the spec that the other
    finders return for ``lightning``, and removes itself once it has fired.
    """

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != "lightning":
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        exec_module = getattr(loader, "exec_module", None)
        if exec_module is None:
            return spec

        def exec_then_register(module: Any) -> None:
            exec_module(module)
            _register_strategies()

        try:
            loader.exec_module = exec_then_register  # this loader object belongs to this spec alone
        except (AttributeError, TypeError):
            return spec
        return spec


_HOOK = _AfterLightningImport()


def _remove_hook() -> None:
    if _HOOK in sys.meta_path:
        sys.meta_path.remove(_HOOK)


if "lightning" in sys.modules:  # Lightning is already loaded (`import lightning as L; import lightning_shard`)
    _register_strategies()
else:
    sys.meta_path.insert(0, _HOOK)
