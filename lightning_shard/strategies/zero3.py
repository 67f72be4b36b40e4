"""Lightning strategies ``zero3`` and ``fsdp_shard``: parameters sharded too (stage 3 of the same engine).

``zero3``: every module with direct parameters is a unit (DeepSpeed stage-3 granularity), small modules merged into
the unit of a module enclosing them (``tuning.min_unit_mb``).
``fsdp_shard``: units chosen by a wrap policy, e.g. ``FSDPShardStrategy(wrap_classes=["Block"])``.

Options: :class:`~lightning_shard.options.Zero3Options` and ``FSDPOptions`` (ZeroOptions' plus parameter sharding;
documented there and in ``help(Zero3Strategy)``).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Generator, Optional

import torch

from ..engine.zero3.deferred import DeferredInit, has_meta_tensors
from ..options import FSDPOptions, Zero3Options
from .signature import describe, takes_options_of
from .zero import ZeroStrategy


class Zero3Strategy(ZeroStrategy):
    """ZeRO-3: optimizer state, gradients and parameters sharded; every module with parameters is a unit."""

    strategy_name = "zero3"
    OPTIONS = Zero3Options
    DEFAULT_STAGE = 3
    DEFERRED_INIT = True  # configure_model() runs on the meta device (strategy=auto decides too late for that)

    @takes_options_of(Zero3Options)
    def __init__(self, **options: Any) -> None:
        self._deferred: Optional[DeferredInit] = None
        self._init_rng: Optional[torch.Tensor] = None
        super().__init__(**options)

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
        self._deferred = DeferredInit(self.model, self.options.param_init_fn, self.root_device)
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
        """The module whole again after fit (collective): every rank gathers its units for good. Lightning's
        fork/spawn launcher reads ``module.state_dict()`` after this teardown, on every rank, and hands rank 0's
        to the parent process: full weights, not the empty shards."""
        trainer = getattr(self.lightning_module, "_trainer", None) if self.lightning_module is not None else None
        interrupted = trainer is not None and trainer.interrupted
        if self.engine is not None and self.engine.controller is not None and not interrupted:
            self.engine.controller.release_to_module()
        super().teardown()


class FSDPShardStrategy(Zero3Strategy):
    """FSDP-style: units chosen by a wrap policy (module classes or a minimum parameter count)."""

    strategy_name = "fsdp_shard"
    OPTIONS = FSDPOptions

    @takes_options_of(FSDPOptions)
    def __init__(self, **options: Any) -> None:
        super().__init__(**options)


for _cls in (Zero3Strategy, FSDPShardStrategy):
    describe(_cls)
