"""Memory, communication and time cost model of the strategies; strategy advice
(docs/architecture.md, "Design rules" 3-6).

    from lightning_shard.planner import plan, recommend_for, auto_policy

The names load on first use (module ``__getattr__``): importing the package, e.g. for ``lightning-shard plan
--help``, does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {"Job": "config", "StrategyConfig": "config", "batch_split": "config", "PlanResult": "recommend",
         "Recommendation": "recommend", "auto_policy": "recommend", "plan": "recommend", "recommend_for": "recommend"}
__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
