"""The knobs of the lightning_shard strategies, written once: name, type, default, choices, documentation, and the
rules their values must obey.

Everything else is derived from these dataclasses: the strategy classes' keyword-only signatures, ``KNOBS`` and
"Knobs" docstring sections (``strategies/knobs.py``), the Hydra structured-config schemas (``app/schema.py``, so
``conf/strategy/*.yaml`` hold only what differs from the defaults), the value choices the pre-launch check offers
(``app/checks.py``) and the README's knob table (checked by tests/config/test_knob_list.py).

Each field's ``metadata``: ``doc`` (the text ``help()`` shows), optionally ``choices`` (the accepted values, checked
by :meth:`ZeroConfig.validate` and before launch) and ``hydra=False`` for a knob that is not a Hydra key (``stage``:
the Hydra option, e.g. ``strategy=zero1``, chooses it). Torch and Lightning only: no Hydra here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Optional, Union

from ..engine.activation import validate_spec
from ..engine.comm.quant import check_quant
from ..engine.settings import MIN_UNIT_MB, PREFETCH_DEPTH, parse_param_dtype, parse_reduce_dtype
from .layout import validate_secondary_shard, validate_shard_size


def knob(default: Any, doc: str, *, choices: Optional[tuple] = None, hydra: bool = True) -> Any:
    """A documented knob field."""
    meta: dict[str, Any] = {"doc": " ".join(doc.split())}
    if choices is not None:
        meta["choices"] = tuple(choices)
    if not hydra:
        meta["hydra"] = False
    return field(default=default, metadata=meta)


def _is_seconds(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and value > 0


def _is_mib(value: Any) -> bool:
    return isinstance(value, (int, float)) and value > 0


@dataclass(kw_only=True)
class ZeroConfig:
    """zero0 / zero1 / zero2 (``ZeroStrategy`` and its presets)."""

    STAGES: ClassVar[tuple[int, ...]] = (0, 1, 2)

    stage: Optional[int] = knob(None, "ZeRO stage (0, 1 or 2); None = the strategy class's own (0/1/2 for "
                                      "zero0/1/2).", hydra=False)
    accumulation: str = knob("auto", """What non-boundary micro-batches communicate: ``defer`` nothing (full gradients
        held until the boundary); ``per_micro_batch`` (zero2 only) reduce-scatters every micro-batch into an fp32 shard
        accumulator and frees the full gradients; ``auto`` picks one at setup and logs why.""",
                             choices=("auto", "defer", "per_micro_batch"))
    bucket_mb: float = knob(25.0, """Gradient bucket size in MiB (zero0-2; no effect at stage 3, where units are the
        buckets): a bucket holds at most this much, unless one parameter alone is larger. Larger buckets: fewer
        collectives; smaller: earlier overlap with backward. On CPU keep it below 32: glibc maps larger per-step
        buffers (zero2's gradient buckets, the all-to-all pieces) fresh from the kernel every step.""")
    reduce_dtype: Optional[str] = knob(None, """``None`` (fp32 reduction, default) or ``"bf16"``/``"fp16"``/``"fp32"``
        to reduce gradients in that precision.""", choices=(None, "fp32", "bf16", "fp16"))
    param_dtype: Optional[str] = knob(None, """Mixed-precision policy for fp32 models (as FSDP2's
        ``MixedPrecisionPolicy``): ``"bf16"``/``"fp16"`` keep each rank's owned elements as fp32 masters (the optimizer
        steps them) and hold, gather and compute the parameters in that dtype (half the parameter all-gather bytes
        and half the full-parameter memory); a module's floating inputs are cast to it; gradients reduce in fp32
        unless ``reduce_dtype`` says otherwise; after fit the module holds the fp32 masters again. Needs
        ``Trainer(precision="32-true")`` (or ``"bf16-mixed"``; ``"fp16"`` needs ``"16-mixed"`` for loss scaling).
        zero0-2: every floating parameter must be trained (frozen ones: use zero3/fsdp_shard). ``None``: off.""",
                                      choices=(None, "fp32", "bf16", "fp16"))
    offload_optimizer: bool = knob(False, """ZeRO-Offload: keep each rank's fp32 master shard, its gradient and the
        optimizer state in host memory (pinned on CUDA) and step the optimizer on the CPU; the averaged gradient shard
        is copied out after its reduction and the updated shard copied back before the parameter all-gather. Saves
        on the accelerator the optimizer state (8 bytes per parameter / N for Adam) and the fp32 masters of bf16
        parameters (4 / N); costs two copies of the shard per step and a CPU optimizer step. (On a CPU-only machine
        host memory is the only memory: the same code runs, with nothing saved.)""")
    reduce_scatter_via: str = knob("auto", """How zero1-3 reduce-scatter a gradient bucket: ``"reduce_scatter"`` (the
        backend's own collective: (N-1)/N of the bucket's bytes per rank), ``"all_to_all"`` (an all-to-all of the
        bucket, rank j receiving every rank's j-th 1/N, and a sum of the N pieces: the same bytes, plus a second
        full-size buffer while in flight; on 2 ranks the other rank's piece arrives straight into the shard, with no
        such buffer), ``"all_reduce"`` (an in-place all-reduce of the bucket, of which each rank
        keeps its range: the same sums, twice the bytes), ``"auto"``: ``all_to_all`` on gloo, where it beats gloo's
        reduce-scatter 1.7-7x and, but for one size, the all-reduce 1.3-10x at 64 KiB-25 MiB on 2 and 4 ranks
        (bench/results/collectives.md), ``reduce_scatter`` on every other backend (NCCL). The ledger records the
        collective that runs.""", choices=("auto", "reduce_scatter", "all_reduce", "all_to_all"))
    all_gather_via: str = knob("auto", """How zero1/2 (after each step) and zero3 / fsdp_shard (each unit, in forward
        and backward) all-gather parameters: ``"all_gather"`` (the backend's collective), ``"broadcast"`` (N broadcasts,
        each rank's from its own slot of the output: the same (N-1)/N of the bytes per rank, in place), ``"auto"``:
        ``broadcast`` on gloo for buckets of 1 MiB or more, where it beats gloo's all-gather 1.4-4.2x at 4-88 MiB on
        2 ranks and 1.05-3.3x at 25-88 MiB on 4, with 24-81% of its CPU time (bench/results/collectives_gather*.md;
        smaller, runs disagree), ``all_gather`` below that and on every other
        backend (NCCL). The ledger records an all-gather either way (marked ``via="broadcast"``).""",
                               choices=("auto", "all_gather", "broadcast"))
    huge_pages: bool = knob(True, """CPU only: advise the large buffers the engine allocates every step (4 MiB or more:
        zero2/zero3's full gradient buckets, the pieces and shards of gradient reductions, the parameters zero3 /
        fsdp_shard gather per unit) as transparent huge pages (Linux ``madvise(MADV_HUGEPAGE)``, where
        ``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always`` or ``madvise``). torch's CPU allocator has no
        cache, so such buffers are mapped fresh each step and every 4 KiB page faults on first touch; a fresh 88 MiB
        buffer filled 4.4x faster advised (bench/results/hugepages.md). The values are the same either way. Where
        memory is fragmented the kernel may compact it to find a huge page (its THP ``defrag`` setting): set
        ``False`` if steps stall in page faults. ``False``: plain pages. No effect on CUDA (its caching allocator),
        off Linux, or where THP is ``never``.""")
    gather_quant: str = knob("none", """Compressed parameter all-gathers (zero3 / fsdp_shard; ZeRO++'s qwZ):
        ``"int8"`` sends each rank's shard block-quantized (one fp32 scale per ``quant_block`` elements) in the gathers
        of forward and backward: ~1/4 of fp32's bytes, ~1/2 of bf16's. The fp32 masters, the optimizer and what
        ``state_dict()`` / the end of fit / ``gathered_params()`` give stay exact; forward and backward compute with
        the quantized weights. ``"none"``: off (default). zero0-2 refuse it (their replicas are what you save).""",
                             choices=("none", "int8"))
    reduce_quant: str = knob("none", """Compressed gradient reductions (zero1-3, fsdp_shard; ZeRO++'s qgZ):
        ``"int8"`` / ``"int4"`` quantize each rank's gradient bucket piece by piece (one fp32 scale per
        ``quant_block`` elements) and send the pieces in an all-to-all; each rank sums its N pieces in fp32. Each rank
        keeps what quantization lost and adds it to its next reduction (error feedback), so over many steps the applied
        gradients sum to the computed ones; that residual costs 4 bytes per trainable parameter per rank (it is not
        checkpointed: a resume starts it at zero). Bytes: ~1/4 (int8) or ~1/8 (int4) of fp32's. Not with
        ``reduce_dtype`` or a ``reduce_scatter_via`` other than ``"auto"``/``"all_to_all"``; a world of one rank sends
        nothing and quantizes nothing. ``"none"``: off (default).""", choices=("none", "int8", "int4"))
    quant_error_feedback: bool = knob(True, """``reduce_quant``: carry each rank's quantization error to its next
        reduction (the long-run sum of applied gradients equals the computed one; 4 bytes per trainable parameter per
        rank). ``False``: plain rounding, no residual memory; values below half a quantization step of their block are
        lost every step (tests/distributed/test_quant_dist.py shows it).""")
    quant_block: int = knob(256, """Elements per quantization scale for ``gather_quant`` / ``reduce_quant`` (a
        multiple of 8): smaller blocks, smaller error and more scale bytes (4 per block).""")
    overlap: bool = knob(True, "Launch bucket reductions from gradient hooks during backward.")
    broadcast_buffers: bool = knob(True, "Broadcast buffers (BatchNorm statistics) from rank 0 after every "
                                         "optimizer step.")
    start_method: str = knob("popen", """``"popen"`` (re-runs the script per rank like DDP), ``"fork"``,
        ``"spawn"`` or ``"forkserver"``.""", choices=("popen", "fork", "spawn", "forkserver"))
    process_group_backend: Optional[str] = knob(None, """``None`` (``nccl`` on CUDA, ``gloo`` on CPU) or a backend
        name for ``torch.distributed.init_process_group``.""")
    timeout_s: float = knob(1800.0, """Collective timeout in seconds: a rank that died or stalled ends the job with an
        error naming the collective instead of a hang.""")
    startup_timeout_s: float = knob(1800.0, """How long the ranks may take to find each other at start-up: slow
        imports on a loaded machine or ranks started minutes apart by a scheduler are not a collective timeout.""")
    allow_custom_optimizer: bool = knob(False, "Accept optimizers not known to be element-wise (see "
                                               "``engine/buckets/optim.py``).")
    find_unused_parameters: bool = knob(True, """``True``: parameters that got no gradient on any rank in a window are
        left out of the step exactly as torch leaves a parameter whose ``.grad`` is None (no momentum, weight decay or
        Adam step), so the result is that of one process; costs one all-reduce of one byte per parameter per optimizer
        step. ``False`` skips that all-reduce: such parameters step with a zero gradient (momentum and weight decay
        still move them) and a warning names them once per rank.""")
    shard_size: Union[None, int, str] = knob(None, """Hybrid sharding: ``None`` shards over every rank; an integer S
        shards inside groups of S consecutive ranks and replicates across groups (gradients: reduce-scatter inside the
        group, one all-reduce of the shard across groups at the boundary); ``"auto"`` takes S from ``topology``'s
        islands.""")
    topology: Optional[str] = knob(None, """Preset name (``conf/topology``), capture file, or ``"detect"``: used by
        ``shard_size="auto"`` and by the placement check at setup (a warning when traffic crosses slow links
        needlessly); ``None``: no check.""")
    strict_placement: bool = knob(False, "Make the placement warning (ranks spanning slow links) an error.")
    optim_chunk_mb: float = knob(4.0, """The optimizer steps the shard in views of this many MiB: identical results,
        cache-friendly on CPU.""")
    overlap_param_gather: bool = knob(True, """zero1/zero2 all-gather updated parameters in the background after the
        step; each module waits for its own bucket in its forward.""")
    state_dict_type: str = knob("sharded", """``"sharded"`` (each rank writes its shards into a checkpoint directory,
        committed atomically), ``"full"`` (rank 0 writes one consolidated file) or ``"dcp"`` (a
        ``torch.distributed.checkpoint`` directory: DCP's tools, FSDP2 and Lightning's ModelParallelStrategy read it).
        All load into any strategy, as do DCP directories written by FSDP2 / Lightning.""",
                                choices=("sharded", "full", "dcp"))
    skip_nonfinite: Optional[bool] = knob(None, """fp32/bf16: ``None`` (no check), ``True`` (a non-fp16 step whose
        gradients hold inf/nan is skipped on every rank with a warning naming the parameter), ``False`` (raise with
        that name). One small all-reduce per step when set. fp16 always uses agreed loss scaling instead.""")
    debug_collectives: bool = knob(False, """Check at every optimizer step that all ranks issued the same collectives
        (a desync names the first differing one). Model fingerprints are always compared at setup.""")
    activation_checkpointing: Any = knob(None, """Recompute activations in backward instead of keeping them: ``None``
        (off), ``"auto"`` (the blocks held in ``nn.ModuleList``s, as ``wrap_classes="auto"`` finds them) or module
        classes / class names (``["GPT2Block"]``). Each block's training forward runs under non-reentrant
        ``torch.utils.checkpoint``, replaced on the instance (parameter names and checkpoints unchanged); stage 3
        gathers each unit once in backward, the recomputation included. Logged once at setup (engine/activation.py).""")

    # ------------------------------------------------------------------ the knobs, as data
    @classmethod
    def knobs(cls) -> tuple[dataclasses.Field, ...]:
        return dataclasses.fields(cls)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        return {f.name: f.default for f in dataclasses.fields(cls)}

    @classmethod
    def choices(cls, name: str, stage: Optional[int] = None) -> Optional[tuple]:
        """The values knob ``name`` accepts (None: not a choice knob); ``stage`` narrows ``accumulation``."""
        valid = cls.__dataclass_fields__[name].metadata.get("choices")
        if name == "accumulation" and valid is not None and stage is not None and stage < 2:
            # zero0/zero1 hold full gradients anyway: per_micro_batch is zero2's
            valid = tuple(v for v in valid if v != "per_micro_batch")
        return valid

    # ------------------------------------------------------------------ the rules, once
    def _check_choice(self, name: str) -> None:
        valid = self.choices(name)
        if getattr(self, name) not in valid:
            raise ValueError(f"{name} must be one of {valid}, got {getattr(self, name)!r}")

    def validate(self, owner: Optional[str] = None) -> "ZeroConfig":
        """Raise ValueError naming the knob and the fix; normalise numbers. ``owner``: the strategy class named in
        messages. ``stage`` must be set (the strategy resolves ``None`` to its own stage first)."""
        owner = owner or type(self).__name__
        stage = self.stage
        if stage not in self.STAGES:
            raise ValueError(f"stage must be one of {self.STAGES} for {owner}, got {stage!r}"
                             + ("; use Zero3Strategy or FSDPShardStrategy for stage 3" if stage == 3 else ""))
        self._check_choice("accumulation")
        if self.accumulation not in self.choices("accumulation", stage):
            raise ValueError(f"accumulation='per_micro_batch' needs sharded gradients (zero2); zero{stage} holds "
                             "full gradients anyway: use accumulation='defer' or 'auto'.")
        if not _is_mib(self.bucket_mb):
            raise ValueError(f"bucket_mb must be a positive number of MiB, got {self.bucket_mb!r}")
        self._check_choice("start_method")
        self._check_choice("reduce_scatter_via")
        self._check_choice("all_gather_via")
        for name in ("timeout_s", "startup_timeout_s"):
            if not _is_seconds(getattr(self, name)):
                raise ValueError(f"{name} must be a positive number of seconds, got {getattr(self, name)!r}")
        parse_reduce_dtype(self.reduce_dtype)  # also takes torch dtypes and long names ("bfloat16")
        self._check_choice("gather_quant")
        self._check_choice("reduce_quant")
        check_quant(stage, self.gather_quant, self.reduce_quant, self.quant_block, self.reduce_dtype,
                    self.reduce_scatter_via)
        if self.quant_error_feedback not in (True, False):
            raise ValueError(f"quant_error_feedback must be True or False, got {self.quant_error_feedback!r}")
        parse_param_dtype(self.param_dtype)
        validate_shard_size(self.shard_size)
        if self.shard_size is not None and stage == 0:
            raise ValueError("zero0 replicates everything, so there is nothing to shard inside a group: "
                             "drop shard_size, "
                             "or use zero2/zero3 with shard_size for hybrid sharding")
        if not _is_mib(self.optim_chunk_mb):
            raise ValueError(f"optim_chunk_mb must be a positive number of MiB, got {self.optim_chunk_mb!r}")
        self._check_choice("state_dict_type")
        if not isinstance(self.offload_optimizer, bool):
            raise ValueError(f"offload_optimizer must be True or False, got {self.offload_optimizer!r}")
        if self.skip_nonfinite not in (None, True, False):
            raise ValueError(f"skip_nonfinite must be None (no check), True (skip the step with a warning) or False "
                             f"(raise), got {self.skip_nonfinite!r}")
        self.activation_checkpointing = validate_spec(self.activation_checkpointing)  # classes: matched at setup
        self.bucket_mb, self.optim_chunk_mb = float(self.bucket_mb), float(self.optim_chunk_mb)
        return self


def _param_init_fn() -> Any:
    return knob(None, """Deferred init (``configure_model``): called as ``fn(module)`` to initialise a module's own
        parameters; ``None``: the module's ``reset_parameters()``.""")


@dataclass(kw_only=True)
class Zero3Config(ZeroConfig):
    """zero3: parameters sharded too; every module with direct parameters is a unit."""

    STAGES: ClassVar[tuple[int, ...]] = (3,)

    accumulation: str = knob("auto", """``"per_micro_batch"`` (reduce-scatter every micro-batch into an fp32 shard
        accumulator), ``"keep_unsharded_grads"`` (hold full gradients over the window, one reduce-scatter per step),
        ``"keep_params"`` (parameters stay gathered over the window: one all-gather and one reduce-scatter per step),
        or ``"auto"`` (picks one at setup and logs why).""",
                             choices=("auto", "per_micro_batch", "keep_unsharded_grads", "keep_params"))
    reshard_after_forward: bool = knob(True, """Free a unit's full parameters after its forward (full shard); False
        keeps them until its backward (ZeRO-2-like traffic, more memory).""")
    prefetch_depth: int = knob(PREFETCH_DEPTH["zero3"], """Units all-gathered ahead of use, in forward and in backward
        (0 disables). zero3: 3 (its units are single modules, a fraction of a block: three ahead is about the bytes of
        fsdp_shard's one block ahead); fsdp_shard: 1. Every unit's start keeps the next ones issued, and the starts of
        the forward and of the backward issue the first ones (behind the root's gather, and the loss's and an LM head's
        backward). Each one ahead holds one more unit's full parameters.""")
    offload_params: bool = knob(False, """ZeRO-Offload of the parameters too (with ``offload_optimizer=True``): each
        unit's persistent shard lives in host memory (pinned on CUDA) and is copied to the device just before its
        all-gather, so the accelerator holds only the gathered units (and gradients in flight).""")
    secondary_shard: Union[None, int, str] = knob(None, """hpZ (ZeRO++): after a unit's first all-gather of an
        optimizer step (over every rank), each rank keeps its 1/I of the gathered unit, I the ranks of its island, so
        that the unit's other gathers until the optimizer step (backward, later micro-batches) run inside the island
        only: ``"island"`` takes I from ``topology``'s islands, an integer I groups consecutive ranks. Costs 1/I of
        every unit's full bytes per rank, held from its first gather to the optimizer step; the values are the
        first gather's (with ``gather_quant``, its dequantized ones). ``None``: off. Not with ``shard_size``
        (hybrid sharding keeps every gather inside the shard group already).""")
    param_init_fn: Optional[Callable] = _param_init_fn()
    min_unit_mb: float = knob(MIN_UNIT_MB, """zero3: a module whose unit would hold fewer MiB of parameters than this
        joins the unit of the module enclosing it (a block then holds its layer norms and small projections: one
        all-gather in forward, one in backward and one reduction instead of one each per small module, each with a
        fixed cost besides its bytes). Bounded by 1/64 of the model's parameter bytes, so a small model keeps several
        units. ``0``: every module with parameters is a unit (DeepSpeed's stage-3 granularity). Not used by
        fsdp_shard, whose wrap policy chooses its units.""")
    leaf_modules: Any = knob(None, """Module classes, class names or FQNs whose whole subtree is one unit, gathered in
        the leaf's own forward (a mixture-of-experts block, a module whose code reads its children's weights). A
        parameter read by a parent's code (``self.out_proj.weight``) is put in the parent's unit automatically, and
        uses the scan misses are found in the first step (engine/zero3/guard.py).""")

    def validate(self, owner: Optional[str] = None) -> "Zero3Config":
        if not isinstance(self.reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward must be True (free parameters after forward) or False (keep "
                             f"them until backward), got {self.reshard_after_forward!r}")
        if not isinstance(self.prefetch_depth, int) or self.prefetch_depth < 0:
            raise ValueError(f"prefetch_depth must be an integer >= 0 (units gathered ahead), got "
                             f"{self.prefetch_depth!r}")
        if self.leaf_modules is not None and not isinstance(self.leaf_modules, (str, type, list, tuple)):
            raise ValueError(f"leaf_modules must be a module class, a class name, a module FQN or a list of them, got "
                             f"{self.leaf_modules!r}")
        if isinstance(self.leaf_modules, (list, tuple)):
            self.leaf_modules = list(self.leaf_modules)
        if isinstance(self.min_unit_mb, bool) or not isinstance(self.min_unit_mb, (int, float)) or \
                self.min_unit_mb < 0:
            raise ValueError(f"min_unit_mb must be a number of MiB >= 0 (0: one unit per module with parameters), "
                             f"got {self.min_unit_mb!r}")
        self.min_unit_mb = float(self.min_unit_mb)
        if self.offload_params not in (True, False):
            raise ValueError(f"offload_params must be True or False, got {self.offload_params!r}")
        validate_secondary_shard(self.secondary_shard, self.shard_size)
        if self.offload_params and self.offload_optimizer is not True:
            raise ValueError("offload_params=True keeps the parameter shards in host memory, where the optimizer "
                             "steps them: set offload_optimizer=True too")
        super().validate(owner)
        return self


def _wrap_classes() -> Any:
    return knob("auto", """Which modules become units: classes or class names (e.g. ``["Block"]``); ``"auto"``: the
        blocks held in ``nn.ModuleList``s (a model with none is one unit, gathered around each step). The plan is logged
        once at setup.""")


def _min_params() -> Any:
    return knob(None, "Or: modules with at least this many parameters become units.")


@dataclass(kw_only=True)
class FSDPConfig(Zero3Config):
    """fsdp_shard: units chosen by a wrap policy."""

    wrap_classes: Any = _wrap_classes()
    min_params: Optional[int] = _min_params()
    prefetch_depth: int = knob(PREFETCH_DEPTH["fsdp"], """Units (blocks) all-gathered ahead of use, in forward and in
        backward (0 disables), as zero3's; each one ahead holds one more block's full parameters.""")

    def validate(self, owner: Optional[str] = None) -> "FSDPConfig":
        if self.wrap_classes is None and self.min_params is None:
            raise ValueError("fsdp_shard needs a wrap policy: wrap_classes='auto' (default: the blocks held in "
                             "nn.ModuleLists), wrap_classes=[YourBlock] (classes or class names) or min_params=N; or "
                             "use strategy zero3 for per-module units")
        if self.min_params is not None and (not isinstance(self.min_params, int) or self.min_params < 1):
            raise ValueError(f"min_params must be a positive integer, got {self.min_params!r}")
        if self.min_unit_mb != MIN_UNIT_MB:
            raise ValueError(f"min_unit_mb={self.min_unit_mb!r} is zero3's: fsdp_shard's units come from its wrap "
                             "policy (wrap_classes, min_params); drop min_unit_mb, or use strategy zero3")
        super().validate(owner)
        return self


@dataclass(kw_only=True)
class AutoConfig(Zero3Config):
    """strategy=auto: the planner picks the stage, policy and layout at setup (any stage; the stage-3 knobs and the
    wrap policy apply if it picks zero3 / fsdp_shard)."""

    STAGES: ClassVar[tuple[int, ...]] = (0, 1, 2, 3)

    topology: Optional[str] = knob("detect", """The machine the planner plans for: preset name (``conf/topology``),
        capture file, or ``"detect"`` (the live machine); also used by the placement check.""")
    wrap_classes: Any = _wrap_classes()
    min_params: Optional[int] = _min_params()
    global_batch_size: Optional[int] = knob(None, """The global batch the planner's compute estimate assumes; ``None``:
        derived from ``accumulate_grad_batches`` and the micro-batch.""")
    micro_batch_size: Optional[int] = knob(None, "The micro-batch the planner assumes; ``None``: 1.")


CONFIGS: tuple[type[ZeroConfig], ...] = (ZeroConfig, Zero3Config, FSDPConfig, AutoConfig)

__all__ = ["AutoConfig", "CONFIGS", "FSDPConfig", "Zero3Config", "ZeroConfig", "knob"]
