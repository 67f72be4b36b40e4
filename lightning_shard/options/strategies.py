"""The options of each strategy: :class:`ZeroOptions` (zero0-2), :class:`Zero3Options`, :class:`FSDPOptions`,
:class:`AutoOptions`; the registered names; :func:`options_for` and :func:`convert`. Plain Python."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Mapping, Optional, Union

from .fields import Fields, check_bool, dtype_name, group, knob, merge
from .groups import MIN_UNIT_MB, Compression, Launch, Safety, Tuning, Zero3Tuning, as_group

# accumulation policies each stage can run (the ``accumulation`` choices less "auto"): zero0/zero1 hold full
# gradients anyway, so only zero2 reduce-scatters per micro-batch; stage 3 calls deferring "keep_unsharded_grads"
POLICIES = {0: ("defer",), 1: ("defer",), 2: ("defer", "per_micro_batch"),
            3: ("per_micro_batch", "keep_unsharded_grads", "keep_params")}



def _validate_activation(spec: Any) -> Any:
    """``activation_checkpointing`` normalised (``None``, ``"auto"`` or a list of classes / class names)."""
    hint = ("activation_checkpointing must be None (off), 'auto' (the blocks held in nn.ModuleLists) or a list of "
            "module classes or class names (e.g. ['GPT2Block'] or [nn.TransformerEncoderLayer])")
    if spec is None or spec == "auto":
        return spec
    if isinstance(spec, bool):
        raise ValueError(f"{hint}, got {spec!r}" + ("; for the transformer blocks use 'auto'" if spec else
                                                    "; use None to turn it off"))
    items = [spec] if isinstance(spec, (str, type)) else spec
    if not isinstance(items, (list, tuple)) or not items:
        raise ValueError(f"{hint}, got {spec!r}")
    # a module class: a type with ``named_modules`` (torch's nn.Module, told apart without importing torch)
    bad = [x for x in items if not (isinstance(x, str) and x and x != "auto") and
           not (isinstance(x, type) and hasattr(x, "named_modules"))]
    if bad:
        raise ValueError(f"{hint}; these entries are neither a module class nor a class name: {bad!r}")
    return list(items)


def _validate_shard_size(shard_size: Any) -> None:
    if shard_size is None or shard_size == "auto":
        return
    if isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size < 1:
        raise ValueError(f"shard_size must be None (shard over all ranks), 'auto' (island size from the topology) or "
                         f"a positive integer, got {shard_size!r}")


@dataclass(kw_only=True)
class ZeroOptions(Fields):
    """zero0 / zero1 / zero2 (``ZeroStrategy`` and its presets)."""

    STAGES: ClassVar[tuple[int, ...]] = (0, 1, 2)
    GRANULARITY: ClassVar[Optional[str]] = None  # how stage-3 units are formed (None below stage 3)

    stage: Optional[int] = knob(None, "ZeRO stage (0, 1 or 2); None = the strategy class's own (0/1/2 for "
                                      "zero0/1/2).", hydra=False)
    accumulation: str = knob("auto", """What non-boundary micro-batches communicate: ``defer`` nothing (full gradients
        held until the boundary); ``per_micro_batch`` (zero2 only) reduce-scatters every micro-batch into an fp32 shard
        accumulator and frees the full gradients; ``auto`` picks one at setup and logs why.""",
                             choices=("auto", "defer", "per_micro_batch"))
    param_dtype: Optional[str] = knob(None, """Mixed-precision policy for fp32 models (as FSDP2's
        ``MixedPrecisionPolicy``): ``"bf16"``/``"fp16"`` keep each rank's owned elements as fp32 masters (the optimizer
        steps them) and hold, gather and compute the parameters in that dtype (half the parameter all-gather bytes
        and half the full-parameter memory); a module's floating inputs are cast to it; gradients reduce in fp32
        unless ``compression.reduce_dtype`` says otherwise; after fit the module holds the fp32 masters again. Needs
        ``Trainer(precision="32-true")`` (or ``"bf16-mixed"``; ``"fp16"`` needs ``"16-mixed"`` for loss scaling).
        zero0-2: every floating parameter must be trained (frozen ones: use zero3/fsdp_shard). ``None``: off.""",
                                      choices=(None, "fp32", "bf16", "fp16"))
    activation_checkpointing: Any = knob(None, """Recompute activations in backward instead of keeping them: ``None``
        (off), ``"auto"`` (the blocks held in ``nn.ModuleList``s, as ``wrap_classes="auto"`` finds them) or module
        classes / class names (``["GPT2Block"]``). Each block's training forward runs under non-reentrant
        ``torch.utils.checkpoint``, replaced on the instance (parameter names and checkpoints unchanged); stage 3
        gathers each unit once in backward, the recomputation included. Logged once at setup.""")
    offload_optimizer: bool = knob(False, """ZeRO-Offload: keep each rank's fp32 master shard, its gradient and the
        optimizer state in host memory (pinned on CUDA) and step the optimizer on the CPU; the averaged gradient shard
        is copied out after its reduction and the updated shard copied back before the parameter all-gather. Saves
        on the accelerator the optimizer state (8 bytes per parameter / N for Adam) and the fp32 masters of bf16
        parameters (4 / N); costs two copies of the shard per step and a CPU optimizer step. (On a CPU-only machine
        host memory is the only memory: the same code runs, with nothing saved.)""")
    state_dict_type: str = knob("sharded", """``"sharded"`` (each rank writes its shards into a checkpoint directory,
        committed atomically), ``"full"`` (rank 0 writes one consolidated file) or ``"dcp"`` (a
        ``torch.distributed.checkpoint`` directory: DCP's tools, FSDP2 and Lightning's ModelParallelStrategy read it).
        All load into any strategy, as do DCP directories written by FSDP2 / Lightning.""",
                                choices=("sharded", "full", "dcp"))
    shard_size: Union[None, int, str] = knob(None, """Hybrid sharding: ``None`` shards over every rank; an integer S
        shards inside groups of S consecutive ranks and replicates across groups (gradients: reduce-scatter inside the
        group, one all-reduce of the shard across groups at the boundary); ``"auto"`` takes S from ``topology``'s
        islands.""")
    topology: Optional[str] = knob(None, """Preset name (``conf/topology``), capture file, or ``"detect"``: used by
        ``shard_size="auto"`` and by the placement check at setup (a warning when traffic crosses slow links
        needlessly); ``None``: no check.""")
    tuning: Tuning = group(Tuning, "Sizes and overlap (:class:`Tuning`).")
    compression: Compression = group(Compression, "What gradients and parameters travel as (:class:`Compression`).")
    safety: Safety = group(Safety, "Checks and limits (:class:`Safety`).")
    launch: Launch = group(Launch, "Processes and rendezvous (:class:`Launch`).")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if "group" in f.metadata:
                setattr(self, f.name, as_group(f.metadata["group"], getattr(self, f.name), f.name))

    @classmethod
    def knobs(cls) -> tuple[dataclasses.Field, ...]:
        return dataclasses.fields(cls)

    @classmethod
    def choices(cls, name: str, stage: Optional[int] = None) -> Optional[tuple]:
        """The values option ``name`` accepts (None: not a choice option); ``stage`` narrows ``accumulation``."""
        valid = cls.__dataclass_fields__[name].metadata.get("choices")
        if name == "accumulation" and valid is not None and stage is not None:
            valid = tuple(v for v in valid if v == "auto" or v in POLICIES[stage])
        return valid

    def validate(self, owner: Optional[str] = None) -> "ZeroOptions":
        """Raise ValueError naming the option and the fix; normalise numbers. ``owner``: the strategy class named in
        messages. ``stage`` must be set (the strategy resolves ``None`` to its own stage first)."""
        owner = owner or type(self).__name__
        stage = self.stage
        if stage not in self.STAGES:
            raise ValueError(f"stage must be one of {self.STAGES} for {owner}, got {stage!r}"
                             + ("; use Zero3Strategy or FSDPShardStrategy for stage 3" if stage == 3 else ""))
        self._check_choice("accumulation")
        if self.accumulation not in self.choices("accumulation", stage):
            raise ValueError(f"accumulation='{self.accumulation}' needs sharded gradients (zero2); zero{stage} holds "
                             "full gradients anyway: use accumulation='defer' or 'auto'.")
        self.param_dtype = dtype_name(self.param_dtype, "param_dtype", "no policy")
        self.activation_checkpointing = _validate_activation(self.activation_checkpointing)
        check_bool(self, "offload_optimizer")
        self._check_choice("state_dict_type")
        _validate_shard_size(self.shard_size)
        if self.shard_size is not None and stage == 0:
            raise ValueError("zero0 replicates everything, so there is nothing to shard inside a group: drop "
                             "shard_size, or use zero2/zero3 with shard_size for hybrid sharding")
        for name in ("tuning", "compression", "safety", "launch"):
            getattr(self, name).validate(stage)
        return self

    @property
    def granularity(self) -> Optional[str]:
        return self.GRANULARITY


def _param_init_fn() -> Any:
    return knob(None, """Deferred init (``configure_model``): called as ``fn(module)`` to initialise a module's own
        parameters; ``None``: the module's ``reset_parameters()``.""")


@dataclass(kw_only=True)
class Zero3Options(ZeroOptions):
    """zero3: parameters sharded too; every module with direct parameters is a unit."""

    STAGES: ClassVar[tuple[int, ...]] = (3,)
    GRANULARITY: ClassVar[Optional[str]] = "zero3"

    accumulation: str = knob("auto", """``"per_micro_batch"`` (reduce-scatter every micro-batch into an fp32 shard
        accumulator), ``"keep_unsharded_grads"`` (hold full gradients over the window, one reduce-scatter per step),
        ``"keep_params"`` (parameters stay gathered over the window: one all-gather and one reduce-scatter per step),
        or ``"auto"`` (picks one at setup and logs why).""",
                             choices=("auto", "per_micro_batch", "keep_unsharded_grads", "keep_params"))
    offload_params: bool = knob(False, """ZeRO-Offload of the parameters too (with ``offload_optimizer=True``): each
        unit's persistent shard lives in host memory (pinned on CUDA) and is copied to the device just before its
        all-gather, so the accelerator holds only the gathered units (and gradients in flight).""")
    secondary_shard: Union[None, int, str] = knob(None, """hpZ (ZeRO++): after a unit's first all-gather of an
        optimizer step (over every rank), each rank keeps its 1/I of the gathered unit, I the ranks of its island, so
        that the unit's other gathers until the optimizer step (backward, later micro-batches) run inside the island
        only: ``"island"`` takes I from ``topology``'s islands, an integer I groups consecutive ranks. Costs 1/I of
        every unit's full bytes per rank, held from its first gather to the optimizer step. ``None``: off. Not with
        ``shard_size`` (hybrid sharding keeps every gather inside the shard group already).""")
    leaf_modules: Any = knob(None, """Module classes, class names or FQNs whose whole subtree is one unit, gathered in
        the leaf's own forward (a mixture-of-experts block, a module whose code reads its children's weights). A
        parameter read by a parent's code (``self.out_proj.weight``) is put in the parent's unit automatically, and
        uses the scan misses are found in the first step (engine/zero3/guard.py).""")
    param_init_fn: Optional[Callable] = _param_init_fn()
    tuning: Zero3Tuning = group(Zero3Tuning, "Sizes, overlap and the stage-3 schedule (:class:`Zero3Tuning`).")

    def validate(self, owner: Optional[str] = None) -> "Zero3Options":
        if self.leaf_modules is not None and not isinstance(self.leaf_modules, (str, type, list, tuple)):
            raise ValueError(f"leaf_modules must be a module class, a class name, a module FQN or a list of them, got "
                             f"{self.leaf_modules!r}")
        if isinstance(self.leaf_modules, (list, tuple)):
            self.leaf_modules = list(self.leaf_modules)
        check_bool(self, "offload_params")
        secondary = self.secondary_shard
        if secondary is not None:
            if secondary != "island" and (isinstance(secondary, bool) or not isinstance(secondary, int) or
                                          secondary < 2):
                raise ValueError(f"secondary_shard must be None (off), 'island' (the topology's island size) or an "
                                 f"integer >= 2 (ranks per island), got {secondary!r}")
            if self.shard_size is not None:
                raise ValueError(f"secondary_shard={secondary!r} with shard_size={self.shard_size!r}: hybrid sharding "
                                 "already keeps every parameter gather inside its shard group; use one of them")
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
class FSDPOptions(Zero3Options):
    """fsdp_shard: units chosen by a wrap policy."""

    GRANULARITY: ClassVar[Optional[str]] = "fsdp"

    wrap_classes: Any = _wrap_classes()
    min_params: Optional[int] = _min_params()

    def validate(self, owner: Optional[str] = None) -> "FSDPOptions":
        if self.wrap_classes is None and self.min_params is None:
            raise ValueError("fsdp_shard needs a wrap policy: wrap_classes='auto' (default: the blocks held in "
                             "nn.ModuleLists), wrap_classes=[YourBlock] (classes or class names) or min_params=N; or "
                             "use strategy zero3 for per-module units")
        if isinstance(self.wrap_classes, tuple):
            self.wrap_classes = list(self.wrap_classes)
        if self.min_params is not None and (not isinstance(self.min_params, int) or self.min_params < 1):
            raise ValueError(f"min_params must be a positive integer, got {self.min_params!r}")
        if self.tuning.min_unit_mb != MIN_UNIT_MB:
            raise ValueError(f"tuning.min_unit_mb={self.tuning.min_unit_mb!r} is zero3's: fsdp_shard's units come from "
                             "its wrap policy (wrap_classes, min_params); drop min_unit_mb, or use strategy zero3")
        super().validate(owner)
        return self


@dataclass(kw_only=True)
class AutoOptions(FSDPOptions):
    """strategy=auto: the planner picks the stage, policy and layout at setup (any stage; the stage-3 options and the
    wrap policy apply if it picks zero3 / fsdp_shard)."""

    STAGES: ClassVar[tuple[int, ...]] = (0, 1, 2, 3)

    topology: Optional[str] = knob("detect", """The machine the planner plans for: preset name (``conf/topology``),
        capture file, or ``"detect"`` (the live machine); also used by the placement check.""")
    global_batch_size: Optional[int] = knob(None, """The global batch the planner's compute estimate assumes; ``None``:
        derived from ``accumulate_grad_batches`` and the micro-batch.""")
    micro_batch_size: Optional[int] = knob(None, "The micro-batch the planner assumes; ``None``: 1.")
    calibrate: bool = knob(False, """Measure this machine at setup (every rank, on the job's own process groups:
        FLOP/s of the model's blocks, the optimizer step, each collective by size) and pick by the calibrated time
        model; the measurements are kept as a machine profile and reused (``profile``). ``False``: the nominal model
        (datasheet figures).""")
    profile: Optional[str] = knob(None, """Machine profile JSON (with ``calibrate``): read if it describes this
        machine and library versions, written after measuring; ``None``: the cache
        (``~/.cache/lightning_shard/profiles``, or ``$LIGHTNING_SHARD_CACHE``).""")
    check_after_steps: int = knob(10, """After this many optimizer steps, log the predicted step time beside the
        measured one (the median interval between optimizer steps, the first excluded); 0: never.""")

    def validate(self, owner: Optional[str] = None) -> "AutoOptions":
        check_bool(self, "calibrate")
        if isinstance(self.check_after_steps, bool) or not isinstance(self.check_after_steps, int) or \
                self.check_after_steps < 0:
            raise ValueError(f"check_after_steps must be an integer >= 0 (0: never), got {self.check_after_steps!r}")
        if self.profile is not None and not isinstance(self.profile, str):
            raise ValueError(f"profile must be a path (a string) or None (the cache), got {self.profile!r}")
        return super().validate(owner)


OPTIONS: tuple[type[ZeroOptions], ...] = (ZeroOptions, Zero3Options, FSDPOptions, AutoOptions)

# the registered names (``Trainer(strategy=...)``, ``strategy=`` in Hydra): their options class and stage
REGISTERED = {"zero0": (ZeroOptions, 0), "zero1": (ZeroOptions, 1), "zero2": (ZeroOptions, 2),
              "zero3": (Zero3Options, 3), "fsdp_shard": (FSDPOptions, 3)}


def convert(options: ZeroOptions, cls: type[ZeroOptions], stage: int, changes: Mapping[str, Any]) -> ZeroOptions:
    """``options`` as the options of ``cls`` at ``stage``: the fields both classes have (inside groups too) carried
    over, then ``changes`` (a group's as a mapping of its fields) applied; validated. What strategy=auto becomes."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if not hasattr(options, f.name) or f.name == "stage":
            continue
        value = getattr(options, f.name)
        if "group" in f.metadata:
            names = f.metadata["group"].names()
            value = {k: v for k, v in dataclasses.asdict(value).items() if k in names}
        values[f.name] = value
    return cls(stage=stage, **merge(values, changes)).validate(cls.__name__)


def options_for(name: str, **values: Any) -> ZeroOptions:
    """The validated options of registered strategy ``name`` (``"zero2"``, ``"fsdp_shard"`` ...) with ``values``."""
    cls, stage = REGISTERED[name]
    return cls(stage=stage, **values).validate(name)



__all__ = ["OPTIONS", "POLICIES", "REGISTERED", "AutoOptions", "FSDPOptions", "Zero3Options", "ZeroOptions", "convert",
           "options_for"]
