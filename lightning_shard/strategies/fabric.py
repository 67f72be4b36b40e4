"""Lightning Fabric strategies on the same engine as the Trainer's: ``Fabric(strategy="zero2", devices=N)``.

Registered in Fabric's registry when ``lightning_shard`` is imported (the same names as the Trainer's: ``zero0``,
``zero1``, ``zero2``, ``zero3``, ``fsdp_shard`` and the hybrids), or pass an instance:
``Fabric(strategy=Zero3FabricStrategy(prefetch_depth=2))``. The knobs are the Trainer strategies'
(:mod:`lightning_shard.options`, documented there and in ``help(Zero2FabricStrategy)``).

A Fabric loop::

    fabric = Fabric(strategy="zero2", devices=2, accelerator="cpu")
    fabric.launch()
    model, optimizer = fabric.setup(model, optimizer)      # the engine shards here
    for i, batch in enumerate(loader):
        boundary = (i + 1) % accumulate == 0
        with fabric.no_backward_sync(model, enabled=not boundary):   # accumulation-aware sync
            fabric.backward(model(batch).loss / accumulate)
        if boundary:
            fabric.clip_gradients(model, optimizer, max_norm=1.0)    # the true global norm
            optimizer.step()
            optimizer.zero_grad()
    fabric.save("ckpt", {"model": model, "optimizer": optimizer, "step": i})   # sharded: a directory

What differs from the Trainer: the accumulation policy ``"auto"`` cannot see an ``accumulate_grad_batches``, so it
is the planner's choice for a loop that accumulates (any micro-batch inside ``no_backward_sync`` is a
non-boundary one); with stage 3 each call of the set-up module's forward is one pass of the unit schedule (as one
``training_step`` is under the Trainer). Checkpoints are the Trainer's format and interchangeable with it: a
directory written by ``fabric.save`` resumes under ``Trainer(ckpt_path=...)`` and the other way round, at any world
size (the module's parameter names must match, e.g. the same ``LightningModule`` in both).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from typing import Any, Generator, Optional, Union

import torch
from lightning.fabric.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from lightning.fabric.strategies import ParallelStrategy
from lightning.fabric.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.fabric.strategies.strategy import _BackwardSyncControl, _Sharded
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_only
from lightning.fabric.utilities.seed import reset_seed
from torch import nn

from ..engine import activation
from ..engine.comm import collectives as C
from ..engine.engine import sync_module_states
from ..engine.scaler import LossScaler
from ..engine.zero3.deferred import DeferredInit, has_meta_tensors
from ..options import FSDPOptions, Zero3Options, ZeroOptions
from .adapter import EngineAdapter
from .fabric_checkpoint import FabricCheckpoints, ShardedModule
from .precision import check_grads, sharded_step
from .signature import describe, takes_options_of

FABRIC_ARGS = ("accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision")
SUPPORTED_PRECISION = ("32-true", "64-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")


class _EngineSync(_BackwardSyncControl):
    """``fabric.no_backward_sync(model, enabled=...)``: the micro-batch is not an accumulation boundary."""

    def __init__(self, strategy: "ZeroFabricStrategy") -> None:
        self.strategy = strategy

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        engine = self.strategy.engine
        if not enabled or engine is None:
            return nullcontext()
        return engine.no_sync()


class ZeroFabricStrategy(FabricCheckpoints, EngineAdapter, ParallelStrategy, _Sharded):
    """Fabric adapter: ZeRO stage 0 (data parallel), 1 (sharded optimizer state) or 2 (+ sharded gradients)."""

    strategy_name = "zero"
    OPTIONS: type[ZeroOptions] = ZeroOptions
    DEFAULT_STAGE = 2
    LIGHTNING_ARGS = FABRIC_ARGS

    @takes_options_of(ZeroOptions)
    def __init__(self, **options: Any) -> None:
        super().__init__(**self._take_options(options))
        self._num_nodes = 1
        self._backward_sync_control = _EngineSync(self)
        self._module: Optional[nn.Module] = None  # set up, waiting for its optimizers (setup_module first)
        self._loss_scaler: Optional[LossScaler] = None
        self._init_rng: Optional[torch.Tensor] = None  # init_module(empty_init=True) at stage 3
        self._root_hooks: list[Any] = []
        self._checkpointing: Optional[activation.ActivationCheckpointing] = None
        self._raw_state = False  # state_dict() without the full-weights hook (shapes, buffers)
        self._checked: dict[int, str] = {}  # id(optimizer) -> check_grads' answer, between clipping and the step

    # ------------------------------------------------------------------ Fabric surface
    @property
    def precision(self) -> Precision:
        return self._precision if self._precision is not None else Precision()

    @precision.setter
    def precision(self, precision: Optional[Precision]) -> None:
        if precision is not None and type(precision) not in (Precision, MixedPrecision, HalfPrecision,
                                                              DoublePrecision):
            raise ValueError(f"precision plugin {type(precision).__name__} is not supported by the lightning_shard "
                             f"strategies; use Fabric(precision=...) with one of {', '.join(SUPPORTED_PRECISION)}.")
        if isinstance(precision, MixedPrecision) and precision.scaler is not None:
            precision.scaler = None  # fp16: our loss scaler, whose skip decision every rank agrees on
        self._precision = precision
        self._loss_scaler = LossScaler() if precision is not None and precision.precision in ("16-mixed", "16-true") \
            else None

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self.options.launch.start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = _MultiProcessingLauncher(self, start_method=self.options.launch.start_method)

    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank
        self._connect()
        if self.placement_warning:
            rank_zero_info(f"lightning_shard {type(self).strategy_name}: {self.placement_warning}")

    # ------------------------------------------------------------------ set-up: the engine
    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list[torch.optim.Optimizer],
                                    scheduler: Any = None) -> tuple[nn.Module, list[torch.optim.Optimizer], Any]:
        module = self.setup_module(module)
        self._build(list(optimizers))
        return module, list(optimizers), scheduler

    def setup_module(self, module: nn.Module) -> nn.Module:
        """Place the module (replicated, identical on every rank); it is sharded when its optimizers are set up
        (``fabric.setup(model, optimizer)`` does both at once). With no optimizer it stays replicated."""
        if self.engine is not None:
            raise RuntimeError(f"{type(self).__name__} already set up a module; one model per strategy")
        if not has_meta_tensors(module):
            module.to(self.root_device)
            sync_module_states(module, None)  # rank 0's initial weights everywhere
        self._module = module
        return ShardedModule(module)

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """``fabric.setup_optimizers(...)`` after ``setup_module``: builds the engine for the module and this
        optimizer. Pass every optimizer in one call of ``fabric.setup(model, opt1, opt2)`` when there are several."""
        self._build([optimizer])
        return optimizer

    def _build(self, optimizers: list[torch.optim.Optimizer]) -> None:
        if self._module is None:
            raise RuntimeError("set up the module first: fabric.setup(model, optimizer) or fabric.setup_module(model) "
                               "then fabric.setup_optimizers(optimizer)")
        if self.engine is not None:
            raise RuntimeError(f"{type(self).__name__} already built its engine for the optimizers set up before; "
                               "set up all optimizers together: fabric.setup(model, opt1, opt2)")
        module = self._module
        deferred = self._deferred(module)
        if deferred is not None:
            deferred.remap(optimizers)
        if self.options.activation_checkpointing is not None:  # before the engine hooks the modules (as the Trainer)
            self._checkpointing = activation.apply(module, self.options.activation_checkpointing)
            rank_zero_info(f"lightning_shard {type(self).strategy_name}: {self._checkpointing.describe()}")
        policy, reason = self._accumulation(module, 2)  # a Fabric loop may accumulate: plan as if it does
        self.accumulation_policy, self.accumulation_reason = policy, reason
        rank_zero_info(f"lightning_shard {type(self).strategy_name}: accumulation={policy} ({reason})")
        self.engine = self._new_engine(module, optimizers, policy, deferred,
                                       self._param_dtype(self.precision.precision, "Fabric"))
        if self.engine.plan_summary:
            rank_zero_info(f"lightning_shard {type(self).strategy_name}: {self.engine.plan_summary}")
        if self.engine.controller is not None:  # stage 3: each forward of the module is one pass of the schedule
            controller = self.engine.controller
            self._root_hooks = [module.register_forward_pre_hook(lambda m, a: controller.step_pre_forward()),
                                module.register_forward_hook(lambda m, a, out: controller.step_post_forward(out))]
        # model.state_dict() shows full weights (stage-3 parameters, fp32 masters of half-precision ones), as a
        # user saves them: collective while the engine holds shards (every rank calls it, as with FSDP)
        def full_state(m: nn.Module, state: dict[str, Any], prefix: str, local_metadata: Any) -> None:
            self._full_state_hook(m, state, prefix, local_metadata)

        self._root_hooks.append(module.register_state_dict_post_hook(full_state))
        _optimizers_to_device(optimizers, torch.device("cpu") if self.options.offload_optimizer else self.root_device)

    def _deferred(self, module: nn.Module) -> Optional[DeferredInit]:
        if not has_meta_tensors(module):
            return None
        if self.options.stage != 3 or self._init_rng is None:
            raise ValueError("the model has parameters on the meta device; create it inside "
                             "fabric.init_module(empty_init=True) with a stage-3 strategy (zero3, fsdp_shard), which "
                             "materializes it shard by shard, or create it on a real device.")
        deferred = DeferredInit(module, getattr(self.options, "param_init_fn", None), self.root_device)
        torch.random.set_rng_state(self._init_rng)
        return deferred

    def module_to_device(self, module: nn.Module) -> None:
        if not has_meta_tensors(module):  # a meta-device model (init_module(empty_init=True)) is placed at set-up
            module.to(self.root_device)

    def module_init_context(self, empty_init: Optional[bool] = None) -> AbstractContextManager:
        """``fabric.init_module(empty_init=True)`` at stage 3: the model is created on the meta device (no memory)
        and materialized shard by shard at set-up, drawing the values a full init would (the RNG state is kept)."""
        if self.options.stage == 3 and empty_init:
            return self._meta_init()
        return super().module_init_context(empty_init)

    @contextmanager
    def _meta_init(self) -> Generator[None, None, None]:
        self._init_rng = torch.random.get_rng_state()
        with ExitStack() as stack:
            stack.enter_context(torch.device("meta"))
            stack.enter_context(self.precision.module_init_context())
            yield

    def module_sharded_context(self) -> AbstractContextManager:
        return self._meta_init() if self.options.stage == 3 else nullcontext()

    # ------------------------------------------------------------------ backward and step
    def backward(self, tensor: torch.Tensor, module: Optional[nn.Module], *args: Any, **kwargs: Any) -> None:
        engine = self.engine
        if engine is None:
            raise RuntimeError("fabric.backward before the optimizer was set up: call fabric.setup(model, optimizer)")
        engine.pre_backward()
        if self._loss_scaler is not None:
            tensor = tensor * self._loss_scaler.scale
        self.precision.pre_backward(tensor, module)
        with self.explained_backward():
            self.precision.backward(tensor, module, *args, **kwargs)
        engine.post_backward()
        self.precision.post_backward(tensor, module)

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        engine = self._engine_for(optimizer)
        out: list[Any] = [None]

        def step() -> None:
            out[0] = optimizer.step(**kwargs)

        checked = self._checked.pop(id(optimizer), None)  # clip_gradients already made the gradients final
        sharded_step(engine, optimizer, self._loss_scaler, lambda: None, step, checked)
        return out[0]

    def _engine_for(self, optimizer: Any) -> Any:
        if self.engine is None:
            raise RuntimeError(f"{type(self).__name__}: optimizer.step() before fabric.setup(model, optimizer)")
        return self.engine

    def _check(self, optimizer: Any) -> str:
        """Final (and, with fp16, unscaled) shard gradients for this window, once: clipping before the step."""
        if id(optimizer) not in self._checked:
            self._checked[id(optimizer)] = check_grads(self._engine_for(optimizer), optimizer, self._loss_scaler)
        return self._checked[id(optimizer)]

    def clip_gradients_norm(self, module: nn.Module, optimizer: Any, max_norm: Union[float, int],
                            norm_type: Union[float, int] = 2.0, error_if_nonfinite: bool = True) -> torch.Tensor:
        """The global norm over every rank's shard (one all-reduce), then the shards scaled; call it after the
        boundary backward, before ``optimizer.step()`` (with fp16 the gradients are unscaled first, once)."""
        engine = self._engine_for(optimizer)
        self._check(optimizer)
        total = engine.grad_norm(optimizer, float(norm_type))
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(f"the total norm of order {norm_type} of the gradients is non-finite, so they cannot "
                               "be clipped; set error_if_nonfinite=False to clip anyway")
        engine.clip_grad_norm_(optimizer, float(max_norm), float(norm_type), total=total)
        return total

    def clip_gradients_value(self, module: nn.Module, optimizer: Any, clip_val: Union[float, int]) -> None:
        engine = self._engine_for(optimizer)
        self._check(optimizer)
        engine.clip_grad_value_(optimizer, float(clip_val))

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, tensor: Any, group: Optional[Any] = None,
                   reduce_op: Optional[Union[str, Any]] = "mean") -> Any:
        if not isinstance(tensor, torch.Tensor) or not C.is_initialized():
            return tensor
        name = str(getattr(reduce_op, "name", reduce_op) or "mean").lower().replace("reduceop.", "")
        if name not in ("mean", "avg", "sum", "max", "min"):
            raise ValueError(f"reduce_op must be mean/sum/max/min, got {reduce_op!r}")
        out = tensor.detach().clone() if name not in ("mean", "avg") else tensor.detach().float().clone()
        C.all_reduce(out, op="sum" if name in ("mean", "avg") else name, group=group, tag="metric")
        return out / C.get_world_size(group) if name in ("mean", "avg") else out

    def all_gather(self, tensor: torch.Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> torch.Tensor:
        if not C.is_initialized():
            return tensor.unsqueeze(0)
        if sync_grads:
            raise NotImplementedError("lightning_shard strategies do not differentiate through all_gather")
        return torch.stack(C.all_gather_list(tensor.detach().contiguous(), group=group, tag="strategy"))

    def barrier(self, name: Optional[str] = None) -> None:
        if C.is_initialized():
            C.barrier(tag=name or "strategy")

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return C.broadcast_object(obj, src, tag="strategy") if C.is_initialized() else obj

    # ------------------------------------------------------------------ teardown
    def teardown(self) -> None:
        for h in self._root_hooks:
            h.remove()
        self._root_hooks = []
        if self._checkpointing is not None:  # the module's own forwards again
            self._checkpointing.remove()
            self._checkpointing = None
        if self.engine is not None:
            if self.engine.controller is not None:
                self.engine.controller.release_to_module()  # the plain module works afterwards (collective)
            self.engine.restore_source_dtype()
            self.engine.remove_hooks()
            self.engine = None
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        pass  # registered by lightning_shard.strategies (REGISTERED), one table for Trainer and Fabric


class Zero0FabricStrategy(ZeroFabricStrategy):
    """Plain data parallel on the engine (all-reduce, replicated optimizer)."""

    strategy_name = "zero0"
    DEFAULT_STAGE = 0


class Zero1FabricStrategy(ZeroFabricStrategy):
    """ZeRO-1: optimizer state sharded."""

    strategy_name = "zero1"
    DEFAULT_STAGE = 1


class Zero2FabricStrategy(ZeroFabricStrategy):
    """ZeRO-2: optimizer state and gradients sharded."""

    strategy_name = "zero2"
    DEFAULT_STAGE = 2


class Zero3FabricStrategy(ZeroFabricStrategy):
    """ZeRO-3: parameters sharded too; every module with parameters is a unit."""

    strategy_name = "zero3"
    OPTIONS = Zero3Options
    DEFAULT_STAGE = 3

    @takes_options_of(Zero3Options)
    def __init__(self, **options: Any) -> None:
        super().__init__(**options)


class FSDPShardFabricStrategy(Zero3FabricStrategy):
    """FSDP-style units chosen by a wrap policy."""

    strategy_name = "fsdp_shard"
    OPTIONS = FSDPOptions

    @takes_options_of(FSDPOptions)
    def __init__(self, **options: Any) -> None:
        super().__init__(**options)


FABRIC_CLASSES = {"zero0": Zero0FabricStrategy, "zero1": Zero1FabricStrategy, "zero2": Zero2FabricStrategy,
                  "zero3": Zero3FabricStrategy, "fsdp_shard": FSDPShardFabricStrategy}
for _cls in (ZeroFabricStrategy, *FABRIC_CLASSES.values()):
    describe(_cls)

__all__ = ["FABRIC_CLASSES", "FSDPShardFabricStrategy", "Zero0FabricStrategy", "Zero1FabricStrategy",
           "Zero2FabricStrategy", "Zero3FabricStrategy", "ZeroFabricStrategy"]
