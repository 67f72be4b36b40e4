"""Deferred init (configure_model on the meta device) and stage-3 bad input."""

from __future__ import annotations

import threading
import time
from typing import Any

import lightning as L
import psutil
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_shard.strategies import FSDPShardStrategy, Zero3Strategy
from tests.harness import fresh_world

WIDTH, DEPTH = 512, 8


def _stack() -> nn.Module:
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH)) for _ in range(DEPTH)])


class _Deferred(L.LightningModule):
    def __init__(self, deferred: bool) -> None:
        super().__init__()
        self.deferred = deferred
        self.net = None if deferred else _stack()
        self.snapshot: dict[str, torch.Tensor] = {}

    def configure_model(self) -> None:
        if self.net is None:
            self.net = _stack()

    def training_step(self, batch: Any, i: int) -> torch.Tensor:
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class _Snapshot(L.Callback):
    """Full weights right after setup (collective), and the peak RSS growth while setting up."""

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}
        self.base = psutil.Process().memory_info().rss
        self.peak = self.base
        self._stop = False
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        proc = psutil.Process()
        while not self._stop:
            self.peak = max(self.peak, proc.memory_info().rss)
            time.sleep(0.0005)

    def on_fit_start(self, trainer, pl_module) -> None:
        self._stop = True
        self._thread.join()
        self.weights = {k: v.clone() for k, v in trainer.strategy.full_state_dict().items()}


def deferred_setup(deferred: bool, steps: int, strategy: str = "zero3") -> dict[str, Any]:
    L.seed_everything(0, verbose=False)
    module = _Deferred(deferred)
    snap = _Snapshot()
    cls = FSDPShardStrategy if strategy == "fsdp" else Zero3Strategy
    kw = {"min_params": WIDTH * WIDTH} if strategy == "fsdp" else {}  # fsdp: the Linear layers are the units
    trainer = L.Trainer(accelerator="cpu", devices=torch.distributed.get_world_size(), strategy=cls(**kw),
                        max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[snap])
    data = torch.randn(16, WIDTH, generator=torch.Generator().manual_seed(1))
    trainer.fit(module, DataLoader(TensorDataset(data), batch_size=2))
    final = trainer.strategy.full_state_dict()
    deferred_init = getattr(trainer.strategy.engine, "deferred", None)
    return {"init": snap.weights, "final": final, "growth": snap.peak - snap.base,
            "peak_full_bytes": deferred_init.peak_live_bytes if deferred_init is not None else None,
            "root_bytes": trainer.strategy.engine.controller.root.full_bytes
            if trainer.strategy.engine.controller.root is not None else 0,
            "full_bytes": sum(v.numel() * v.element_size() for v in snap.weights.values())}


def full_init_reference() -> dict[str, torch.Tensor]:
    L.seed_everything(0, verbose=False)
    return {f"net.{k}": v for k, v in _stack().state_dict().items()}


@pytest.fixture(scope="module")
def world4(worlds):
    return worlds(4)  # the shared per-module World (conftest.py)


@pytest.mark.parametrize("strategy", ["zero3", "fsdp"])
def test_deferred_init_matches_full_init_and_trains_the_same(world4, strategy):
    deferred = world4.run(deferred_setup, True, 2, strategy)
    eager = world4.run(deferred_setup, False, 2, strategy)
    ref = full_init_reference()
    for r in deferred:
        assert r["init"].keys() == ref.keys()
        for k in ref:
            assert torch.equal(r["init"][k], ref[k]), k  # same values as a full init with the same seed
    for d, e in zip(deferred, eager):
        for k in d["final"]:
            assert torch.equal(d["final"][k], e["final"][k]), k


def test_deferred_init_peak_memory_is_the_rank_share(world4):
    """Deferred init never holds more than one unit's full parameters at once, besides the root unit (the engine's
    own accounting of live unsharded storage during materialization), so setup needs the rank's shards plus one
    unit, not the model. The root unit holds the layer norms (zero3 merges modules below ``min_unit_mb`` into an
    enclosing unit) and is sharded when the last of them is materialized. RSS growth is reported in the issue note;
    with an 8 MiB model it is dominated by fixed overheads."""
    res = world4.run(deferred_setup, True, 0)
    full = res[0]["full_bytes"]
    unit = (WIDTH * WIDTH + WIDTH) * 4  # the largest unit: one Linear
    norms = DEPTH * 2 * WIDTH * 4
    for r in res:
        assert r["root_bytes"] == norms
        assert 0 < r["peak_full_bytes"] <= unit + norms, (r["peak_full_bytes"], unit)
        assert r["peak_full_bytes"] < full / 7


def test_meta_model_without_configure_model_is_refused():
    class Meta(L.LightningModule):
        def __init__(self):
            super().__init__()
            with torch.device("meta"):
                self.l = nn.Linear(2, 2)

    s = Zero3Strategy()
    s._lightning_module = s.model = Meta()
    with pytest.raises(ValueError, match="not created in LightningModule.configure_model"):
        s._place_model(fitting=True)


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(tuning={"reshard_after_forward": "sometimes"}), ValueError, "reshard_after_forward must be True"),
    (dict(tuning={"prefetch_depth": -1}), ValueError, "prefetch_depth must be None .* or an integer >= 0"),
    (dict(accumulation="defer"), ValueError, "accumulation must be one of"),
    (dict(tuning={"prefetch": 2}), TypeError, "did you mean 'prefetch_depth'"),
    (dict(prefetch_depth=2), TypeError, r"'prefetch_depth'.*tuning=\{'prefetch_depth'"),
])
def test_zero3_bad_options(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        Zero3Strategy(**kwargs)


def test_fsdp_needs_a_policy():
    with pytest.raises(ValueError, match="needs a wrap policy"):
        FSDPShardStrategy(wrap_classes=None)


def _units(model: nn.Module, **kw):
    from lightning_shard.engine.zero3.plan import plan_units

    return plan_units(model, "fsdp", kw.get("wrap_classes"), kw.get("min_params"))


def test_wrap_policy_matching_nothing_or_everything():
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    with pytest.raises(ValueError, match="matched no module; module classes in this model"):
        _units(model, wrap_classes=["Block"])
    with pytest.raises(ValueError, match="every module with parameters a unit"):
        _units(model, wrap_classes=["Linear"])
    with pytest.raises(ValueError, match="matches the root module"):
        _units(model, wrap_classes=["Sequential"])


def test_wrap_policy_splitting_tied_weights():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(5, 4)
            self.head = nn.Linear(4, 5, bias=False)
            self.head.weight = self.emb.weight
            self.mid = nn.Linear(4, 4)
            self.norm = nn.LayerNorm(4)  # stays in the root unit

    with pytest.raises(ValueError, match="tied across units"):
        _units(Tied(), wrap_classes=["Embedding", "Linear"])
    # zero3 granularity hoists the tied weight into the root unit instead
    from lightning_shard.engine.zero3.plan import plan_units

    specs = plan_units(Tied(), "zero3")
    assert specs[0].name == "<root>" and specs[0].names == ["emb.weight"]


class _WithEval(L.LightningModule):
    """torchmetrics in the module, a no_grad validation loop, predict after fit, eval mode."""

    def __init__(self) -> None:
        super().__init__()
        import torchmetrics

        torch.manual_seed(3)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
        self.val_mean = torchmetrics.MeanMetric()

    def training_step(self, batch, i):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch, i):
        x, y = batch
        self.val_mean.update(nn.functional.cross_entropy(self.net(x), y))
        self.log("val_loss", self.val_mean, sync_dist=True)

    def predict_step(self, batch, i):
        return self.net(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def eval_loops() -> dict[str, Any]:
    L.seed_everything(0, verbose=False)
    module = _WithEval()
    g = torch.Generator().manual_seed(5)
    data = TensorDataset(torch.randn(32, 6, generator=g), torch.randint(0, 3, (32,), generator=g))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=Zero3Strategy(), max_epochs=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, DataLoader(data, batch_size=4), DataLoader(data, batch_size=4))
    val = float(trainer.callback_metrics["val_loss"])
    shapes = [tuple(p.shape) for p in module.parameters()]  # the plain module is whole again after fit
    x = torch.randn(5, 6, generator=g)
    module.eval()
    with torch.no_grad():
        direct = module.net(x)
    preds = trainer.predict(module, DataLoader(TensorDataset(x), batch_size=5))
    return {"val": val, "shapes": shapes, "direct": direct, "pred": preds[0]}


def test_validation_metrics_predict_and_eval_after_fit():
    with fresh_world(2) as w:
        res = w.run(eval_loops)
    assert res[0]["shapes"] == [(16, 6), (16,), (3, 16), (3,)]
    assert res[0]["val"] == res[1]["val"] and res[0]["val"] > 0  # torchmetrics synced over ranks
    expected = {0: [0, 2, 4], 1: [1, 3]}  # Lightning splits predict data over ranks without padding
    for rank, r in enumerate(res):
        assert torch.allclose(r["pred"], r["direct"][expected[rank]])
    assert torch.equal(res[0]["direct"], res[1]["direct"])  # identical weights on both ranks


class _Twice(L.LightningModule):
    """A module called twice in one forward (weight sharing across depth), and gathered_params() for export."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.inp = nn.Linear(5, 8)
        self.shared = nn.Linear(8, 8)
        self.out = nn.Linear(8, 2)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.shared(h))
        h = torch.tanh(self.shared(h))  # same unit, second call
        return self.out(h)

    def training_step(self, batch, i):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _twice_data() -> TensorDataset:
    g = torch.Generator().manual_seed(6)
    return TensorDataset(torch.randn(32, 5, generator=g), torch.randn(32, 2, generator=g))


def twice_fit(kind: str) -> dict[str, Any]:
    from tests.zoo import RankMicroBatches

    L.seed_everything(0, verbose=False)
    module = _Twice()
    strategy = Zero3Strategy() if kind == "zero3" else FSDPShardStrategy(min_params=40)  # fsdp: Linears >= 40
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=4, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False)
    data = _twice_data()
    rank = torch.distributed.get_rank()
    trainer.fit(module, DataLoader(data, batch_sampler=RankMicroBatches(len(data), 1, 2, rank)))
    # gathered_params(): full weights inside the block on every rank, then sharded again
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        module.eval()
        out = module(x)
    return {"state": {k: v.clone() for k, v in module.state_dict().items()}, "out": out}


@pytest.mark.parametrize("kind", ["zero3", "fsdp"])
def test_module_called_twice_matches_reference(kind):
    from tests.zoo import MICRO

    with fresh_world(2) as w:
        res = w.run(twice_fit, kind)
    L.seed_everything(0, verbose=False)
    ref = _Twice()
    L.Trainer(accelerator="cpu", devices=1, max_steps=4, accumulate_grad_batches=2, logger=False,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False).fit(
        ref, DataLoader(_twice_data(), batch_size=MICRO))
    for r in res:
        for k, v in ref.state_dict().items():
            assert torch.allclose(r["state"][k], v, atol=1e-5), k


def gathered_inside() -> dict[str, Any]:
    L.seed_everything(0, verbose=False)
    module = _Twice()
    strategy = Zero3Strategy()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)

    class Probe(L.Callback):
        def on_train_end(self, trainer, pl_module):
            self.before = tuple(pl_module.shared.weight.shape)
            with trainer.strategy.gathered_params():
                self.inside = tuple(pl_module.shared.weight.shape)
                self.norm = float(pl_module.shared.weight.norm())
            self.after = tuple(pl_module.shared.weight.shape)

    probe = Probe()
    trainer.callbacks.append(probe)
    trainer.fit(module, DataLoader(_twice_data(), batch_size=4))
    return {"before": probe.before, "inside": probe.inside, "after": probe.after, "norm": probe.norm}


def test_gathered_params_context_gives_full_weights():
    with fresh_world(2) as w:
        res = w.run(gathered_inside)
    for r in res:
        assert r["before"] == (0,) and r["after"] == (0,)  # sharded placeholders outside the block
        assert r["inside"] == (8, 8) and r["norm"] > 0
    assert res[0]["norm"] == res[1]["norm"]
