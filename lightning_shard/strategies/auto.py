"""``strategy=auto`` (registered as ``zero_auto``: Lightning reserves the name "auto" for its own default).

At setup the planner (``lightning_shard.planner``) scores every strategy, accumulation policy and hybrid
layout for this model on this machine's topology and world size, and builds the row that
``lightning-shard plan`` marks recommended for the same inputs (``recommend()``, then ``apply()``; checked by
tests/config/test_planner_advice.py); the table is logged once on rank 0 with the reason and the runner-up.
Knobs: :class:`~lightning_shard.strategies.config.AutoConfig` (documented there and in ``help(AutoStrategy)``).
"""

from __future__ import annotations

import logging
from typing import Any

from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from .adapter import ATTRIBUTE_OF
from .config import AutoConfig
from .knobs import describe, takes_knobs_of
from .layout import make_groups, resolve_topology
from .zero3 import Zero3Strategy

log = logging.getLogger(__name__)
STAGE_OF = {"zero0": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp_shard": 3, "zero2_hybrid": 2,
            "zero3_hybrid": 3, "fsdp_shard_hybrid": 3}


class AutoStrategy(Zero3Strategy):
    strategy_name = "zero_auto"
    CONFIG = AutoConfig  # wrap_classes / min_params: used if the planner picks fsdp_shard
    DEFERRED_INIT = False  # the choice is made at setup, after configure_model(): no meta-device init

    @takes_knobs_of(AutoConfig)
    def __init__(self, **knobs: Any) -> None:
        self.recommendation: Any = None
        super().__init__(**knobs)

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
        (the hybrid and island process groups are made by ``_choose``, collectively)."""
        name, kw = rec.strategy_name, dict(rec.kwargs)
        self.stage = STAGE_OF[name]
        self.granularity = "fsdp" if name.startswith("fsdp") else "zero3"
        self.accumulation = kw.pop("accumulation", "auto")
        shard = kw.pop("shard_size", None)
        if shard:
            self.shard_size = shard
        for key in [k for k in kw if k in self.CONFIG.names() and k not in ATTRIBUTE_OF and k != "stage"]:
            setattr(self, key, kw.pop(key))  # bucket_mb, reshard_after_forward, prefetch_depth, wrap policy ...
        if kw:
            raise ValueError(f"strategy=auto cannot apply the planner's knobs {sorted(kw)} for {name}: the planner "
                             "and strategies/auto.py disagree (a bug; please report it)")
        self.recommendation = rec

    def _choose(self, trainer: Any) -> None:
        rec = self.recommend(int(trainer.accumulate_grad_batches or 1))
        self.apply(rec)
        if rec.kwargs.get("shard_size") or rec.kwargs.get("secondary_shard"):  # groups the planned row needs
            topology = resolve_topology(self.topology_spec, self.num_processes)
            self._groups = make_groups(self.shard_size, topology, self.world_size, self.num_nodes, self.global_rank,
                                       self.stage, self._timeout, getattr(self, "secondary_shard", None))
        rank_zero_info(f"lightning_shard strategy=auto chose {rec.strategy_name} ({rec.reason})")
        for row in rec.table:
            rank_zero_info("  " + ", ".join(f"{k}={v}" for k, v in row.items() if not isinstance(v, dict)))

    def _resolve_accumulation(self, trainer: Any) -> tuple[str, str]:
        if self.accumulation != "auto":
            return self.accumulation, f"chosen by strategy=auto ({type(self).strategy_name})"
        return super()._resolve_accumulation(trainer) if self.stage == 3 else ("defer", "stage <= 2")


describe(AutoStrategy)
