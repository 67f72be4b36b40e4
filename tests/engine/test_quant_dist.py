"""Compressed communication on 2 gloo ranks (``gather_quant``, ``reduce_quant``; comm/quant.py): the ledger's bytes
against the formula, counts per micro-batch, what the gathers deliver (quantized in training, exact for export and
after fit), and error feedback's long-run sum."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_shard.engine.buckets.bucket import Bucket
from lightning_shard.engine.buckets.context import BucketContext
from lightning_shard.engine.comm import collectives as C
from lightning_shard.engine.comm import quant as Q
from lightning_shard.engine.comm.choices import CommChoices
from lightning_shard.engine.engine import ShardEngine
from lightning_shard.engine.spec import ShardSpec
from lightning_shard.engine.states import GradState
from lightning_shard.options import options_for


@pytest.fixture(scope="module")
def w(worlds):
    return worlds(2)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 64), nn.Tanh(), nn.Linear(64, 48), nn.Tanh(), nn.Linear(48, 5))


def _engine(model: nn.Module, stage: int, accumulation: str = "defer", **compression: Any
            ) -> tuple[ShardEngine, torch.optim.Optimizer]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    tuning = {"bucket_mb": 0.004, **({"min_unit_mb": 0} if stage == 3 else {})}
    accumulation = "keep_unsharded_grads" if (stage, accumulation) == (3, "defer") else accumulation
    options = options_for(f"zero{stage}", accumulation=accumulation, tuning=tuning, compression=compression)
    return ShardEngine(model, [opt], options), opt


def _micro(engine: ShardEngine, model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
           ) -> torch.Tensor:
    # the step's forward inside the controller's pass (what Zero3Strategy.training_step and Fabric's root hooks do:
    # without it the units' "ran" marks are stale and backward takes prefetched units for idle ones), zero_grad, the
    # engine's backward hooks: Lightning's order
    if engine.controller is not None:
        engine.controller.step_pre_forward()
    out = model(x)
    if engine.controller is not None:
        engine.controller.step_post_forward(out)
    loss = ((out - y) ** 2).mean()
    opt.zero_grad()
    engine.pre_backward()
    loss.backward()
    engine.post_backward()
    return loss.detach()


def _step(engine: ShardEngine, model: nn.Module, opt: torch.optim.Optimizer, s: int, acc: int = 1) -> float:
    g = torch.Generator().manual_seed(100 + s)
    rank = C.get_rank()
    X, Y = torch.randn(2, acc, 8, 24, generator=g)[rank], torch.randn(2, acc, 8, 5, generator=g)[rank]
    losses = []
    for m in range(acc):
        if m < acc - 1:
            with engine.no_sync():
                losses.append(_micro(engine, model, opt, X[m], Y[m]))
        else:
            losses.append(_micro(engine, model, opt, X[m], Y[m]))
    engine.prepare_step(opt)
    opt.step()
    engine.finish_step(opt)
    return float(torch.stack(losses).mean())


def ledger_of_one_step(stage: int, gather_quant: str, reduce_quant: str, acc: int) -> dict[str, Any]:
    model = _model()
    engine, opt = _engine(model, stage, gather_quant=gather_quant, reduce_quant=reduce_quant, block=64,
                          accumulation="keep_unsharded_grads" if stage == 3 else "defer")
    _step(engine, model, opt, 0, acc)  # the first step discovers the stage-3 schedule
    mark = C.LEDGER.mark()
    _step(engine, model, opt, 1, acc)
    entries = [(e.op, e.tag, e.bytes, e.wire_bytes, e.dtype) for e in C.LEDGER.since(mark)]
    shard_numel = {f"bucket{b.index}": b.layout.shard_numel for b in engine.buckets}
    trainable = [f"bucket{b.index}" for b in engine.buckets if b.trainable]
    residual = engine.memory_report()["error_feedback"]
    full = sum(b.layout.padded_numel for b in engine.buckets if b.trainable)
    engine.remove_hooks()
    return {"entries": entries, "shard_numel": shard_numel, "trainable": trainable, "residual": residual,
            "full": full}


@pytest.mark.parametrize("stage,gq,rq", [(3, "int8", "int8"), (3, "int8", "none"), (3, "none", "int4"),
                                         (2, "none", "int8"), (1, "none", "int4")])
def test_ledger_bytes_are_the_quantized_payload_plus_scales(w, stage, gq, rq):
    acc = 2
    out = w.run(ledger_of_one_step, stage, gq, rq, acc)[0]
    entries, shard_numel = out["entries"], out["shard_numel"]
    # error feedback keeps one fp32 residual per trainable element, reported by the engine's memory report
    assert out["residual"] == (4 * out["full"] if rq != "none" else 0)
    grads = [e for e in entries if e[1].startswith("grad_")]
    gathers = [e for e in entries if e[1].startswith("unshard_")]
    assert {e[1].removeprefix("grad_") for e in grads} == set(out["trainable"])  # one reduction per bucket per step
    for op, tag, nbytes, wire, dtype in grads:
        n = shard_numel[tag.removeprefix("grad_")]
        if rq == "none":
            assert (op, nbytes) == ("all_to_all", 2 * n * 4)
        else:
            assert (op, dtype) == ("all_to_all", "uint8")
            assert nbytes == 2 * Q.piece_bytes(rq, 64, n)  # N pieces of (integers + 4 bytes per 64-element block)
            assert wire == nbytes / 2  # (N-1)/N on 2 ranks
    if stage == 3:
        # the same gathers as without quantization (per unit, per micro-batch, forward and backward), fewer bytes
        plain = w.run(ledger_of_one_step, stage, "none", "none", acc)[0]["entries"]
        assert sorted(e[1] for e in gathers) == sorted(e[1] for e in plain if e[1].startswith("unshard_"))
        assert len(gathers) >= 2 * acc * len(shard_numel) - 2  # (the last unit may stay from forward to backward)
        for op, tag, nbytes, _, dtype in gathers:
            n = shard_numel[tag.removeprefix("unshard_")]
            assert op == "all_gather"
            assert nbytes == (2 * Q.piece_bytes("int8", 64, n) if gq == "int8" else 2 * n * 4)
            assert dtype == ("uint8" if gq == "int8" else "float32")


def gathered_values(gather_quant: str) -> dict[str, Any]:
    """Inside a training forward the gathered buffer holds the dequantized shards; ``full_params()`` (export) and the
    end of training hold the exact ones."""
    model = _model()
    engine, opt = _engine(model, 3, gather_quant=gather_quant, block=64)
    for s in range(3):
        _step(engine, model, opt, s)
    b = next(b for b in engine.buckets if any(p is model[0].weight for p in b.params))
    exact = torch.empty(b.layout.padded_numel)
    C.all_gather(exact, b.store.shard.clone(), tag="test_exact")
    seen: dict[str, torch.Tensor] = {}

    def capture(mod: nn.Module, args: Any) -> None:
        seen.setdefault("fwd", b.store.flat_param.clone())

    handle = model[0].register_forward_pre_hook(capture)
    _step(engine, model, opt, 3)  # the forward reads the weights `exact` holds; the step then updates them
    handle.remove()
    exact_now = torch.empty(b.layout.padded_numel)
    C.all_gather(exact_now, b.store.shard.clone(), tag="test_exact")
    engine.controller.before_step()
    with engine.controller.full_params():
        export = b.store.flat_param.clone()
    engine.controller.release_to_module()
    after_fit = torch.cat([p.detach().reshape(-1) for p in b.params])
    engine.remove_hooks()
    q = Q.QuantLayout.of("int8", 64, b.layout.shard_numel)
    buf = torch.empty(2, q.piece_bytes, dtype=torch.uint8)
    expected_fwd = Q.quantize(exact.view(2, -1), q, buf).reshape(-1)
    return {"fwd": seen["fwd"], "exact": exact, "exact_now": exact_now, "export": export, "after_fit": after_fit,
            "expected_fwd": expected_fwd, "numel": b.layout.numel}


def test_training_gathers_are_quantized_and_export_and_end_of_fit_are_exact(w):
    for r in w.run(gathered_values, "int8"):
        assert not torch.equal(r["fwd"], r["exact"])  # forward saw the quantized weights ...
        assert torch.equal(r["fwd"], r["expected_fwd"])  # ... exactly the dequantized shards of every rank
        assert torch.equal(r["export"], r["exact_now"])  # full_params(): the values themselves
        # after fit the module holds the exact values (the layout keeps parameters in order, padding aside)
        assert torch.equal(r["after_fit"], r["exact_now"][: r["after_fit"].numel()])
    plain = w.run(gathered_values, "none")[0]
    assert torch.equal(plain["fwd"], plain["exact"])


def error_feedback_sums(reduce_quant: str, steps: int, feedback: bool, nan_at: int = -1) -> dict[str, torch.Tensor]:
    """One bucket, hand-made gradients: each block holds one large value and many values below half a step, which
    plain rounding sends as zero every time. Returns the sum over steps of the averaged gradient shard applied and
    of the true average."""
    rank, world = C.get_rank(), C.get_world_size()
    p = nn.Parameter(torch.zeros(512))
    ctx = BucketContext(ShardSpec(2, world), rank, reduce_quant=reduce_quant, quant_block=64, error_feedback=feedback,
                        comm=CommChoices(reduce_scatter="all_to_all"))
    b = Bucket(ctx, 0, [p], ["w"], 0, [0])
    g = torch.Generator().manual_seed(7 + rank)
    applied = torch.zeros(b.owned_numel)
    true = torch.zeros(512)
    for step in range(steps):
        grad = torch.rand(512, generator=g) * 1e-3
        grad[::64] = 1.0  # the block's absmax: a step of 1/127 (int8) or 1/7 (int4)
        if step == nan_at:  # an overflow: that step is skipped (as skip_nonfinite / the fp16 scaler do)
            grad[5] = float("nan")
        p.grad = grad.clone()  # a gradient set by hand: attach_grads takes it into the bucket's buffer
        b.attach_grads()
        b.grads.launch(async_op=True)
        b.grads.finish(boundary=True, accumulate=False)
        b.grads.set_state(GradState.EMPTY)
        if step == nan_at:
            assert not bool(b.shard_param.grad.isfinite().all()) or b.own_lo > 5  # rank 0's range holds the nan
            continue  # skipped on every rank: neither applied nor counted
        applied += b.shard_param.grad
        mean = grad.clone()
        C.all_reduce(mean, tag="test_true")
        true += mean / world
    return {"applied": applied, "true": true[b.own_lo:b.own_hi], "residual_bytes": b.tensor_bytes()["error_feedback"]}


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_error_feedback_keeps_the_long_run_sum_of_applied_gradients_equal_to_the_true_sum(w, kind):
    steps = 200
    levels = Q.LEVELS[Q.BITS[kind]]
    for r in w.run(error_feedback_sums, kind, steps, True):
        # sum_t applied_t = sum_t true_t - mean_r residual_r,T: at most half a step (absmax 1.0 / levels) per rank
        bound = 1.0 / (2 * levels) * (1 + 1e-3)
        err = (r["applied"] - r["true"]).abs().max().item()
        assert err <= bound, (err, bound)
    # a skipped non-finite step leaves the residual finite (the nan's block restarts from zero) and the error
    # bounded: the skipped step's own rounding error (at most one step) stays in the residual, since the reduction
    # cannot know the step will be skipped; 200 steps later the sum is still within 1.5 steps
    for r in w.run(error_feedback_sums, kind, steps, True, 3):
        assert (r["applied"] - r["true"]).abs().max().item() <= 3 * 1.0 / (2 * levels) * (1 + 1e-3)
    for r in w.run(error_feedback_sums, kind, steps, False):
        # without feedback the small values are rounded away every step: their whole sum (~0.1 here) is lost
        small = torch.arange(r["applied"].numel()) % 64 != 0
        assert bool((r["applied"][small] == 0).all())
        assert r["residual_bytes"] == 0  # compression.error_feedback=False keeps no residual
        assert r["true"][small].min().item() > 0.05


def accumulation_counts(stage: int, rq: str, acc: int, policy: str) -> list[int]:
    model = _model()
    engine, opt = _engine(model, stage, reduce_quant=rq, accumulation=policy)
    _step(engine, model, opt, 0, acc)
    mark = C.LEDGER.mark()
    _step(engine, model, opt, 1, acc)
    n = sum(1 for e in C.LEDGER.since(mark) if e.tag.startswith("grad_"))
    trainable = sum(1 for b in engine.buckets if b.trainable)
    engine.remove_hooks()
    return [n, trainable]


@pytest.mark.parametrize("stage,policy,per_micro", [(2, "per_micro_batch", True), (2, "defer", False),
                                                    (3, "per_micro_batch", True)])
def test_quantized_reductions_per_micro_batch_follow_the_accumulation_policy(w, stage, policy, per_micro):
    acc = 3
    n, trainable = w.run(accumulation_counts, stage, "int8", acc, policy)[0]
    assert n == trainable * (acc if per_micro else 1)


def quant_training(stage: int, gq: str, rq: str, steps: int) -> list[float]:
    model = _model()
    engine, opt = _engine(model, stage, gather_quant=gq, reduce_quant=rq)
    rank, losses = C.get_rank(), []
    A = torch.randn(24, 5, generator=torch.Generator().manual_seed(1))
    for s in range(steps):  # a teacher the model can learn
        x = torch.randn(2, 16, 24, generator=torch.Generator().manual_seed(200 + s))[rank]
        losses.append(float(_micro(engine, model, opt, x, torch.tanh(x @ A))))
        engine.prepare_step(opt)
        opt.step()
        engine.finish_step(opt)
    engine.remove_hooks()
    return losses


def test_quantized_training_tracks_exact_training(w):
    steps = 60
    exact = w.run(quant_training, 3, "none", "none", steps)[0]
    for gq, rq in [("int8", "int8"), ("none", "int4")]:
        q = w.run(quant_training, 3, gq, rq, steps)[0]
        assert q[-1] < 0.8 * q[0]  # it learns
        assert abs(q[-1] - exact[-1]) <= 0.02 * exact[-1], (gq, rq, q[-1], exact[-1])
