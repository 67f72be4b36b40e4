"""The ledger sees every collective the strategies issue (issue 11): counted independently by wrapping
torch.distributed's own functions (tests/c10d_counter.py), per micro-batch and over a whole fit, on every rank.

Lightning itself calls torch.distributed once per training batch, outside any strategy method: the SIGTERM
broadcast of ``training_epoch_loop._broadcast_sigterm_tensor`` (before ``on_train_batch_start``). It is the only
call not made through ``lightning_shard.engine.comm.collectives`` (README, "Collectives Lightning makes itself").
"""

from __future__ import annotations

import pytest

from tests.counter_scenarios import counted_fit

LIGHTNING_SIGTERM = ("broadcast", "lightning.pytorch.loops.training_epoch_loop")


@pytest.mark.parametrize("strategy", ["zero0", "zero1", "zero2", "zero3", "fsdp_shard"])
def test_ledger_equals_independent_count_per_micro_batch_on_every_rank(worlds, strategy):
    acc = 3
    results = worlds(2).run(counted_fit, strategy, acc)
    for rank, res in enumerate(results):
        assert len(res["windows"]) == 4 * acc
        for i, w in enumerate(res["windows"]):
            assert w["others"] == [], (rank, i, w["others"])  # nothing else calls torch.distributed in a batch
            assert w["ours"] == w["ledger"], (rank, i, w["ours"], w["ledger"])
            assert w["ours"]["all_reduce"] >= 1  # the sync_dist metric, at least
        assert res["total_ours"] == res["total_ledger"], (rank, res["total_ours"], res["total_ledger"])
        # every call from lightning_shard went through engine/comm/collectives.py; Lightning's own: one per batch
        assert not any(who.startswith("lightning_shard") for _, who in res["others"]), res["others"]
        assert res["others"] == {LIGHTNING_SIGTERM: 4 * acc}, res["others"]
    # the same collectives on every rank, micro-batch by micro-batch
    assert [w["ledger"] for w in results[0]["windows"]] == [w["ledger"] for w in results[1]["windows"]]
