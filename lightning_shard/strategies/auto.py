"""``strategy=auto`` (registered as ``zero_auto``: Lightning reserves the name "auto" for its own default).

At setup the planner (``lightning_shard.planner``) scores every strategy, accumulation policy and hybrid
layout for this model on this machine's topology and world size, and builds the row that
``lightning-shard plan`` marks recommended for the same inputs (``recommend()``, then ``apply()``; checked by
tests/planner/test_planner_advice.py); the table is logged once on rank 0 with the reason and the runner-up.

The planned row's options replace the strategy's (:func:`lightning_shard.options.convert`: the user's options carry
over, the row's choices win), so from then on ``self.options`` is the strategy it runs as, one source of truth;
the engine follows ``options.stage``. Options: :class:`~lightning_shard.options.AutoOptions` (documented there and
in ``help(AutoStrategy)``).
"""

from __future__ import annotations

import time
from typing import Any, Optional

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from ..options import REGISTERED, AutoOptions, convert
from .signature import describe, takes_options_of
from .zero3 import Zero3Strategy


class AutoStrategy(Zero3Strategy):
    """The planner's pick: at setup, the strategy, accumulation policy and hybrid layout that
    ``lightning-shard plan`` recommends for this model, machine and batch (``strategy=auto`` in Hydra)."""

    strategy_name = "zero_auto"
    OPTIONS = AutoOptions  # the stage-3 options and the wrap policy: used if the planner picks zero3 / fsdp_shard
    DEFERRED_INIT = False  # the choice is made at setup, after configure_model(): no meta-device init

    @takes_options_of(AutoOptions)
    def __init__(self, **options: Any) -> None:
        self.recommendation: Any = None
        super().__init__(**options)

    def setup(self, trainer: Any) -> None:
        if trainer.state.fn == TrainerFn.FITTING and self.recommendation is None:
            self._choose(trainer)
        super().setup(trainer)

    def recommend(self, accumulate_grad_batches: int = 1) -> Any:
        """The planner's choice for this model, machine, world and batch: what ``lightning-shard plan`` prints
        as recommended for the same inputs (``planner.recommend_for``). No side effects and no collectives, but
        with ``calibrate=True``: then every rank calls it, and measures what the machine profile lacks."""
        from ..planner import recommend_for

        opts = self.options
        micro = getattr(opts, "micro_batch_size", None) or 1
        global_batch = getattr(opts, "global_batch_size", None) or micro * accumulate_grad_batches * self.world_size
        calibrated = {"calibrate": True, "in_job": self.root_device, "profile_path": opts.profile} \
            if getattr(opts, "calibrate", False) else {}
        return recommend_for(self.lightning_module, None, self._topology(), self.world_size, global_batch, micro,
                             self.precision_plugin.precision, **calibrated)

    def apply(self, rec: Any) -> None:
        """Run as the recommended strategy: its options (stage, unit granularity, every option of the planned row)
        replace these (the hybrid and island process groups are made by ``_choose``, collectively)."""
        name = rec.strategy_name.removesuffix("_hybrid")
        cls, stage = REGISTERED[name]
        self.options = convert(self.options, cls, stage, rec.kwargs)
        self.recommendation = rec

    def _choose(self, trainer: Any) -> None:
        check_after = self.options.check_after_steps
        rec = self.recommend(int(trainer.accumulate_grad_batches or 1))
        self.apply(rec)
        if rec.calibration:
            rank_zero_info(f"lightning_shard strategy=auto calibration: {rec.calibration}")
        if check_after:
            trainer.callbacks.append(StepTimeCheck(rec.predicted_step_s, rec.time_model, check_after))
        if rec.kwargs.get("shard_size") or rec.kwargs.get("secondary_shard"):  # groups the planned row needs
            self._make_groups()
        rank_zero_info(f"lightning_shard strategy=auto chose {rec.strategy_name} ({rec.reason})")
        for row in rec.table:
            rank_zero_info("  " + ", ".join(f"{k}={v}" for k, v in row.items() if not isinstance(v, dict)))

    def _resolve_accumulation(self, trainer: Any) -> tuple[str, str]:
        if self.options.accumulation != "auto":
            return self.options.accumulation, f"chosen by strategy=auto ({type(self).strategy_name})"
        return super()._resolve_accumulation(trainer) if self.options.stage == 3 else ("defer", "stage <= 2")


class StepTimeCheck(Callback):
    """Logs, once, the planner's predicted step time beside the measured one: the median interval between the ends
    of optimizer steps 2 ... ``after`` (the first step pays one-time costs), so every job checks the time model."""

    def __init__(self, predicted_s: float, model: str, after: int) -> None:
        self.predicted_s, self.model, self.after = predicted_s, model, after
        self.ends: list[float] = []
        self.measured_s: Optional[float] = None

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.measured_s is not None or trainer.global_step <= len(self.ends):
            return  # logged already, or this batch did not end an optimizer step
        self.ends.append(time.perf_counter())
        if len(self.ends) > self.after:
            gaps = sorted(b - a for a, b in zip(self.ends, self.ends[1:]))  # steps 2 ... after + 1
            self.measured_s = gaps[len(gaps) // 2]
            err = self.predicted_s / self.measured_s - 1
            rank_zero_info(f"lightning_shard strategy=auto: predicted {self.predicted_s:.4f} s/step ({self.model} "
                           f"model), measured {self.measured_s:.4f} s/step (median of optimizer steps "
                           f"2-{self.after + 1}): {err:+.0%}")


describe(AutoStrategy)
