"""The options of the lightning_shard strategies, written once: name, type, default, choices, documentation and the
rules their values obey. Plain Python (no torch, no Lightning, no Hydra), so every layer reads the same list: the
engine (what it builds), the Trainer and Fabric strategies (their signatures and docstrings), the planner (the
options of the rows it plans), the Hydra schemas (``app/schema.py``, so ``conf/strategy/*.yaml`` hold only what
differs from the defaults) and the pre-launch checks.

The surface, as users meet it::

    Zero2Strategy(accumulation="per_micro_batch", param_dtype="bf16", offload_optimizer=True,
                  tuning=Tuning(bucket_mb=50), safety=Safety(timeout_s=600))

The few options most users set first are flat (accumulation, precision policy, activation checkpointing,
offload, checkpoint format, hybrid layout); the expert ones are grouped by concern: :class:`Tuning` (sizes and
overlap), :class:`Compression` (what gradients and parameters travel as), :class:`Safety` (checks and limits),
:class:`Launch` (processes and their rendezvous). A group may be given as its dataclass or as a mapping of its
fields (``tuning={"bucket_mb": 50}``; Hydra: ``strategy.tuning.bucket_mb=50``).

Each field's ``metadata``: ``doc`` (what ``help()`` shows), optionally ``choices`` (the accepted values, checked
by ``validate`` and before launch) and ``hydra=False`` for an option that is not a Hydra key (``stage``: the Hydra
option, e.g. ``strategy=zero1``, chooses it).
"""

from __future__ import annotations

from .fields import knob, merge
from .groups import GROUPS, MIN_UNIT_MB, PREFETCH_DEPTH, Compression, Launch, Safety, Tuning, Zero3Tuning
from .strategies import (
    OPTIONS,
    POLICIES,
    REGISTERED,
    AutoOptions,
    FSDPOptions,
    Zero3Options,
    ZeroOptions,
    convert,
    options_for,
)

__all__ = ["GROUPS", "MIN_UNIT_MB", "OPTIONS", "POLICIES", "PREFETCH_DEPTH", "REGISTERED", "AutoOptions", "Compression",
           "FSDPOptions", "Launch", "Safety", "Tuning", "Zero3Options", "Zero3Tuning", "ZeroOptions", "convert", "knob",
           "merge", "options_for"]
