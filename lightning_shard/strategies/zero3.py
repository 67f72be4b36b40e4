"""Lightning strategies ``zero3`` and ``fsdp_shard``: parameters sharded too (stage 3 of the same engine).

``zero3``: every module with direct parameters is a unit (DeepSpeed stage-3 granularity), small modules merged into
the unit of a module enclosing them (the size is a knob of strategies/config.py).
``fsdp_shard``: units chosen by a wrap policy, e.g. ``FSDPShardStrategy(wrap_classes=["Block"])``.

Knobs: :class:`~lightning_shard.strategies.config.Zero3Config` and ``FSDPConfig`` (ZeroConfig's plus parameter
sharding; documented there and in ``help(Zero3Strategy)``).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Generator, Optional

import torch
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher

from ..engine.zero3.deferred import DeferredInit, has_meta_tensors
from .config import FSDPConfig, Zero3Config
from .knobs import describe, takes_knobs_of
from .zero import ZeroStrategy


class _GatheringLauncher(_MultiProcessingLauncher):
    """fork/spawn launcher whose hand-back to the parent carries full (gathered) weights, not empty shards."""

    def _collect_rank_zero_results(self, trainer: Any, results: Any) -> Any:
        module = trainer.lightning_module
        full = trainer.strategy.full_state_dict()  # collective: every rank takes part
        module.state_dict = lambda *args, **kwargs: full
        try:
            return super()._collect_rank_zero_results(trainer, results)
        finally:
            del module.state_dict


class Zero3Strategy(ZeroStrategy):
    """ZeRO-3: optimizer state, gradients and parameters sharded; every module with parameters is a unit."""

    strategy_name = "zero3"
    CONFIG = Zero3Config
    DEFAULT_STAGE = 3
    GRANULARITY = "zero3"  # how units are formed: "zero3" (every module with parameters) or "fsdp" (wrap policy)
    DEFERRED_INIT = True  # configure_model() runs on the meta device (strategy=auto decides too late for that)

    @takes_knobs_of(Zero3Config)
    def __init__(self, **knobs: Any) -> None:
        self._deferred: Optional[DeferredInit] = None
        self._init_rng: Optional[torch.Tensor] = None
        super().__init__(**knobs)
        self.granularity = self.GRANULARITY

    # ------------------------------------------------------------------ deferred (meta-device) init
    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """``configure_model()`` runs here: modules are created on the meta device (no memory), and the RNG
        state is remembered so that shard-by-shard materialization draws the same values a full init would."""
        if not self.DEFERRED_INIT:
            with super().model_sharded_context():
                yield
            return
        self._init_rng = torch.random.get_rng_state()
        with torch.device("meta"):
            yield

    def _place_model(self, fitting: bool) -> None:
        if not has_meta_tensors(self.model):
            return super()._place_model(fitting)
        if self._init_rng is None:
            raise ValueError(
                "the model has parameters on the meta device but was not created in LightningModule.configure_model(); "
                "build it there (lightning_shard then materializes it shard by shard), or create it on a real device."
            )
        self._deferred = DeferredInit(self.model, self.param_init_fn, self.root_device)
        if not fitting:  # no engine to shard into: materialize the whole model
            torch.random.set_rng_state(self._init_rng)
            for m in self._deferred.modules_in_order():
                self._deferred.materialize(m)
            self._deferred = None

    def _deferred_init(self) -> Optional[DeferredInit]:
        if self._deferred is not None and self._init_rng is not None:
            torch.random.set_rng_state(self._init_rng)
        deferred, self._deferred = self._deferred, None
        return deferred

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # weights load into the shards, which exist only after setup

    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if isinstance(self._launcher, _MultiProcessingLauncher):
            self._launcher = _GatheringLauncher(self, start_method=self._start_method)

    # ------------------------------------------------------------------ the root unit around each step
    def _around_step(self, step: Callable, *args: Any, **kwargs: Any) -> Any:
        controller = self.engine.controller if self.engine is not None else None
        if controller is None:
            return step(*args, **kwargs)
        module = self.lightning_module
        controller.step_pre_forward(backward_inside=module is not None and not module.automatic_optimization)
        try:
            out = step(*args, **kwargs)
        except BaseException:
            controller.abort_pass()
            raise
        controller.step_post_forward(out)
        return out

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._around_step(super().training_step, *args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._around_step(super().validation_step, *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._around_step(super().test_step, *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._around_step(super().predict_step, *args, **kwargs)

    def teardown(self) -> None:
        trainer = getattr(self.lightning_module, "_trainer", None) if self.lightning_module is not None else None
        interrupted = trainer is not None and trainer.interrupted
        if self.engine is not None and self.engine.controller is not None and not interrupted:
            self.engine.controller.release_to_module()  # the plain module works after fit (collective)
        super().teardown()


class FSDPShardStrategy(Zero3Strategy):
    """FSDP-style: units chosen by a wrap policy (module classes or a minimum parameter count)."""

    strategy_name = "fsdp_shard"
    CONFIG = FSDPConfig
    GRANULARITY = "fsdp"

    @takes_knobs_of(FSDPConfig)
    def __init__(self, **knobs: Any) -> None:
        super().__init__(**knobs)


for _cls in (Zero3Strategy, FSDPShardStrategy):
    describe(_cls)
