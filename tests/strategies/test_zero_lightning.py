"""zero0 / zero1 / zero2 under Lightning's Trainer on 2 and 4 gloo ranks, against a single-process reference.

Must-show of the ZeRO-1/2 issue: parity, collective counts per micro-batch, ledger bytes = formula,
optimizer-state memory 1/N, global clipping norm. One :class:`World` per world size for the module.
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Optional

import pytest
import torch

from tests.scenarios import STEPS, fit_zero
from tests.zoo import ZooModule, max_diff, params_of, reference_fit

TOL = 1e-5


# ------------------------------------------------------------------------------------------ test side


@functools.lru_cache(maxsize=None)
def reference(acc: int, world: int, optimizer: str = "sgd", clip: Optional[float] = None,
              precision: str = "32-true", steps: int = STEPS, unused: bool = True, clip_algorithm: str = "norm"):
    return reference_fit(steps, acc, world, optimizer=optimizer, clip=clip, precision=precision, unused=unused,
                         clip_algorithm=clip_algorithm)


CASES = [(0, "defer"), (1, "defer"), (2, "defer"), (2, "per_micro_batch")]
_RUNS: dict = {}


def counted_run(worlds, stage: int, policy: str, acc: int, via: str = "auto") -> list:
    """One run per case for both ranks' assertions."""
    if (stage, policy, acc, via) not in _RUNS:
        _RUNS[(stage, policy, acc, via)] = worlds(2).run(fit_zero, stage, policy, acc,
                                                         strategy_kwargs={"comm": {"reduce_scatter": via}})
    return _RUNS[(stage, policy, acc, via)]


def grad_op(stage: int, via: str) -> str:
    """The collective a gradient bucket's reduction is on these (gloo) ranks: zero0 all-reduces; zero1-3
    reduce-scatter, which ``reduce_scatter_via="auto"`` runs as an all-to-all and a sum on gloo
    (engine/comm/reduce.py ``reduce_form``)."""
    if stage == 0:
        return "all_reduce"
    return {"auto": "all_to_all"}.get(via, via)


VIAS = ["auto", "reduce_scatter", "all_reduce"]  # the default (on gloo: all-to-all and sum) and the other two forms


def buffers_of(state: dict) -> dict:
    return {k: v for k, v in state.items() if "running" in k or "num_batches" in k}


_DDP: dict = {}


@pytest.mark.parametrize("acc", [1, 3])
@pytest.mark.parametrize("stage,policy", CASES + [(3, "per_micro_batch")],
                         ids=[f"zero{s}-{p}" for s, p in CASES + [(3, "per_micro_batch")]])
def test_batchnorm_buffers_match_lightning_ddp(worlds, stage, policy, acc):
    """BatchNorm statistics cannot match one process (each rank normalizes its own micro-batch), so the peer is
    Lightning's DDPStrategy: rank 0's running mean/var and batch count after fit, and the parameters."""
    from tests.scenarios import fit_lightning_ddp

    if acc not in _DDP:
        _DDP[acc] = worlds(2).run(fit_lightning_ddp, acc)
    ours = worlds(2).run(fit_zero, stage, policy, acc)
    bufs = buffers_of(ours[0]["state"])
    assert len(bufs) == 3, sorted(bufs)
    assert max_diff(bufs, buffers_of(_DDP[acc][0]["state"])) <= 1e-5
    assert max_diff(params_of(ours[0]["state"]), params_of(_DDP[acc][0]["state"])) <= 1e-5


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("acc", [1, 3])
@pytest.mark.parametrize("stage,policy", CASES, ids=[f"zero{s}-{p}" for s, p in CASES])
def test_parity_with_single_process(worlds, world, acc, stage, policy):
    results = worlds(world).run(fit_zero, stage, policy, acc)
    ref_state, _ = reference(acc, world)
    for rank, res in enumerate(results):
        diff = max_diff(params_of(res["state"]), params_of(ref_state))
        assert diff <= TOL, f"rank {rank}: max abs diff {diff:.3e} > {TOL}"
    # buffers are rank 0's on every rank (broadcast after each step)
    for res in results[1:]:
        assert max_diff(res["state"], results[0]["state"]) == 0.0


NATIVE = [(2, "defer"), (2, "per_micro_batch"), (3, "per_micro_batch"), (3, "keep_unsharded_grads")]


def _gather_paths() -> list[str]:
    from lightning_shard.engine.comm.gather import BROADCAST_MIN_BYTES, all_gather_form

    return [all_gather_form(choice, None, nbytes).name for choice, nbytes in [
        ("auto", BROADCAST_MIN_BYTES - 4), ("auto", BROADCAST_MIN_BYTES), ("auto", None), ("all_gather", 2**30),
        ("broadcast", 4)]]


def test_all_gather_path_by_backend_and_size(worlds):
    """On gloo ``"auto"`` takes broadcasts from 1 MiB of output up (or when the size is not given), the backend's
    all-gather below; an explicit choice holds at any size; a wrong one is refused."""
    assert worlds(2).run(_gather_paths)[0] == ["all_gather", "broadcast", "broadcast", "all_gather", "broadcast"]
    from lightning_shard.engine.comm.choices import CommChoices

    with pytest.raises(ValueError, match="CommChoices.all_gather must be one of"):
        CommChoices(all_gather="ring")


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("stage,policy", [(1, "defer"), (2, "defer"), (3, "per_micro_batch")],
                         ids=["zero1", "zero2", "zero3"])
def test_all_gather_as_broadcasts_is_bit_identical(worlds, world, stage, policy):
    """``all_gather_via="broadcast"`` (gloo's default for buckets of 1 MiB or more; these test buckets are smaller, so
    ``"auto"`` keeps gloo's all-gather here) against ``"all_gather"``: a gather copies values, so the weights after fit
    are bit-identical, on every rank; the ledger records all-gathers whose calls are N broadcasts each."""
    acc = 2
    bc = worlds(world).run(fit_zero, stage, policy, acc, strategy_kwargs={"comm": {"all_gather": "broadcast"}})
    ag = worlds(world).run(fit_zero, stage, policy, acc, strategy_kwargs={"comm": {"all_gather": "all_gather"}})
    auto = worlds(world).run(fit_zero, stage, policy, acc)
    for rank in range(world):
        assert bc[rank]["gather_paths"] == ["broadcast"] and ag[rank]["gather_paths"] == ["all_gather"]
        assert auto[rank]["gather_paths"] == ["all_gather"], auto[rank]["gather_paths"]  # small buckets
        assert set(bc[rank]["gather_calls"]) == {"broadcast"} and set(ag[rank]["gather_calls"]) == {"all_gather"}
        assert bc[rank]["gather_calls"]["broadcast"] == world * ag[rank]["gather_calls"]["all_gather"] > 0
        assert max_diff(params_of(bc[rank]["state"]), params_of(ag[rank]["state"])) == 0.0, rank


@pytest.mark.parametrize("via", ["reduce_scatter", "all_reduce"])
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("stage,policy", NATIVE, ids=[f"zero{s}-{p}" for s, p in NATIVE])
def test_parity_every_reduce_scatter_path(worlds, world, stage, policy, via):
    """The backend's reduce-scatter (``reduce_scatter_via="reduce_scatter"``, NCCL's default) and the all-reduce form
    against one process, as the default path (gloo: all-to-all and sum) is by every other parity test; at world 2
    every path adds the same two numbers, so their weights are bit-identical."""
    acc = 3
    other = worlds(world).run(fit_zero, stage, policy, acc, strategy_kwargs={"comm": {"reduce_scatter": via}})
    ref_state, _ = reference(acc, world)
    for rank, res in enumerate(other):
        assert res["reduce_ops"] == {via}, res["reduce_ops"]
        diff = max_diff(params_of(res["state"]), params_of(ref_state))
        assert diff <= TOL, f"rank {rank}: max abs diff {diff:.3e} > {TOL}"
    if world == 2:
        auto = worlds(world).run(fit_zero, stage, policy, acc)
        assert auto[0]["reduce_ops"] == {"all_to_all"}, auto[0]["reduce_ops"]
        assert max_diff(params_of(auto[0]["state"]), params_of(other[0]["state"])) == 0.0


@pytest.mark.parametrize("via", VIAS)
@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("stage,policy", CASES, ids=[f"zero{s}-{p}" for s, p in CASES])
def test_collective_counts_per_micro_batch(worlds, stage, policy, rank, via):
    """On every rank (default knobs: the used-mask all-reduce is part of every step)."""
    acc = 3
    res = counted_run(worlds, stage, policy, acc, via)[rank]
    n_buckets = len(res["buckets"])
    assert n_buckets > 2, "the test wants several buckets"
    reduce_op = grad_op(stage, via)
    for i, entries in enumerate(res["per_batch"]):
        ops = Counter(op for op, tag, _ in entries if tag.startswith("grad_bucket"))
        gathers = Counter(op for op, tag, _ in entries if tag.startswith("param_bucket"))
        boundary = (i + 1) % acc == 0
        if boundary:
            assert ops == {reduce_op: n_buckets}, (i, entries)
            assert gathers == ({} if stage == 0 else {"all_gather": n_buckets}), (i, entries)
            others = Counter(tag for _, tag, _ in entries if not tag.startswith(("grad_", "param_")))
            buffer_dtypes = len({b.dtype for b in ZooModule().buffers()})  # one coalesced broadcast per dtype
            assert others == {"used_mask": 1, "buffers": buffer_dtypes}, others  # find_unused mask + BatchNorm
        elif policy == "per_micro_batch":
            assert [op for op, _, _ in entries] == [reduce_op] * n_buckets, (i, entries)
        else:
            assert entries == [], f"micro-batch {i} is not a boundary but communicated {entries}"


@pytest.mark.parametrize("stage", [1, 2])
def test_post_step_gather_runs_on_a_group_of_its_own(worlds, stage):
    """zero1/zero2's post-step all-gather, left running until the next forward needs it, is on a copy of the world
    group: Lightning broadcasts a SIGTERM flag on the world group before every batch, which would otherwise wait for
    the whole gather (measured by the speed benchmark). The gradients stay on the world group."""
    for res in counted_run(worlds, stage, "defer", 3):
        groups = Counter((tag.split("_bucket")[0], group) for entries in res["per_batch_groups"]
                         for _, tag, group, _ in entries if tag.startswith(("grad_bucket", "param_bucket")))
        n = len(res["buckets"]) * STEPS
        assert groups == {("grad", "world"): n, ("param", "gather"): n}, groups


LEDGER_CASES = [(0, "auto")] + [(s, v) for s in (1, 2) for v in VIAS]  # zero0 has no reduce-scatter


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("stage,via", LEDGER_CASES, ids=[f"zero{s}-{v}" for s, v in LEDGER_CASES])
def test_ledger_bytes_equal_formula(worlds, world, stage, via):
    """One bucket for the optimizer's two param groups (a bucket larger than the model): bytes per step = (N-1)/N x
    padded fp32 bytes (x2 for all-reduce), with padding = ceil(numel/N)*N - numel. ``reduce_scatter_via=
    "reduce_scatter"`` and the default on gloo (all-to-all and sum): the ZeRO formula (2(N-1)/N, DDP's bytes);
    ``"all_reduce"``: 3(N-1)/N, recorded as such."""
    res = worlds(world).run(fit_zero, stage, "defer", 1, bucket_mb=100.0,
                            strategy_kwargs={"comm": {"reduce_scatter": via}})[0]
    module = ZooModule()
    groups = module.configure_optimizers().param_groups
    assert len(groups) == 2
    numels = [sum(p.numel() for g in groups for p in g["params"] if p.requires_grad)]
    assert [(n, oi) for n, _, oi in res["buckets"]] == [(numels[0], 0)]
    n = world
    padded = [-(-x // n) * n for x in numels] if stage else numels
    grad_bytes = sum(padded) * 4
    entries = res["per_batch"][-1]
    wire = Counter()
    for op, tag, b in entries:
        if tag.startswith(("grad_bucket", "param_bucket")):
            wire[op] += b
    if stage == 0:
        assert wire == {"all_reduce": 2 * (n - 1) / n * grad_bytes}
    elif via == "all_reduce":  # the reduce-scatter is an all-reduce of the whole bucket
        expected = (n - 1) / n * grad_bytes
        assert wire == {"all_reduce": 2 * expected, "all_gather": expected}
    else:
        expected = (n - 1) / n * grad_bytes
        assert wire == {grad_op(stage, via): expected, "all_gather": expected}
        # ZeRO-1/2 move 2(N-1)/N x grad bytes per step, like DDP's all-reduce, not ZeroRedundancyOptimizer's ~3x
        assert sum(wire.values()) == pytest.approx(2 * (n - 1) / n * grad_bytes)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("world", [2, 4])
def test_adam_state_is_one_nth(worlds, world, stage):
    """Adam, with the zoo's parameter unused on odd steps (its own step count, as in one process)."""
    policy = "keep_unsharded_grads" if stage == 3 else "defer"
    results = worlds(world).run(fit_zero, stage, policy, 1, optimizer="adam", bucket_mb=100.0)
    total = sum(p.numel() for p in ZooModule().parameters() if p.requires_grad)
    per_rank = [r["exp_avg_numel"] for r in results]
    if stage == 0:
        assert per_rank == [total] * world  # replicated
    else:
        assert sum(per_rank) == total  # every real element exactly once, no padding in optimizer state
    n_groups = 2
    for r in results:
        if stage:
            assert r["exp_avg_numel"] <= -(-total // world) + n_groups  # 1/N (+ at most one element per bucket)
        # exp_avg + exp_avg_sq fp32, plus one 4-byte step counter per optimizer tensor (a parameter's piece)
        assert r["memory"]["optimizer_state"] == 2 * 4 * r["exp_avg_numel"] + 4 * r["optimizer_tensors"]
    ref_state, _ = reference(1, world, optimizer="adam")
    for r in results:
        # Adam (lr 0.01, eps=1e-6) multiplies rounding in near-zero gradients by up to lr/eps = 1e4, but with one
        # micro-batch per rank only the association of the ranks' fp32 sum differs from one process: measured
        # <= 3.9e-7 at world 2 and 4 (0 .. 1.9e-7 against a one-thread reference), so the fp32 bound holds (25x)
        assert max_diff(params_of(r["state"]), params_of(ref_state)) <= TOL


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_optimizer_chunks_change_nothing(worlds, tmp_path, stage):
    """The optimizer stepping the shard in 26-element views gives the same result, resumes exactly, and the
    unused-parameter protection works across chunk boundaries."""
    kw = dict(strategy_kwargs={"tuning": {"optim_chunk_mb": 0.0001}}, optimizer="adam", data_steps=3)
    straight = worlds(2).run(fit_zero, stage, "defer" if stage < 3 else "keep_unsharded_grads", 3, steps=6,
                             ckpt_dir=str(tmp_path), **kw)
    assert straight[0]["optimizer_tensors"] > sum(straight[0]["bucket_trainable"])  # really chunked
    plain = worlds(2).run(fit_zero, stage, "defer" if stage < 3 else "keep_unsharded_grads", 3, steps=6,
                          optimizer="adam", data_steps=3)
    resumed = worlds(2).run(fit_zero, stage, "defer" if stage < 3 else "keep_unsharded_grads", 3, steps=6,
                            resume_from=str(tmp_path / "epoch=0-step=3.ckpt"), **kw)
    for a, b, c in zip(straight, plain, resumed):
        assert c["first"] == (3, 1, 0) and c["steps_taken"] == 3, (c["first"], c["steps_taken"])  # really resumed
        assert max_diff(params_of(a["state"]), params_of(b["state"])) <= 1e-6
        assert max_diff(params_of(a["state"]), params_of(c["state"])) == 0.0


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_clipping_norm_is_global(worlds, stage):
    clip = 0.3
    results = worlds(2).run(fit_zero, stage, "defer", 3, clip=clip)
    ref_state, ref_norms = reference(3, 2, clip=clip)
    assert len(ref_norms) == STEPS and max(ref_norms) > clip, "clipping must really act in this test"
    for r in results:
        assert r["norms"] == pytest.approx(ref_norms, rel=1e-5, abs=1e-6)
        assert max_diff(params_of(r["state"]), params_of(ref_state)) <= TOL


@pytest.mark.parametrize("stage", [1, 2])
def test_clipping_by_value_matches(worlds, stage):
    """Clipping by value is element-wise: on shards it equals clipping the full gradients."""
    results = worlds(2).run(fit_zero, stage, "defer", 3, clip=0.01, strategy_kwargs=None, clip_algorithm="value")
    ref_state, _ = reference(3, 2, clip=0.01, clip_algorithm="value")
    for r in results:
        assert max_diff(params_of(r["state"]), params_of(ref_state)) <= TOL


# The strategies run the reference's very bf16 ops on the same fp32 weights (SGD: no amplification); only the fp32
# association of the micro-batch and rank sums differs, which flips a bf16 rounding rarely: measured <= 1.2e-7 (zero0-3,
# two fp32 ulps at |w| ~ 1). Bound: the fp32 parity bound TOL (80x that), 1/1000 of the bf16-vs-fp32 gap (1.07e-2).
BF16_TOL = TOL


@pytest.mark.parametrize("stage,policy", [(0, "defer"), (1, "defer"), (2, "per_micro_batch"), (3, "per_micro_batch")])
def test_bf16_mixed_close_to_reference(worlds, stage, policy):
    """bf16 autocast, against one process under the same autocast. The bound sits far below the gap between a
    bf16-mixed and an fp32 run, so a strategy that dropped autocast (computing in fp32) would fail here."""
    ref_state, _ = reference(3, 2, precision="bf16-mixed")
    fp32_state, _ = reference(3, 2)
    gap = max_diff(params_of(ref_state), params_of(fp32_state))
    assert gap > 1000 * BF16_TOL, gap  # the test can tell bf16 from fp32
    results = worlds(2).run(fit_zero, stage, policy, 3, precision="bf16-mixed")
    for r in results:
        assert max_diff(params_of(r["state"]), params_of(ref_state)) <= BF16_TOL


def test_manual_optimization_toggle_model(worlds):
    acc = 3
    results = worlds(2).run(fit_zero, 2, "defer", acc, manual=True)
    ref_state, _ = reference(acc, 2)
    for r in results:
        assert max_diff(params_of(r["state"]), params_of(ref_state)) <= TOL
        for i, entries in enumerate(r["per_batch"]):
            if (i + 1) % acc:
                assert entries == [], f"manual micro-batch {i} communicated {entries}"


@pytest.mark.parametrize("kind", ["full", "sharded"])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_checkpoint_resume_is_exact(worlds, tmp_path, stage, kind):
    """ModelCheckpoint at the end of epoch 1 of 2; resuming from it ends bitwise equal to the uninterrupted
    run. One epoch = 3 optimizer steps of 3 micro-batches. Both formats hold torch's plain optimizer state. The data
    is the same every epoch, so a run started again from scratch would end equal too: the resumed run must start at
    step 3 (epoch 1, batch 0) and run 3 steps, and end away from a run of those 3 steps from scratch."""
    world, acc = 2, 3
    kw = dict(optimizer="adam", data_steps=3, strategy_kwargs={"state_dict_type": kind})
    straight = worlds(world).run(fit_zero, stage, "defer", acc, steps=6, ckpt_dir=str(tmp_path), **kw)
    ckpt = str(tmp_path / "epoch=0-step=3.ckpt")
    if kind == "full":
        saved = torch.load(ckpt, weights_only=False)
    else:
        from lightning_shard.checkpoint.consolidate import lightning_checkpoint
        from lightning_shard.checkpoint.format import Reader

        assert (tmp_path / "epoch=0-step=3.ckpt" / "meta.json").is_file()
        saved = lightning_checkpoint(Reader(ckpt))
    plain = ZooModule("adam").configure_optimizers()
    plain.load_state_dict(saved["optimizer_states"][0])
    assert len(plain.state) == sum(1 for p in ZooModule().parameters() if p.requires_grad)
    resumed = worlds(world).run(fit_zero, stage, "defer", acc, steps=6, resume_from=ckpt, **kw)
    fresh, _ = reference(acc, world, optimizer="adam", steps=3)  # the 3 remaining steps, from scratch
    for a, b in zip(straight, resumed):
        assert b["first"] == (3, 1, 0) and b["steps_taken"] == 3, (b["first"], b["steps_taken"])  # really resumed
        assert max_diff(params_of(a["state"]), params_of(b["state"])) == 0.0
        assert max_diff(params_of(b["state"]), params_of(fresh)) > 1e-2  # the checkpoint's weights carried over


def test_auto_policy_is_logged_and_resolved(worlds):
    res = worlds(2).run(fit_zero, 2, "auto", 3)[0]
    assert res["policy"] in ("defer", "per_micro_batch")


@pytest.mark.parametrize("precision", ["bf16-true", "16-true"])
def test_half_true_resume_keeps_fp32_masters(worlds, tmp_path, precision):
    """bf16-true/16-true keep fp32 masters; the checkpoint stores them (fp32), so resuming is exact too: at step 3,
    3 steps run, and away from the weights 3 steps from scratch reach (the checkpoint's own: the data is the same
    every epoch)."""
    kw = dict(optimizer="sgd", data_steps=3, precision=precision, bn=False, strategy_kwargs={"state_dict_type": "full"})
    straight = worlds(2).run(fit_zero, 2, "per_micro_batch", 3, steps=6, ckpt_dir=str(tmp_path), **kw)
    ckpt = str(tmp_path / "epoch=0-step=3.ckpt")
    saved = torch.load(ckpt, weights_only=False)
    assert saved["state_dict"]["net.lin1.weight"].dtype == torch.float32
    if precision == "16-true":
        assert saved["ShardedPrecision"]["loss_scaler"]["scale"] > 0
    resumed = worlds(2).run(fit_zero, 2, "per_micro_batch", 3, steps=6, resume_from=ckpt, **kw)
    fresh = {k: v for k, v in saved["state_dict"].items() if k in straight[0]["state"]}
    for a, b in zip(straight, resumed):
        assert a["param_dtype"] == (torch.bfloat16 if precision == "bf16-true" else torch.float16)
        assert a["state"]["net.lin1.weight"].dtype == torch.float32  # full_state_dict() gives the fp32 masters
        assert b["first"] == (3, 1, 0) and b["steps_taken"] == 3, (b["first"], b["steps_taken"])  # really resumed
        assert max_diff(params_of(a["state"]), params_of(b["state"])) == 0.0
        assert max_diff(params_of(b["state"]), params_of(fresh)) > 1e-2  # the checkpoint's weights carried over
        assert a["memory"]["master"] > 0
