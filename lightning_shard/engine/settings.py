"""The engine's own small settings: how stage-3 units are formed, the reduction dtype's names, and the
profiler labels of the engine's phases and of each collective's launch and wait. (The user-facing knob list is
``strategies/config.py``.)"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Optional

import torch

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
           "fp16": torch.float16, "float16": torch.float16}


# zero3: a unit holds at least this many MiB of parameters, or joins the unit enclosing it (``min_unit_mb``,
# engine/zero3/plan.py). A collective has a fixed cost besides its bytes: tens of microseconds on NCCL (nccl-tests'
# small-message latency), ~0.1-1 ms on gloo over loopback plus a Python hook and a thread hand-off (docs/speed.md,
# "zero3 merges modules smaller than min_unit_mb"). Below ~1 MiB that fixed cost is most of a unit's gather on either.
MIN_UNIT_MB = 1.0

# Units gathered ahead of use (``prefetch_depth``), per granularity. zero3's units are single modules, a fraction of
# a transformer block (HF GPT-2 6 x 384: 19 units of 1.7-3.6 MiB besides the root; fsdp_shard's 6 blocks are 6.8 MiB
# each), so one unit ahead leaves little compute to hide a gather behind; three ahead is about the bytes of
# fsdp_shard's one block ahead. Measured here (2 CPU ranks, gloo, issue 16's eighth round,
# bench/results/speed_round8_prefetch_gpt{2,}.md): zero3 with 3 ahead 1.053x / 1.033x FSDP2 (paired medians) against
# 1.003x / 0.946x with 1, on HF GPT-2 / the recipe GPT, at the same peak (VmHWM within 1 MiB per rank on both,
# bench/results/peak_round8_prefetch_gpt{2,}.md).
PREFETCH_DEPTH = {"zero3": 3, "fsdp": 1}


@dataclass
class UnitConfig:
    """Stage 3 only: how parameters are grouped into units and when they are gathered."""

    granularity: str = "zero3"  # "zero3": every module with direct parameters; "fsdp": wrap policy
    wrap_classes: Any = None  # fsdp: module classes (or class names) that become units
    min_params: Optional[int] = None  # fsdp: modules with at least this many parameters become units
    reshard_after_forward: bool = True  # free full parameters after forward (False: keep until backward)
    prefetch_depth: Optional[int] = None  # units gathered ahead of use, fwd and bwd; None: PREFETCH_DEPTH's
    leaf_modules: Any = None  # module classes, class names or FQNs whose whole subtree is one unit
    min_unit_mb: float = MIN_UNIT_MB  # zero3: smaller units join the unit enclosing them (engine/zero3/plan.py)

    def __post_init__(self) -> None:
        if self.prefetch_depth is None:
            self.prefetch_depth = PREFETCH_DEPTH.get(self.granularity, 1)


def parse_reduce_dtype(value: Optional[str]) -> Optional[torch.dtype]:
    if value is None or isinstance(value, torch.dtype):
        return value
    if value not in _DTYPES:
        raise ValueError(f"reduce_dtype must be null (fp32) or one of {sorted(_DTYPES)}, got {value!r}")
    return _DTYPES[value]


def parse_param_dtype(value: Optional[str]) -> Optional[torch.dtype]:
    """``param_dtype``: None (compute in the parameters' own dtype) or the dtype fp32 parameters are computed
    and gathered in (``"bf16"``/``"fp16"``; ``"fp32"`` is the same as None)."""
    if value is None or isinstance(value, torch.dtype):
        return None if value in (None, torch.float32) else value
    if value not in _DTYPES:
        raise ValueError(f"param_dtype must be null (no policy) or one of {sorted(_DTYPES)}, got {value!r}")
    return None if _DTYPES[value] is torch.float32 else _DTYPES[value]


def phase(fn):
    """Label an engine phase for ``torch.profiler`` as ``lightning_shard.<method>`` (what ``bench/`` times)."""
    label = f"lightning_shard.{fn.__name__.lstrip('_')}"

    @functools.wraps(fn)
    def labelled(*args, **kwargs):
        with torch.profiler.record_function(label):
            return fn(*args, **kwargs)
    return labelled


def label(name: str) -> Any:
    """A ``torch.profiler`` range ``lightning_shard.<name>`` while a profiler records, else nothing (so the hot
    path pays one flag check): the launch and the wait of each bucket's collectives (``reduce_launch``,
    ``reduce_wait``, ``gather_launch``, ``gather_wait``, ``param_gather_launch``, ``param_gather_wait``). A wait's
    range is time the rank's main thread was blocked on communication (exposed, not overlapped)."""
    if torch.autograd._profiler_enabled():
        return torch.profiler.record_function(f"lightning_shard.{name}")
    return contextlib.nullcontext()
