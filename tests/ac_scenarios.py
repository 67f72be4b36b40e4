"""Worker-side scenarios for tests/strategies/test_activation_checkpointing.py: a fit of a model from
``tests/foreign.py`` under a registered strategy with default knobs plus ``activation_checkpointing``, counting per
micro-batch the parameter all-gathers the stage-3 controller issued (ledger tags ``unshard_bucket*``, split into
forward and backward by ``in_backward``) and the forward calls of one module inside a block."""

from __future__ import annotations

import warnings
from collections import Counter
from typing import Any, Optional

import lightning as L
from lightning.pytorch.strategies import StrategyRegistry
from torch.utils.data import DataLoader

from lightning_shard.engine import activation
from lightning_shard.engine.comm import collectives as C
from tests.foreign import ForeignModule, dataset
from tests.zoo import RankMicroBatches


class Counts(L.Callback):
    """Per training micro-batch: stage-3 parameter all-gathers (forward, backward) and forward calls of the module
    named ``probe`` (its forward pre-hook; it sits inside a checkpointed block, so it runs again in the
    recomputation)."""

    def __init__(self, probe: Optional[str]) -> None:
        self.probe, self.gathers, self.calls, self._handle, self._n = probe, [], [], None, 0
        self.blocks: list[str] = []
        self.events: list[list[tuple[str, str]]] = []
        self.controller: Any = None
        self.unit_of: dict[str, str] = {}  # ledger tag of a stage-3 bucket -> its unit
        self.schedule: list[str] = []  # the backward schedule at the end of fit
        self.resident: list[str] = []
        self.step_units: list[str] = []  # gathered around the step (the root): once per pass, kept into backward

    def on_train_start(self, trainer: Any, module: Any) -> None:
        if self.probe:
            self._handle = module.get_submodule(self.probe).register_forward_pre_hook(self._count)
        self.blocks = [n for n, m in module.named_modules() if activation.checkpointed(m)]
        self.controller = trainer.strategy.engine.controller
        if self.controller is not None:
            self.controller.gathers.record_events = True
            self.unit_of = {f"unshard_bucket{b.index}": u.name for u in self.controller.units for b in u.buckets}

    def _count(self, *_: Any) -> None:
        self._n += 1

    def on_train_batch_start(self, *args: Any) -> None:
        self._mark, self._n = C.LEDGER.mark(), 0
        self._event = len(self.controller.gathers.events) if self.controller is not None else 0

    def on_train_batch_end(self, *args: Any) -> None:
        entries = [e for e in C.LEDGER.since(self._mark) if e.op == "all_gather" and e.tag.startswith("unshard")]
        self.gathers.append(dict(Counter(("backward" if e.in_backward else "forward", e.tag) for e in entries)))
        self.calls.append(self._n)
        if self.controller is not None:  # the controller's own record: (what, unit name), in order
            units = self.controller.units
            self.events.append([(what, units[i].name) for what, i in self.controller.gathers.events[self._event:]])

    def on_train_end(self, trainer: Any, *args: Any) -> None:
        if self._handle is not None:
            self._handle.remove()
        # units the discovery saw run twice in one pass (gathered until the pass ends from then on)
        self.resident = [u.name for u in self.controller.units if u.resident] if self.controller is not None else []
        self.schedule = [self.controller.units[i].name for i in self.controller.schedule.bwd_order] \
            if self.controller else []
        self.step_units = [u.name for u in self.controller.schedule.step_units] if self.controller is not None else []


def _strategy(name: str, **kwargs: Any) -> Any:
    entry = StrategyRegistry[name]
    return entry["strategy"](**dict(entry["init_params"], **kwargs))


def fit_ac(name: str, strategy: str, steps: int, acc: int, ac: Any = None, probe: Optional[str] = None,
           save_to: Optional[str] = None) -> dict[str, Any]:
    """``Trainer(strategy=<registered name>(activation_checkpointing=ac))``, every other knob at its default; rank 0's
    ``model.state_dict()`` after fit, and the counts of :class:`Counts` on every rank."""
    world, rank = C.get_world_size(), C.get_rank()
    L.seed_everything(0, verbose=False)
    module = ForeignModule(name)
    counts = Counts(probe)
    caught = warnings.catch_warnings(record=True)
    seen = caught.__enter__()
    warnings.simplefilter("always")
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=_strategy(strategy, activation_checkpointing=ac),
                        max_steps=steps, accumulate_grad_batches=acc, use_distributed_sampler=False, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[counts])
    data = dataset(name, steps, acc, world)
    try:
        trainer.fit(module, DataLoader(data, batch_sampler=RankMicroBatches(len(data), acc, world, rank)))
    finally:
        caught.__exit__(None, None, None)
    if save_to:
        trainer.save_checkpoint(save_to)
    return {"state": {k: v.detach().clone() for k, v in module.state_dict().items()} if rank == 0 else None,
            "gathers": counts.gathers, "calls": counts.calls, "checkpointed": counts.blocks,
            "resident": counts.resident, "events": counts.events, "unit_of": counts.unit_of,
            "backward_schedule": counts.schedule, "step_units": counts.step_units,
            "warnings": [str(w.message) for w in seen],
            "left_patched": [n for n, m in module.named_modules() if activation.checkpointed(m)]}


def load_ac(name: str, strategy: str, steps: int, acc: int, path: str, ac: Any = None) -> Optional[dict]:
    """Resume from ``path`` (written by :func:`fit_ac` under another strategy / knob) into a fit that has no step
    left to take: rank 0's ``model.state_dict()`` is the checkpoint's weights as this strategy loaded them."""
    world, rank = C.get_world_size(), C.get_rank()
    L.seed_everything(0, verbose=False)
    module = ForeignModule(name)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=_strategy(strategy, activation_checkpointing=ac),
                        max_steps=steps, accumulate_grad_batches=acc, use_distributed_sampler=False, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    data = dataset(name, steps, acc, world)
    trainer.fit(module, DataLoader(data, batch_sampler=RankMicroBatches(len(data), acc, world, rank)), ckpt_path=path)
    return {k: v.detach().clone() for k, v in module.state_dict().items()} if rank == 0 else None


def setup_error(name: str, strategy: str, ac: Any) -> str:
    """The error a fit raises at setup for a knob value that matches nothing in the model."""
    try:
        fit_ac(name, strategy, 1, 1, ac)
    except ValueError as err:
        return str(err)
    return "no error"
