"""Lightning's training patterns under every strategy, against Lightning's own ``ddp`` on the same ranks and data
(issue 43): a GAN in manual optimization with two optimizers and its variants (toggle_optimizer, a detached fake,
two losses before one step, retain_graph, accumulation by hand with and without ``toggle_model(sync_grad=...)``,
clipping by hand), an accumulation that changes (``GradientAccumulationScheduler``) and a last window cut short by
the end of an epoch. Every knob at its default; weights compared as a user saves them (rank 0's
``model.state_dict()`` after ``fit``); collectives counted by the ledger and, independently, at torch.distributed.

Bound: 1e-5 (fp32). On 2 ranks our averaged gradient is DDP's bit for bit ((a + b) / 2 = a / 2 + b / 2 in binary
floating point), so most patterns match exactly; where a gradient is reduced twice before a step (two backwards) we
add the second average to the first (c + (a + b) / 2) where DDP reduces (c + a) / 2 + (c + b) / 2: one rounding
apart per element, which Adam's division by sqrt(v) can lift to ~2e-7 over the 12 steps (measured 1.6e-7).
"""

from __future__ import annotations

import pytest

from tests.patterns import AUTO_VARIANTS, GAN_VARIANTS, SHAPE, SHORT_WINDOW_ACC, fit_pattern
from tests.zoo import max_diff

TOL = 1e-5
STRATEGIES = ["zero1", "zero2", "zero3", "fsdp_shard"]
PATTERNS = list(GAN_VARIANTS + AUTO_VARIANTS)
_PEER: dict = {}


def ddp(world, pattern: str) -> dict:
    key = (world.size, pattern)
    if key not in _PEER:
        _PEER[key] = world.run(fit_pattern, "ddp", pattern)[0]
    return _PEER[key]


def assert_parity(ours: dict, peer: dict) -> None:
    assert ours["global_step"] == peer["global_step"]
    assert max_diff(ours["state"], peer["state"]) <= TOL


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_pattern_gives_ddp_weights(worlds, strategy, pattern):
    assert_parity(worlds(2).run(fit_pattern, strategy, pattern)[0], ddp(worlds(2), pattern))


@pytest.mark.slow
@pytest.mark.parametrize("pattern", PATTERNS)
def test_pattern_gives_ddp_weights_hybrid(worlds, pattern):
    """zero3 sharded inside 2 islands of 2 ranks, replicated across (4 ranks, the cpu_2x2 preset)."""
    assert_parity(worlds(4).run(fit_pattern, "zero3_hybrid", pattern)[0], ddp(worlds(4), pattern))


@pytest.mark.parametrize("strategy", ["ddp"] + STRATEGIES)
def test_backward_through_a_graph_from_before_the_step_is_refused_as_under_ddp(worlds, strategy):
    """``manual_backward(loss, retain_graph=True)``, ``opt.step()``, then ``manual_backward(loss)`` again: the
    gradient would be taken through weights the step changed. torch refuses it under DDP (the parameters were updated
    in place); our optimizer steps shard views autograd cannot see, so the engine marks the stepped parameters as
    modified: the same refusal at the first step, with what it means and the way out."""
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as err:
        worlds(2).run(fit_pattern, strategy, "stale_graph")
    if strategy != "ddp":
        assert "graph built before an optimizer step" in str(err.value)
        assert "Run the forward again after opt.step()" in str(err.value)


def grad_reductions(batch: dict) -> int:
    return batch["grad"]["grad"]


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
@pytest.mark.parametrize("pattern", ["gan", "toggle"])
def test_gan_collectives_counted_independently_equal_the_ledger(worlds, strategy, pattern):
    """Every batch of the GAN (two backwards and two optimizer steps): what reached torch.distributed equals the
    ledger, on both ranks, and each backward reduces every bucket it may give gradients to once: all of them in
    ``gan`` (both backwards reach both networks: DDP all-reduces everything twice too), only the toggled optimizer's
    under ``toggle_optimizer`` (the other's parameters are switched off for that backward)."""
    results = worlds(2).run(fit_pattern, strategy, pattern, count=True)
    for res in results:
        assert len(res["batches"]) == 12
        buckets = res["trainable_buckets"]
        assert buckets >= 2  # one per optimizer at least (zero3: the units' too)
        for b in res["batches"]:
            assert b["ours"] == b["ledger"], (b["ours"], b["ledger"])
            assert grad_reductions(b) == (2 * buckets if pattern == "gan" else buckets)
            if strategy == "zero2":  # one post-step gather of each optimizer's bucket
                assert b["grad"]["param"] == 2
    assert [b["ledger"] for b in results[0]["batches"]] == [b["ledger"] for b in results[1]["batches"]]


def window_ends(pattern: str) -> list[bool]:
    """Per micro-batch of the fit: whether it ends an accumulation window (Lightning steps there)."""
    epochs, batches = SHAPE[pattern]
    ends = []
    for epoch in range(epochs):
        acc = (1 if epoch < 2 else 4) if pattern == "grad_acc_scheduler" else SHORT_WINDOW_ACC
        ends += [(i + 1) % acc == 0 or i + 1 == batches for i in range(batches)]
    return ends


def assert_reductions_follow_windows(res: dict, pattern: str, every_micro_batch: bool) -> None:
    buckets = res["trainable_buckets"]
    ends = window_ends(pattern)
    assert len(res["batches"]) == len(ends)
    for i, (b, end) in enumerate(zip(res["batches"], ends)):
        assert b["ours"] == b["ledger"], (i, b["ours"], b["ledger"])
        want = buckets if end or every_micro_batch else 0
        assert grad_reductions(b) == want, (i, end, dict(b["grad"]))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_accumulation_scheduler_communicates_as_a_run_started_with_each_window(worlds, strategy):
    """``GradientAccumulationScheduler({0: 1, 2: 4})``: at accumulation 1 zero3/fsdp_shard's ``auto`` policy is
    per_micro_batch; from epoch 2 on, with 4, a run started there takes keep_unsharded_grads (as the short-window run
    below does, which starts with 4): no reduction on the 3 micro-batches of a window that do not end it. The
    change is logged."""
    res = worlds(2).run(fit_pattern, strategy, "grad_acc_scheduler", count=True)[0]
    started_with_4 = worlds(2).run(fit_pattern, strategy, "short_last_window")[0]
    assert res["policy"] == started_with_4["policy"] in ("defer", "keep_unsharded_grads")
    assert_reductions_follow_windows(res, "grad_acc_scheduler", every_micro_batch=False)
    changed = [line for line in res["log"] if "accumulate_grad_batches 1 -> 4 at epoch 2" in line]
    if strategy in ("zero3", "fsdp_shard"):
        assert len(changed) == 1 and "accumulation=keep_unsharded_grads" in changed[0], res["log"]
    else:  # defer at 1 and at 4: nothing changes, nothing logged
        assert changed == [], res["log"]


POLICIES = [("zero1", "defer"), ("zero2", "defer"), ("zero2", "per_micro_batch"), ("zero3", "keep_unsharded_grads"),
            ("zero3", "per_micro_batch"), ("zero3", "keep_params"), ("fsdp_shard", "keep_unsharded_grads"),
            ("fsdp_shard", "per_micro_batch"), ("fsdp_shard", "keep_params")]


@pytest.mark.parametrize("strategy,policy", POLICIES, ids=[f"{s}-{p}" for s, p in POLICIES])
def test_short_last_window_steps_and_reduces_at_the_epoch_end(worlds, strategy, policy):
    """6 micro-batches per epoch with ``accumulate_grad_batches=4``: windows of 4 and 2. The short window ends at
    the epoch's last micro-batch, which reduces (Lightning steps there); the result is DDP's."""
    res = worlds(2).run(fit_pattern, strategy, "short_last_window", count=True,
                        knobs={"accumulation": policy})[0]
    assert_parity(res, ddp(worlds(2), "short_last_window"))
    assert res["global_step"] == 4
    assert_reductions_follow_windows(res, "short_last_window", every_micro_batch=policy == "per_micro_batch")
