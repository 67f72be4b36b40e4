"""The option groups: :class:`Tuning` (and stage 3's :class:`Zero3Tuning`), :class:`Compression`, :class:`Safety`,
:class:`Launch`: the expert options, grouped by concern. Plain Python."""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from .fields import Fields, check_bool, dtype_name, is_positive, knob

# zero3: a unit holds at least this many MiB of parameters, or joins the unit enclosing it. A collective has a fixed
# cost besides its bytes: tens of microseconds on NCCL (nccl-tests' small-message latency), ~0.1-1 ms on gloo over
# loopback plus a Python hook and a thread hand-off (measured by the speed benchmark, docs/benchmarks.md).
# Below ~1 MiB that fixed cost is most of a unit's gather on either.
MIN_UNIT_MB = 1.0

# Units gathered ahead of use (``Tuning.prefetch_depth=None``), per unit granularity. zero3's units are single
# modules, a fraction of a transformer block, so one unit ahead leaves little compute to hide a gather behind; three
# ahead is about the bytes of fsdp_shard's one block ahead (the speed benchmark's prefetch comparison).
PREFETCH_DEPTH = {"zero3": 3, "fsdp": 1}

GATHER_QUANT = ("none", "int8")
REDUCE_QUANT = ("none", "int8", "int4")

@dataclass(kw_only=True)
class Tuning(Fields):
    """Sizes and overlap: how the work is cut and scheduled. The values stay the same whatever these are."""

    bucket_mb: float = knob(25.0, """Gradient bucket size in MiB (zero0-2; stage 3's units are its buckets): a bucket
        holds at most this much, unless one parameter alone is larger. Larger buckets: fewer collectives; smaller:
        earlier overlap with backward. On CPU keep it below 32: glibc maps larger per-step buffers (zero2's gradient
        buckets, the all-to-all pieces) fresh from the kernel every step.""")
    overlap: bool = knob(True, "Launch bucket reductions from gradient hooks during backward.")
    overlap_param_gather: bool = knob(True, """zero1/zero2 all-gather updated parameters in the background after the
        step; each module waits for its own bucket in its forward.""")
    optim_chunk_mb: float = knob(4.0, """The optimizer steps the shard in views of this many MiB: identical results,
        cache-friendly on CPU.""")
    broadcast_buffers: bool = knob(True, "Broadcast buffers (BatchNorm statistics) from rank 0 after every "
                                         "optimizer step.")
    find_unused_parameters: bool = knob(True, """``True``: parameters that got no gradient on any rank in a window are
        left out of the step exactly as torch leaves a parameter whose ``.grad`` is None (no momentum, weight decay or
        Adam step), so the result is that of one process; costs one all-reduce of one byte per parameter per optimizer
        step. ``False`` skips that all-reduce: such parameters step with a zero gradient (momentum and weight decay
        still move them) and a warning names them once per rank.""")

    def validate(self, stage: int) -> None:
        for name in ("bucket_mb", "optim_chunk_mb"):
            if not is_positive(getattr(self, name)):
                raise ValueError(f"{name} must be a positive number of MiB, got {getattr(self, name)!r}")
        for name in ("overlap", "overlap_param_gather", "broadcast_buffers", "find_unused_parameters"):
            check_bool(self, name)
        self.bucket_mb, self.optim_chunk_mb = float(self.bucket_mb), float(self.optim_chunk_mb)


@dataclass(kw_only=True)
class Zero3Tuning(Tuning):
    """:class:`Tuning` plus when stage 3 gathers and frees its units, and how zero3 forms them."""

    reshard_after_forward: bool = knob(True, """Free a unit's full parameters after its forward (full shard); False
        keeps them until its backward (ZeRO-2-like traffic, more memory).""")
    prefetch_depth: Optional[int] = knob(None, """Units all-gathered ahead of use, in forward and in backward (0
        disables); ``None``: 3 for zero3 (its units are single modules, a fraction of a block: three ahead is about
        the bytes of fsdp_shard's one block ahead), 1 for fsdp_shard. Each one ahead holds one more unit's full
        parameters.""")
    min_unit_mb: float = knob(MIN_UNIT_MB, """zero3: a module whose unit would hold fewer MiB of parameters than this
        joins the unit of the module enclosing it (one all-gather and one reduction instead of one each per small
        module, each with a fixed cost besides its bytes). Bounded by 1/64 of the model's parameter bytes, so a small
        model keeps several units. ``0``: every module with parameters is a unit (DeepSpeed's stage-3 granularity).
        Not used by fsdp_shard, whose wrap policy chooses its units.""")

    def validate(self, stage: int) -> None:
        super().validate(stage)
        check_bool(self, "reshard_after_forward", " (free parameters after forward, or keep them until backward)")
        if self.prefetch_depth is not None and (isinstance(self.prefetch_depth, bool) or
                                                not isinstance(self.prefetch_depth, int) or self.prefetch_depth < 0):
            raise ValueError(f"prefetch_depth must be None (the strategy's own) or an integer >= 0 (units gathered "
                             f"ahead), got {self.prefetch_depth!r}")
        if isinstance(self.min_unit_mb, bool) or not isinstance(self.min_unit_mb, (int, float)) or \
                self.min_unit_mb < 0:
            raise ValueError(f"min_unit_mb must be a number of MiB >= 0 (0: one unit per module with parameters), "
                             f"got {self.min_unit_mb!r}")
        self.min_unit_mb = float(self.min_unit_mb)

    def prefetch(self, granularity: str) -> int:
        """Units gathered ahead for units of ``granularity`` ("zero3" or "fsdp")."""
        return PREFETCH_DEPTH[granularity] if self.prefetch_depth is None else self.prefetch_depth


@dataclass(kw_only=True)
class Compression(Fields):
    """What gradients and parameters travel as (fewer bytes, within a bounded error)."""

    reduce_dtype: Optional[str] = knob(None, """``None`` (fp32 reduction, default) or ``"bf16"``/``"fp16"``/``"fp32"``
        to reduce gradients in that precision.""", choices=(None, "fp32", "bf16", "fp16"))
    gather_quant: str = knob("none", """Compressed parameter all-gathers (zero3 / fsdp_shard; ZeRO++'s qwZ):
        ``"int8"`` sends each rank's shard block-quantized (one fp32 scale per ``block`` elements) in the gathers of
        forward and backward: ~1/4 of fp32's bytes, ~1/2 of bf16's. The fp32 masters, the optimizer and what
        ``state_dict()`` / the end of fit / ``gathered_params()`` give stay exact; forward and backward compute with
        the quantized weights. ``"none"``: off. zero0-2 refuse it (their replicas are what you save).""",
                             choices=GATHER_QUANT)
    reduce_quant: str = knob("none", """Compressed gradient reductions (zero1-3, fsdp_shard; ZeRO++'s qgZ):
        ``"int8"`` / ``"int4"`` quantize each rank's gradient bucket piece by piece (one fp32 scale per ``block``
        elements) and send the pieces in an all-to-all; each rank sums its N pieces in fp32. With ``error_feedback``
        each rank keeps what quantization lost and adds it to its next reduction. Bytes: ~1/4 (int8) or ~1/8 (int4)
        of fp32's. Not with ``reduce_dtype``; a world of one rank sends nothing and quantizes nothing. ``"none"``:
        off.""", choices=REDUCE_QUANT)
    error_feedback: bool = knob(True, """``reduce_quant``: carry each rank's quantization error to its next reduction
        (the long-run sum of applied gradients equals the computed one; 4 bytes per trainable parameter per rank, not
        checkpointed: a resume starts it at zero). ``False``: plain rounding, no residual memory; values below half a
        quantization step of their block are lost every step.""")
    block: int = knob(256, """Elements per quantization scale for ``gather_quant`` / ``reduce_quant`` (a multiple of
        8): smaller blocks, smaller error and more scale bytes (4 per block).""")

    def validate(self, stage: int) -> None:
        self.reduce_dtype = dtype_name(self.reduce_dtype, "reduce_dtype", "fp32")
        self._check_choice("gather_quant")
        self._check_choice("reduce_quant")
        check_bool(self, "error_feedback")
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 8 or self.block % 8:
            raise ValueError(f"block must be a positive multiple of 8 (elements per quantization scale), got "
                             f"{self.block!r}")
        if self.gather_quant != "none" and stage != 3:
            raise ValueError(f"gather_quant={self.gather_quant!r} quantizes the parameter all-gathers of forward and "
                             f"backward, which only stage 3 has (zero3, fsdp_shard); zero{stage} keeps full "
                             "parameters on every rank (its post-step all-gather would leave quantized weights in the "
                             "replicas and in what you save): drop gather_quant or use zero3/fsdp_shard")
        if self.reduce_quant != "none":
            if stage == 0:
                raise ValueError(f"reduce_quant={self.reduce_quant!r} quantizes the gradient reduce-scatter (zero1-3, "
                                 "fsdp_shard); zero0 all-reduces: use zero1 (the same memory for gradients, the same "
                                 "bytes) with reduce_quant")
            if self.reduce_dtype is not None:
                raise ValueError(f"reduce_quant={self.reduce_quant!r} and reduce_dtype={self.reduce_dtype!r} both "
                                 "choose how gradients travel: set one of them")


@dataclass(kw_only=True)
class Safety(Fields):
    """Checks and limits: what is refused, checked or given up on, and when."""

    timeout_s: float = knob(1800.0, """Collective timeout in seconds: a rank that died or stalled ends the job with an
        error naming the collective instead of a hang.""")
    skip_nonfinite: Optional[bool] = knob(None, """fp32/bf16: ``None`` (no check), ``True`` (a non-fp16 step whose
        gradients hold inf/nan is skipped on every rank with a warning naming the parameter), ``False`` (raise with
        that name). One small all-reduce per step when set. fp16 always uses agreed loss scaling instead.""")
    debug_collectives: bool = knob(False, """Check at every optimizer step that all ranks issued the same collectives
        (a desync names the first differing one). Model fingerprints are always compared at setup.""")
    allow_custom_optimizer: bool = knob(False, "Accept optimizers not known to be element-wise (see "
                                               "``engine/buckets/optim.py``).")
    strict_placement: bool = knob(False, "Make the placement warning (ranks spanning slow links) an error.")

    def validate(self, stage: int) -> None:
        if not is_positive(self.timeout_s):
            raise ValueError(f"timeout_s must be a positive number of seconds, got {self.timeout_s!r}")
        if self.skip_nonfinite not in (None, True, False):
            raise ValueError(f"skip_nonfinite must be None (no check), True (skip the step with a warning) or False "
                             f"(raise), got {self.skip_nonfinite!r}")
        for name in ("debug_collectives", "allow_custom_optimizer", "strict_placement"):
            check_bool(self, name)


@dataclass(kw_only=True)
class Launch(Fields):
    """The processes and their rendezvous."""

    start_method: str = knob("popen", """``"popen"`` (re-runs the script per rank like DDP), ``"fork"``,
        ``"spawn"`` or ``"forkserver"``.""", choices=("popen", "fork", "spawn", "forkserver"))
    process_group_backend: Optional[str] = knob(None, """``None`` (``nccl`` on CUDA, ``gloo`` on CPU) or a backend
        name for ``torch.distributed.init_process_group``.""")
    startup_timeout_s: float = knob(1800.0, """How long the ranks may take to find each other at start-up: slow
        imports on a loaded machine or ranks started minutes apart by a scheduler are not a collective timeout.""")

    def validate(self, stage: int) -> None:
        self._check_choice("start_method")
        if not is_positive(self.startup_timeout_s):
            raise ValueError(f"startup_timeout_s must be a positive number of seconds, got {self.startup_timeout_s!r}")


GROUPS: tuple[type, ...] = (Tuning, Zero3Tuning, Compression, Safety, Launch)


def as_group(cls: type, value: Any, name: str) -> Any:
    """An option group from its dataclass, a mapping of its fields (Hydra gives one) or None (its defaults)."""
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if isinstance(value, Fields):  # e.g. a Tuning where zero3 takes Zero3Tuning: keep what was set
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}  # type: ignore[arg-type]
    if isinstance(value, Mapping):
        valid = cls.names()
        unknown = [k for k in value if k not in valid]
        if unknown:
            hints = [f"{k!r}" + (f" (did you mean {c[0]!r}?)" if (c := difflib.get_close_matches(str(k), valid, 1))
                                 else "") for k in unknown]
            raise TypeError(f"{name}: unknown option(s) {', '.join(hints)}; {cls.__name__} has {', '.join(valid)}")
        return cls(**dict(value))
    raise TypeError(f"{name} must be a {cls.__name__}(...) or a mapping of its fields, got {value!r}")



__all__ = ["GATHER_QUANT", "GROUPS", "MIN_UNIT_MB", "PREFETCH_DEPTH", "REDUCE_QUANT", "Compression", "Launch", "Safety",
           "Tuning", "Zero3Tuning"]
