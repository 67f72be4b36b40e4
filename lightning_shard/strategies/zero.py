"""Lightning strategies ``zero0``, ``zero1`` and ``zero2``: thin adapters over :class:`ShardEngine`.

``Trainer(strategy="zero2")`` (names registered when ``lightning_shard`` is imported) or
``Trainer(strategy=Zero2Strategy(accumulation="per_micro_batch", tuning=Tuning(bucket_mb=50)))``.

Options: :class:`~lightning_shard.options.ZeroOptions` (each documented there and in ``help(Zero2Strategy)``).
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Any, Generator, Optional, Union

import torch
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn

from ..checkpoint.io import CheckpointMixin
from ..engine import activation
from ..engine.comm import collectives as C
from ..engine.engine import sync_module_states
from ..options import ZeroOptions
from . import summary
from .adapter import EngineAdapter
from .precision import ShardedPrecision
from .signature import LIGHTNING_ARGS, describe, takes_options_of

log = logging.getLogger(__name__)


class ZeroStrategy(CheckpointMixin, EngineAdapter, ParallelStrategy):
    """ZeRO stage 0 (data parallel), 1 (sharded optimizer state) or 2 (+ sharded gradients)."""

    strategy_name = "zero"
    OPTIONS: type[ZeroOptions] = ZeroOptions  # the options (lightning_shard/options)
    LIGHTNING_ARGS = LIGHTNING_ARGS  # Lightning's own Strategy arguments, passed on
    DEFAULT_STAGE = 2  # ``stage=None``: the class's own (0/1/2 for zero0/1/2)

    @takes_options_of(ZeroOptions)
    def __init__(self, **options: Any) -> None:
        super().__init__(**self._take_options(options))
        self._reader: Any = None
        self._num_nodes = 1
        self._masters_from_checkpoint: dict[str, torch.Tensor] = {}
        self._checkpointing: Optional[activation.ActivationCheckpointing] = None
        self._accumulate = 1  # the accumulate_grad_batches the accumulation policy was resolved for

    # ------------------------------------------------------------------ Lightning surface
    @property
    def is_distributed(self) -> bool:
        return True  # Lightning injects a DistributedSampler and reduces sync_dist logs only when this is True

    @property
    def precision_plugin(self) -> ShardedPrecision:
        if self._precision_plugin is None:
            self._precision_plugin = ShardedPrecision()
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        self._precision_plugin = None if plugin is None else ShardedPrecision(plugin)

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self.options.launch.start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = _MultiProcessingLauncher(self, start_method=self.options.launch.start_method)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank

    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        self._connect()

    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if self.engine is not None:  # a previous fit's engine: its hooks go, the module is whole again
            self.engine.remove_hooks()
            self.engine = None
            self.precision_plugin.attach(None)
        if fitting and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.model = self.precision_plugin.convert_module(self.model)
        self._place_model(fitting)
        if fitting:
            self.setup_optimizers(trainer)
            self._checkpoint_activations()
            self._policy_inputs = None  # measured again for this fit's model and device
            self._accumulate = int(getattr(trainer, "accumulate_grad_batches", 1) or 1)
            policy, reason = self._resolve_accumulation(trainer)
            self.accumulation_policy, self.accumulation_reason = policy, reason
            rank_zero_info(f"lightning_shard {type(self).strategy_name}: accumulation={policy} ({reason})")
            self.engine = self._new_engine(self.model, self.optimizers, policy, self._deferred_init(),
                                           self._param_dtype(self.precision_plugin.precision, "Trainer"))
            if self.engine.plan_summary:
                rank_zero_info(f"lightning_shard {type(self).strategy_name}: {self.engine.plan_summary}")
            if self.options.stage == 3:  # parameters are empty between steps: count them from the engine's layout
                summary.install(trainer, self.engine)
            self.precision_plugin.attach(self.engine)
            if self._masters_from_checkpoint:  # weights were restored before setup: keep their fp32 precision
                self.engine.load_full(self._masters_from_checkpoint, masters_only=True)
                self._masters_from_checkpoint = {}
        else:
            sync_module_states(self.model, None)
        self.setup_precision_plugin()
        if fitting:  # offload_optimizer: the optimizer state belongs in host memory, beside the master shards
            host = self.options.offload_optimizer
            _optimizers_to_device(self.optimizers, torch.device("cpu") if host else self.root_device)

    def _checkpoint_activations(self) -> None:
        """``activation_checkpointing``: the chosen blocks' forwards recompute in backward (before the engine hooks
        the modules; engine/activation.py). Undone in teardown."""
        if self._checkpointing is not None:
            self._checkpointing.remove()
            self._checkpointing = None
        if self.options.activation_checkpointing is None:
            return
        self._checkpointing = activation.apply(self.model, self.options.activation_checkpointing)
        (rank_zero_info if self._checkpointing.modules else rank_zero_warn)(
            f"lightning_shard {type(self).strategy_name}: {self._checkpointing.describe()}")

    def _place_model(self, fitting: bool) -> None:
        self.model_to_device()

    def _deferred_init(self) -> Any:
        return None  # stage 3 strategies return a DeferredInit for models built on the meta device

    def _resolve_accumulation(self, trainer: Any) -> tuple[str, str]:
        """``accumulation="auto"``: the planner's rule for the Trainer's ``accumulate_grad_batches``."""
        return self._accumulation(self.model, int(getattr(trainer, "accumulate_grad_batches", 1) or 1))

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.engine is None:
            return super().training_step(*args, **kwargs)
        with self.engine.watch_step():  # zero1/2: reads of parameters whose post-step gather is in flight
            return super().training_step(*args, **kwargs)

    # ------------------------------------------------------------------ gradient sync
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self._follow_accumulation()

    def _follow_accumulation(self) -> None:
        """``accumulate_grad_batches`` changed (``GradientAccumulationScheduler`` sets it at an epoch's start, where
        windows start afresh): the policy becomes the one a run started with the new value would have, logged."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        accumulate = int(getattr(trainer, "accumulate_grad_batches", 1) or 1)
        if self.engine is None or trainer is None or accumulate == self._accumulate:
            return
        previous, self._accumulate = self._accumulate, accumulate
        policy, reason = self._resolve_accumulation(trainer)
        if policy != self.accumulation_policy:
            self.engine.set_policy(policy)
            self.accumulation_policy, self.accumulation_reason = policy, reason
            rank_zero_info(f"lightning_shard {type(self).strategy_name}: accumulate_grad_batches {previous} -> "
                           f"{accumulate} at epoch {trainer.current_epoch}: accumulation={policy} ({reason})")

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning's switch for the micro-batches inside an accumulation window: the engine communicates
        what the accumulation policy says (nothing under ``defer``) instead of reducing at once."""
        if self.engine is None:
            yield None
            return
        with self.engine.no_sync():
            yield None

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Precision backward, then the engine's reductions, then ``post_backward`` hooks (as DDP orders them)."""
        module = self.lightning_module
        if self.engine is not None:
            self.engine.pre_backward()
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        with self.explained_backward():
            self.precision_plugin.backward(closure_loss, module, optimizer, *args, **kwargs)
        if self.engine is not None:
            self.engine.post_backward()
        return self.precision_plugin.post_backward(closure_loss, module)

    # ------------------------------------------------------------------ collectives for Lightning
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Optional[Union[str, Any]] = "mean") -> Any:
        if not isinstance(tensor, torch.Tensor) or not C.is_initialized():
            return tensor
        name = str(getattr(reduce_op, "name", reduce_op) or "mean").lower().replace("reduceop.", "")
        if name not in ("mean", "avg", "sum", "max", "min"):
            raise ValueError(f"reduce_op must be mean/sum/max/min, got {reduce_op!r}")
        out = tensor.detach().clone() if name not in ("mean", "avg") else tensor.detach().float().clone()
        C.all_reduce(out, op="sum" if name in ("mean", "avg") else name, group=group, tag="metric")
        if name in ("mean", "avg"):
            out = out / C.get_world_size(group)
        return out

    def barrier(self, name: Optional[str] = None) -> None:
        C.barrier(tag=name or "strategy")

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return C.broadcast_object(obj, src, tag="strategy")

    def all_gather(self, tensor: torch.Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> torch.Tensor:
        """Every rank's ``tensor`` stacked on a new first dimension (``LightningModule.all_gather``), through the
        ledger. ``sync_grads`` is not supported (no autograd through the gather)."""
        if not C.is_initialized():
            return tensor.unsqueeze(0)
        if sync_grads:
            raise NotImplementedError("lightning_shard strategies do not differentiate through all_gather "
                                      "(sync_grads=True); gather detached tensors")
        return torch.stack(C.all_gather_list(tensor.detach().contiguous(), group=group, tag="strategy"))

    def teardown(self) -> None:
        if self._checkpointing is not None:  # the module's own forwards again
            self._checkpointing.remove()
            self._checkpointing = None
        if self.engine is not None:
            trainer = getattr(self.lightning_module, "_trainer", None) if self.lightning_module is not None else None
            if not (trainer is not None and trainer.interrupted):  # collective: not after a failure
                self.engine.restore_source_dtype()  # param_dtype: the module holds the fp32 masters again
            self.engine.remove_hooks()
        super().teardown()


class Zero0Strategy(ZeroStrategy):
    """Plain data parallel on the same engine (all-reduce, replicated optimizer): the honest baseline."""

    strategy_name = "zero0"
    DEFAULT_STAGE = 0


class Zero1Strategy(ZeroStrategy):
    """ZeRO-1: optimizer state sharded; reduce-scatter gradients, all-gather parameters."""

    strategy_name = "zero1"
    DEFAULT_STAGE = 1


class Zero2Strategy(ZeroStrategy):
    """ZeRO-2: optimizer state and gradients sharded."""

    strategy_name = "zero2"
    DEFAULT_STAGE = 2


for _cls in (ZeroStrategy, Zero0Strategy, Zero1Strategy, Zero2Strategy):
    describe(_cls)
