"""Precision plugin for the sharded strategies.

Lightning picks a precision plugin from ``Trainer(precision=...)``; a sharded strategy must change what
happens around the optimizer step (shard gradients, global clipping norm, agreed fp16 overflow skip), so
the strategy wraps whichever plugin Lightning chose in :class:`ShardedPrecision`. Casting, autocast and
init contexts stay the chosen plugin's; the step, clipping and loss scaling become ours.

Module-level class (picklable for the spawn launcher).
"""

from __future__ import annotations

import warnings
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision

from ..engine.scaler import LossScaler

if TYPE_CHECKING:
    from ..engine.engine import ShardEngine

SUPPORTED = ("32-true", "64-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")


def check_grads(engine: "ShardEngine", optimizer: Any, loss_scaler: Optional[LossScaler]) -> str:
    """After the boundary backward: make the shard gradients final, then the fp16 overflow check (gradients unscaled)
    or the non-finite check, agreed on every rank. ``"ok"``, ``"overflow"`` (fp16) or ``"nonfinite"``
    (``skip_nonfinite=True``, warned; ``False`` raises)."""
    engine.prepare_step(optimizer)
    if loss_scaler is not None:
        return "overflow" if engine.unscale_and_check(optimizer, 1.0 / loss_scaler.scale) else "ok"
    if engine.options.safety.skip_nonfinite is not None:
        bad = engine.find_nonfinite(optimizer)
        if bad is not None:
            if not engine.options.safety.skip_nonfinite:
                raise FloatingPointError(f"non-finite gradient in parameter {bad}; the step was not taken on any "
                                         "rank. Lower the learning rate, clip gradients, or pass "
                                         "skip_nonfinite=True to skip such steps with a warning.")
            warnings.warn(f"non-finite gradient in parameter {bad}: optimizer step skipped on every rank",
                          stacklevel=4)
            return "nonfinite"
    return "ok"


def sharded_step(engine: "ShardEngine", optimizer: Any, loss_scaler: Optional[LossScaler],
                 before_step: Callable[[], None], step: Callable[[], Any], checked: Optional[str] = None) -> str:
    """One optimizer step on the engine's shards: :func:`check_grads` (unless ``checked`` already holds its answer),
    ``before_step`` (hooks, clipping: on true gradients), ``step``, then the post-step parameter gather. Returns
    ``"stepped"``, ``"overflow"`` (fp16: skipped, scale lowered) or ``"nonfinite"`` (skipped with a warning).
    Shared by the Trainer's precision plugin and the Fabric strategies."""
    outcome = checked if checked is not None else check_grads(engine, optimizer, loss_scaler)
    if outcome == "nonfinite":
        engine.skip_step(optimizer)
        return outcome
    before_step()
    if outcome == "overflow":  # every rank got the same answer from the all-reduced flag
        engine.skip_step(optimizer)
        loss_scaler.update(True)
        return outcome
    step()
    engine.finish_step(optimizer)
    if loss_scaler is not None:
        loss_scaler.update(False)
    return "stepped"


def _unwrapped(optimizer: Any) -> Any:
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


class ShardedPrecision(Precision):
    """Lightning's precision plugin with the optimizer step handed to the engine: ``inner`` (Lightning's plugin for
    the precision asked for) keeps autocast and dtypes; the engine steps the sharded optimizer, and fp16's loss
    scaling is ours, its overflow decision agreed on by every rank before anyone steps."""

    def __init__(self, inner: Optional[Precision] = None) -> None:
        inner = inner if inner is not None else Precision()
        if isinstance(inner, ShardedPrecision):
            inner = inner.inner
        if type(inner) not in (Precision, MixedPrecision, HalfPrecision, DoublePrecision):
            raise ValueError(
                f"precision plugin {type(inner).__name__} is not supported by the lightning_shard strategies; use "
                f"Trainer(precision=...) with one of {', '.join(SUPPORTED)}."
            )
        self.inner = inner
        self.precision = inner.precision
        # fp16 needs loss scaling; Lightning's torch GradScaler decides per rank, ours agrees across ranks.
        self.loss_scaler: Optional[LossScaler] = LossScaler() if self.precision in ("16-mixed", "16-true") else None
        self._engine: Optional[ShardEngine] = None  # the strategy's engine, from attach()
        self.skipped_steps = 0

    # ---------------------------------------------------------------- delegated to Lightning's plugin
    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return self.inner.convert_module(module)

    def tensor_init_context(self) -> AbstractContextManager:
        return self.inner.tensor_init_context()

    def module_init_context(self) -> AbstractContextManager:
        return self.inner.module_init_context()

    def forward_context(self) -> AbstractContextManager:
        return self.inner.forward_context()

    def convert_input(self, data: Any) -> Any:
        return self.inner.convert_input(data)

    def convert_output(self, data: Any) -> Any:
        return self.inner.convert_output(data)

    # ---------------------------------------------------------------- ours
    def attach(self, engine: Optional["ShardEngine"]) -> None:
        """The strategy hands over the engine that owns the shards (None: detached, e.g. after teardown)."""
        self._engine = engine

    @property
    def engine(self) -> "ShardEngine":
        if self._engine is None:
            raise RuntimeError("the lightning_shard precision plugin was used before its strategy set up the engine "
                               "(ShardedPrecision.attach); it only works inside a lightning_shard strategy")
        return self._engine

    def pre_backward(self, tensor: torch.Tensor, module: Any) -> torch.Tensor:
        if self.loss_scaler is not None:
            tensor = tensor * self.loss_scaler.scale
        return super().pre_backward(tensor, module)

    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        closure_result = closure()  # forward + backward (the boundary backward finishes the reductions)
        outcome = sharded_step(self.engine, optimizer, self.loss_scaler, lambda: self._after_closure(model, optimizer),
                               lambda: optimizer.step(**kwargs))
        if outcome == "nonfinite":
            self.skipped_steps += 1
        return closure_result

    # ``LightningModule.clip_gradients(opt, ...)`` in manual optimization passes the ``LightningOptimizer`` wrapper
    def clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        self.engine.clip_grad_norm_(_unwrapped(optimizer), clip_val)

    def clip_grad_by_value(self, optimizer: Any, clip_val: float) -> None:
        self.engine.clip_grad_value_(_unwrapped(optimizer), clip_val)

    def state_dict(self) -> dict[str, Any]:
        return {"loss_scaler": self.loss_scaler.state_dict()} if self.loss_scaler is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.loss_scaler is not None and "loss_scaler" in state_dict:
            self.loss_scaler.load_state_dict(state_dict["loss_scaler"])
