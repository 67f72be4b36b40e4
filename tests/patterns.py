"""Worker-side scenarios of Lightning's training patterns (issue 43), run inside :class:`tests.harness.World` ranks:
a GAN in Lightning's documented manual-optimization style and its variants, and automatic optimization with an
accumulation that changes (``GradientAccumulationScheduler``) or ends early (a short last window). Each scenario
trains the same module on the same per-rank data under Lightning's own ``ddp`` (the peer) or one of ours, and
returns rank 0's ``model.state_dict()`` after ``fit`` as a user saves it, with the collectives of every step.

The nets are wide enough (512) that every strategy has real units and buckets with its default knobs: zero3 makes a
unit of every 512 x 512 layer (``min_unit_mb`` = 1 MiB), fsdp_shard one per block of the ``blocks`` lists.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from typing import Any, Optional

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from lightning_shard.engine.comm import collectives as C
from tests.c10d_counter import C10dCounter
from tests.scenarios import late_all_gather

Z, X, WIDTH, MICRO = 16, 8, 512, 4
OURS = "lightning_shard.engine.comm.collectives"

# the manual-optimization variants of the GAN step (GanModule.training_step)
GAN_VARIANTS = ("gan", "toggle", "toggle_tiny", "detached", "two_losses", "retain_graph", "manual_acc",
                "manual_acc_nosync", "zero_grad_held", "clip")
# refused as DDP refuses it (torch's in-place check), with our explanation
REFUSED_VARIANTS = ("stale_graph",)
# automatic optimization (Regressor): an accumulation that changes or ends early; a parameter of the LightningModule
# itself read by training_step before any forward (every all-gather deferred to its wait: tests/scenarios.py)
AUTO_VARIANTS = ("grad_acc_scheduler", "short_last_window", "root_parameter", "early_read")


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.lin(h))


class Net(nn.Module):
    def __init__(self, n_in: int, n_out: int, width: int = WIDTH, depth: int = 2) -> None:
        super().__init__()
        self.inp = nn.Linear(n_in, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.out = nn.Linear(width, n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for b in self.blocks:
            h = b(h)
        return self.out(h)


def _bce(logits: torch.Tensor, target: float) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(logits, torch.full_like(logits, target))


class GanModule(L.LightningModule):
    """Two optimizers, manual optimization, Lightning's documented style; ``variant`` picks the step."""

    def __init__(self, variant: str = "gan", acc: int = 2) -> None:
        super().__init__()
        if variant not in GAN_VARIANTS + REFUSED_VARIANTS:
            raise ValueError(f"unknown GAN variant {variant!r}")
        torch.manual_seed(1234)
        self.gen, self.disc = Net(Z, X), Net(X, 1)
        # toggle_tiny: a third optimizer over one element, which only one of two ranks owns a piece of
        self.temperature = nn.Parameter(torch.ones(())) if variant == "toggle_tiny" else None
        self.automatic_optimization = False
        self.variant, self.acc = variant, acc
        self.norms: list[float] = []

    def configure_optimizers(self) -> Any:
        opt_g = torch.optim.SGD(self.gen.parameters(), lr=0.05, momentum=0.9)
        opt_d = torch.optim.Adam(self.disc.parameters(), lr=1e-3, eps=1e-6)
        if self.temperature is not None:
            return opt_g, opt_d, torch.optim.SGD([self.temperature], lr=0.05)
        return opt_g, opt_d

    def training_step(self, batch: Any, batch_idx: int) -> None:
        real, z = batch
        opt_g, opt_d, *_ = self.optimizers()
        getattr(self, f"_{self.variant}")(real, z, opt_g, opt_d, batch_idx)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.disc(x) if self.temperature is None else self.disc(x) / self.temperature

    def _d_loss(self, real: torch.Tensor, fake: torch.Tensor) -> torch.Tensor:
        return _bce(self._logits(real), 1.0) + _bce(self._logits(fake), 0.0)

    def _g_loss(self, fake: torch.Tensor) -> torch.Tensor:
        return _bce(self._logits(fake), 1.0)

    def _gan(self, real, z, opt_g, opt_d, i) -> None:  # fake not detached: both backwards reach both networks
        loss_d = self._d_loss(real, self.gen(z))
        opt_d.zero_grad()
        self.manual_backward(loss_d)
        opt_d.step()
        loss_g = self._g_loss(self.gen(z))
        opt_g.zero_grad()
        self.manual_backward(loss_g)
        opt_g.step()

    def _toggle(self, real, z, opt_g, opt_d, i) -> None:  # Lightning's GAN example: toggle_optimizer around each
        self.toggle_optimizer(opt_g)
        loss_g = self._g_loss(self.gen(z))
        self.manual_backward(loss_g)
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)
        self.toggle_optimizer(opt_d)
        loss_d = self._d_loss(real, self.gen(z))  # not detached: the toggle keeps G's gradients out
        self.manual_backward(loss_d)
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)

    def _toggle_tiny(self, real, z, opt_g, opt_d, i) -> None:
        """As ``toggle``, and the temperature's optimizer (one element: on two ranks one owns it, the other holds no
        piece of it and so cannot see its toggle) steps with D: off in G's phase, on in D's."""
        opt_t = self.optimizers()[2]
        self._toggle(real, z, opt_g, opt_d, i)
        self.toggle_optimizer(opt_t)
        self.manual_backward(self._d_loss(real, self.gen(z)))
        opt_t.step()
        opt_t.zero_grad()
        self.untoggle_optimizer(opt_t)
        opt_g.zero_grad()
        opt_d.zero_grad()

    def _detached(self, real, z, opt_g, opt_d, i) -> None:  # D's step leaves G without gradients
        fake = self.gen(z)
        opt_d.zero_grad()
        self.manual_backward(self._d_loss(real, fake.detach()))
        opt_d.step()
        opt_g.zero_grad()
        self.manual_backward(self._g_loss(fake))
        opt_g.step()

    def _two_losses(self, real, z, opt_g, opt_d, i) -> None:  # two backwards, one step
        opt_d.zero_grad()
        self.manual_backward(_bce(self.disc(real), 1.0))
        self.manual_backward(_bce(self.disc(self.gen(z).detach()), 0.0))
        opt_d.step()
        opt_g.zero_grad()
        self.manual_backward(self._g_loss(self.gen(z)))
        opt_g.step()

    def _retain_graph(self, real, z, opt_g, opt_d, i) -> None:  # G's graph kept for the second backward
        fake = self.gen(z)
        opt_d.zero_grad()
        self.manual_backward(self._d_loss(real, fake), retain_graph=True)
        opt_d.step()
        opt_g.zero_grad()
        self.manual_backward(self._g_loss(fake))
        opt_g.step()

    def _manual_acc(self, real, z, opt_g, opt_d, i) -> None:  # accumulation by hand: a step every `acc` batches
        step = (i + 1) % self.acc == 0
        self.manual_backward(self._d_loss(real, self.gen(z).detach()) / self.acc)
        if step:
            opt_d.step()
            opt_d.zero_grad()
        self.manual_backward(self._g_loss(self.gen(z)) / self.acc)  # reaches D too: adds to D's next window
        if step:
            opt_g.step()
            opt_g.zero_grad()

    def _manual_acc_nosync(self, real, z, opt_g, opt_d, i) -> None:  # the same, syncing only at the step
        step = (i + 1) % self.acc == 0
        with opt_d.toggle_model(sync_grad=step):
            self.manual_backward(self._d_loss(real, self.gen(z)) / self.acc)
        if step:
            opt_d.step()
            opt_d.zero_grad()
        with opt_g.toggle_model(sync_grad=step):
            self.manual_backward(self._g_loss(self.gen(z)) / self.acc)
        if step:
            opt_g.step()
            opt_g.zero_grad()

    def _zero_grad_held(self, real, z, opt_g, opt_d, i) -> None:
        """Windows of 2 whose first micro-batch is not synced (the strategy's block_backward_sync, which
        toggle_model(sync_grad=False) enters, without its toggling). G's backward reaches D, and D's window starts
        after it with ``opt_d.zero_grad()``: that meets D's gradients held unreduced and drops them (by setting
        None in even windows, by zeroing in place in odd ones: set_to_none=False keeps the parameters stepping
        with zero gradients, as torch does). D's backward reaches G, whose window keeps it."""
        step, first = (i + 1) % self.acc == 0, i % self.acc == 0
        sync = (lambda: contextlib.nullcontext()) if step else self.trainer.strategy.block_backward_sync
        with sync():
            self.manual_backward(self._g_loss(self.gen(z)) / self.acc)
        if first:
            opt_d.zero_grad(set_to_none=(i // self.acc) % 2 == 0)
        with sync():
            self.manual_backward(self._d_loss(real, self.gen(z)) / self.acc)
        if step:
            opt_g.step()
            opt_d.step()
            opt_g.zero_grad()
            opt_d.zero_grad()

    def _stale_graph(self, real, z, opt_g, opt_d, i) -> None:  # a graph backwarded again after its weights stepped
        loss_g = self._g_loss(self.gen(z))
        self.manual_backward(loss_g, retain_graph=True)
        opt_g.step()
        opt_g.zero_grad()
        self.manual_backward(loss_g)

    def _clip(self, real, z, opt_g, opt_d, i) -> None:  # clipping by hand, by norm (D) and by value (G)
        opt_d.zero_grad()
        self.manual_backward(self._d_loss(real, self.gen(z).detach()))
        self.clip_gradients(opt_d, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
        opt_d.step()
        opt_g.zero_grad()
        self.manual_backward(self._g_loss(self.gen(z)))
        self.clip_gradients(opt_g, gradient_clip_val=1e-3, gradient_clip_algorithm="value")
        opt_g.step()


class Regressor(L.LightningModule):
    """Automatic optimization, one optimizer (SGD with momentum: linear in the gradient, tight parity).
    ``scale``: a parameter of the LightningModule itself, read before the net's forward (no module forward of its
    own that a wait could hang on), from the third step on only (the step after the first optimizer step, which the
    strategy watches for such reads, does not read it); ``early``: a weight of the net read by the step's code
    before the net's forward, at every step."""

    def __init__(self, scale: bool = False, early: bool = False) -> None:
        super().__init__()
        torch.manual_seed(1234)
        self.scale = nn.Parameter(torch.ones(())) if scale else None
        self.early = early
        self.net = Net(Z, X)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        z, target = batch
        if self.scale is not None and self.trainer.global_step >= 2:
            z = z * self.scale
        if self.early:
            z = z + self.net.out.bias.mean()
        return F.mse_loss(self.net(z), target)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def _data(kind: str, n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    if kind == "gan":
        return TensorDataset(torch.randn(n, X, generator=g) * 0.5 + 1.0, torch.randn(n, Z, generator=g))
    return TensorDataset(torch.randn(n, Z, generator=g), torch.randn(n, X, generator=g))


class StepLedger(L.Callback):
    """Per training batch: the ledger's collectives and an independent count of torch.distributed's calls."""

    def __init__(self, counter: Optional[C10dCounter]) -> None:
        self.counter, self.batches = counter, []
        self._marks = (0, 0)

    def on_train_batch_start(self, *args: Any) -> None:
        self._marks = (C.LEDGER.mark(), self.counter.mark() if self.counter else 0)

    def on_train_batch_end(self, *args: Any) -> None:
        entries = C.LEDGER.since(self._marks[0])
        calls = self.counter.since(self._marks[1]) if self.counter else []
        self.batches.append({
            "ledger": Counter(c for e in entries for c in e.calls),
            "ours": Counter(op for op, who in calls if who == OURS),
            "grad": Counter(e.tag.split("_bucket")[0] for e in entries if "_bucket" in e.tag),
        })


def _strategy(name: str, knobs: Optional[dict] = None) -> Any:
    """Lightning's ``ddp``, or ours by registry name with every knob at its default but ``knobs``."""
    from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

    if name == "ddp":
        return DDPStrategy(find_unused_parameters=True)
    knobs = dict(knobs or {})
    if name.endswith("_hybrid"):  # 4 ranks as 2 islands x 2 (the cpu_2x2 preset): shard inside, replicate across
        knobs.setdefault("topology", "cpu_2x2")
    entry = StrategyRegistry[name]
    return entry["strategy"](**{**entry["init_params"], **knobs})


class PolicyLog(logging.Handler):
    """The lines the strategy logs about its accumulation policy (rank 0's ``rank_zero_info``)."""

    NAMES = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        self._levels: dict[str, int] = {}

    def emit(self, record: logging.LogRecord) -> None:
        if "accumulation=" in record.getMessage():
            self.lines.append(record.getMessage())

    def __enter__(self) -> "PolicyLog":
        for name in self.NAMES:
            logger = logging.getLogger(name)
            self._levels[name] = logger.level
            logger.setLevel(logging.INFO)
            logger.addHandler(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        for name in self.NAMES:
            logging.getLogger(name).removeHandler(self)
            logging.getLogger(name).setLevel(self._levels[name])


# per pattern: (epochs, micro-batches per rank and epoch)
SHAPE = {"grad_acc_scheduler": (4, 8),  # 8 steps in each of epochs 0 and 1, then 2 windows of 4 in epochs 2 and 3
         "short_last_window": (2, 6)}  # accumulate_grad_batches=4: windows of 4 and 2 in each epoch
SHORT_WINDOW_ACC = 4


def fit_pattern(strategy: str, pattern: str, *, count: bool = False, knobs: Optional[dict] = None) -> dict[str, Any]:
    """Train ``pattern`` under ``strategy`` (a registry name with default knobs, or ``"ddp"``): rank-local data
    from a ``DistributedSampler(shuffle=False)``; ``SHAPE``'s micro-batches per rank and epoch (a GAN: 2 epochs of
    6). ``count``: torch.distributed's calls counted beside the ledger (tests/c10d_counter.py)."""
    epochs, batches = SHAPE.get(pattern, (2, 6))
    world, rank = C.get_world_size(), C.get_rank()
    L.seed_everything(0, verbose=False)
    counter = C10dCounter() if count else None
    ledger = StepLedger(counter)
    callbacks: list[L.Callback] = [ledger]
    accumulate = 1
    if pattern in GAN_VARIANTS + REFUSED_VARIANTS:
        module: L.LightningModule = GanModule(pattern, acc=2)
        data = _data("gan", batches * world * MICRO)
    else:
        module = Regressor(scale=pattern == "root_parameter", early=pattern == "early_read")
        data = _data("reg", batches * world * MICRO)
        if pattern == "grad_acc_scheduler":  # 1 micro-batch per step in epoch 0 and 1, then 4
            callbacks.append(GradientAccumulationScheduler(scheduling={0: 1, 2: 4}))
        elif pattern == "short_last_window":
            accumulate = SHORT_WINDOW_ACC  # `batches` is not a multiple of it: each epoch's last window is short
        elif pattern not in ("root_parameter", "early_read"):
            raise ValueError(f"unknown pattern {pattern!r}")
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=_strategy(strategy, knobs), max_epochs=epochs,
                        accumulate_grad_batches=accumulate, use_distributed_sampler=False, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=callbacks)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=False)
    loader = DataLoader(data, batch_size=MICRO, sampler=sampler)
    late = late_all_gather() if pattern in ("root_parameter", "early_read") else contextlib.nullcontext()
    with PolicyLog() as log, counter if counter is not None else contextlib.nullcontext(), late:
        trainer.fit(module, loader)
    engine = getattr(trainer.strategy, "engine", None)
    return {"state": {k: v.detach().clone() for k, v in module.state_dict().items()},
            "batches": ledger.batches, "global_step": trainer.global_step, "log": log.lines,
            "policy": getattr(trainer.strategy, "accumulation_policy", None),
            "trainable_buckets": len(engine.sync.buckets) if engine is not None else 0,
            "units": [u.name for u in engine.units] if engine is not None else [],
            "buckets": len(engine.buckets) if engine is not None else 0}
