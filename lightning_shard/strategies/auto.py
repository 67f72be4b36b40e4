"""``strategy=auto`` (registered as ``zero_auto``: Lightning reserves the name "auto" for its own default).

At setup the planner (``lightning_shard.planner``) scores every strategy, accumulation policy and hybrid
layout for this model on this machine's topology and world size, and builds the row that
``lightning-shard plan`` marks recommended for the same inputs (``recommend()``, then ``apply()``; checked by
tests/test_planner_advice.py); the table is logged once on rank 0 with the reason and the runner-up.
Knobs: those of the stage-3 strategies plus these, and ``topology`` (default ``"detect"``):

``global_batch_size`` / ``micro_batch_size``  the batch the planner's compute estimate assumes; by default
                  derived from ``accumulate_grad_batches`` with micro-batch 1.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from . import zero as _zero
from . import zero3 as _zero3
from .knobs import describe
from .layout import make_groups, resolve_topology
from .zero3 import ZERO3_KNOBS, Zero3Strategy

log = logging.getLogger(__name__)
STAGE_OF = {"zero0": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp_shard": 3, "zero2_hybrid": 2,
            "zero3_hybrid": 3, "fsdp_shard_hybrid": 3}


class AutoStrategy(Zero3Strategy):
    strategy_name = "zero_auto"
    KNOBS = ZERO3_KNOBS + ("global_batch_size", "micro_batch_size", "wrap_classes", "min_params")
    STAGES = (0, 1, 2, 3)

    def __init__(self, global_batch_size: Optional[int] = None, micro_batch_size: Optional[int] = None,
                 wrap_classes: Any = "auto", min_params: Optional[int] = None, **kwargs: Any) -> None:
        kwargs.setdefault("topology", "detect")
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.wrap_classes, self.min_params = wrap_classes, min_params  # used if the planner picks fsdp_shard
        self.recommendation: Any = None
        super().__init__(**kwargs)

    def _unit_config(self):
        cfg = super()._unit_config()
        if self.GRANULARITY == "fsdp":
            cfg.wrap_classes, cfg.min_params = self.wrap_classes, self.min_params
        return cfg

    def model_sharded_context(self):  # the choice is made at setup: no meta-device init here
        return super(Zero3Strategy, self).model_sharded_context()

    def setup(self, trainer: Any) -> None:
        if trainer.state.fn == TrainerFn.FITTING and self.recommendation is None:
            self._choose(trainer)
        super().setup(trainer)

    def recommend(self, accumulate_grad_batches: int = 1) -> Any:
        """The planner's choice for this model, machine, world and batch: what ``lightning-shard plan`` prints
        as recommended for the same inputs (``planner.recommend_for``). No side effects, no collectives."""
        from ..planner import recommend_for

        micro = self.micro_batch_size or 1
        global_batch = self.global_batch_size or micro * accumulate_grad_batches * self.world_size
        topology = resolve_topology(self.topology_spec, self.num_processes)
        return recommend_for(self.lightning_module, None, topology, self.world_size, global_batch, micro,
                             self.precision_plugin.precision)

    def apply(self, rec: Any) -> None:
        """Become the recommended strategy: its stage, unit granularity and every knob of the planned row
        (the hybrid process groups are made by ``_choose``, collectively)."""
        name, kw = rec.strategy_name, dict(rec.kwargs)
        self.stage = STAGE_OF[name]
        self.GRANULARITY = "fsdp" if name.startswith("fsdp") else "zero3"
        self.accumulation = kw.pop("accumulation", "auto")
        for key in ("bucket_mb", "reshard_after_forward", "prefetch_depth", "wrap_classes", "min_params"):
            if key in kw:
                setattr(self, key, kw.pop(key))
        shard = kw.pop("shard_size", None)
        if shard:
            self.shard_size = shard
        if kw:
            raise ValueError(f"strategy=auto cannot apply the planner's knobs {sorted(kw)} for {name}: the planner "
                             "and strategies/auto.py disagree (a bug; please report it)")
        self.recommendation = rec

    def _choose(self, trainer: Any) -> None:
        rec = self.recommend(int(trainer.accumulate_grad_batches or 1))
        self.apply(rec)
        if rec.kwargs.get("shard_size"):
            topology = resolve_topology(self.topology_spec, self.num_processes)
            self._groups = make_groups(self.shard_size, topology, self.world_size, self.num_nodes, self.global_rank,
                                       self.stage, self._timeout)
        rank_zero_info(f"lightning_shard strategy=auto chose {rec.strategy_name} ({rec.reason})")
        for row in rec.table:
            rank_zero_info("  " + ", ".join(f"{k}={v}" for k, v in row.items() if not isinstance(v, dict)))

    def _resolve_accumulation(self, trainer: Any) -> tuple[str, str]:
        if self.accumulation != "auto":
            return self.accumulation, f"chosen by strategy=auto ({type(self).strategy_name})"
        return super()._resolve_accumulation(trainer) if self.stage == 3 else ("defer", "stage <= 2")


describe(AutoStrategy, _zero.__doc__, _zero3.__doc__, __doc__)
