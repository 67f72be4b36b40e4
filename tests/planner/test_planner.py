"""Planner unit tests (one process, no ranks): statistics, formulas, recommendation, CLI and bad input."""

from __future__ import annotations

import json
import re

import pytest
import torch

from lightning_shard.cli import main
from lightning_shard.planner import auto_policy, batch_split, plan, recommend_for
from lightning_shard.planner.memory import zero_paper_bytes
from lightning_shard.planner.models import from_recipe, from_shape
from lightning_shard.planner.stats import model_stats, unit_sizes
from tests.zoo import TinyLMModule, ZooModule


def test_stats_count_tied_once_and_split_frozen():
    st = model_stats(ZooModule())
    net = ZooModule().net
    assert st.params == sum(p.numel() for p in net.parameters())  # emb = head counted once
    assert st.frozen == 42 and st.trainable == st.params - 42
    units = unit_sizes(TinyLMModule().model, "fsdp", ["Block"])
    assert [u[0] for u in units] == ["<root>", "blocks.0", "blocks.1"]
    assert sum(u[1] for u in units) == st.params - st.params + sum(p.numel() for p in TinyLMModule().parameters())


def test_zero_paper_formulas():
    psi, n = 1e9, 8  # Rajbhandari et al. 2020, mixed-precision Adam: 16, 4 + 12/N, 2 + 14/N, 16/N bytes
    assert zero_paper_bytes(psi, n, 0) == 16 * psi
    assert zero_paper_bytes(psi, n, 1) == pytest.approx((4 + 12 / n) * psi)
    assert zero_paper_bytes(psi, n, 2) == pytest.approx((2 + 14 / n) * psi)
    assert zero_paper_bytes(psi, n, 3) == pytest.approx(16 / n * psi)
    assert zero_paper_bytes(psi, n, 0, "32-true", "sgd") == 12 * psi  # fp32 params, grads, momentum


def test_recommend_for_returns_a_registered_strategy():
    from lightning_shard.strategies import REGISTERED

    rec = recommend_for(from_recipe("gpt_1b"), None, "hgx_h100_8", 8, 64, 1, "bf16-true")
    assert rec.strategy_name in ("zero0", "zero1", "zero2", "zero3", "fsdp_shard")
    assert "fastest that fits" in rec.reason and rec.table
    cls = REGISTERED[rec.strategy_name][0]
    assert rec.kwargs["accumulation"] in cls.OPTIONS.choices("accumulation")  # the class's own policy names
    # (tests/planner/test_planner_advice.py)


def test_hybrid_recommended_on_nvl_pairs():
    res = plan(from_recipe("gpt_1b"), "h100_nvl_8", None, 64, 1)
    assert res.best.config.shard_size == 2 and res.best.rings["replicate"].link_class == "inter-island"


def test_auto_policy():
    assert auto_policy(1, 4, 1e9)[0] == "defer"
    assert auto_policy(3, 1, 1e9)[0] == "per_micro_batch"
    assert auto_policy(2, 4, 1e9, free_bytes=2e9)[0] == "per_micro_batch"  # memory pressure
    assert auto_policy(3, 4, 1e6, free_bytes=80e9, ring_gbps=450)[0] == "per_micro_batch"  # fast links
    policy, reason = auto_policy(3, 4, 1e6, free_bytes=80e9, ring_gbps=25.8)
    assert policy == "keep_unsharded_grads" and "4" in reason


def test_cli_plan_json_and_plot(tmp_path, capsys):
    png = tmp_path / "plan.png"
    assert main(["plan", "gpt_tiny", "--preset", "cpu_2x2", "--global-batch", "8", "--micro-batch", "2", "--json",
                 "--precision", "32-true", "--plot", str(png)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out[0]["topology"] == "cpu_2x2" and out[0]["accumulation"] == 1 and out[0]["recommended"]
    assert png.stat().st_size > 1000


def test_cli_plan_shape_args_table(capsys):
    assert main(["plan", "--params", "7e9", "--seq", "4096", "--preset", "hgx_h100_8"]) == 0
    out = capsys.readouterr().out
    assert "recommended:" in out and "zero0" in out and "fsdp_shard" in out


# ------------------------------------------------------------------------------------------------ bad input
def test_unknown_topology(capsys):
    with pytest.raises(ValueError, match="unknown topology 'dgx9'.*hgx_h100_8"):
        plan(from_recipe("gpt_tiny"), "dgx9", 8, 64, 1)
    assert main(["plan", "gpt_tiny", "--preset", "dgx9"]) == 2
    assert "unknown topology 'dgx9': not a preset" in capsys.readouterr().err


def test_batch_not_divisible():
    with pytest.raises(ValueError, match=r"global batch 48 is not divisible into micro-batches of 4 on 8 ranks: "
                                         r"48 % \(4 x 8\) = 16\. "
                                         r"Use a global batch of 32 or 64, or a micro-batch of 3"):
        batch_split(48, 4, 8)
    with pytest.raises(ValueError, match="multiple of the world size 8"):
        batch_split(12, 1, 8)


def test_model_that_fits_nowhere_says_what_would():
    with pytest.raises(ValueError) as err:
        plan(from_recipe("gpt_1b"), "dgx1_v100", 1, 8, 2, "32-true")  # one V100 32GB
    msg = str(err.value)
    assert "no strategy fits" in msg and "More devices: about" in msg and "about 2 ranks" in msg
    # offload, evaluated as a row of its own: fp32 zero0 moves its 8 bytes/parameter of AdamW state off the device
    # and holds master (4) + gradient shard (4) + that state (8) = 16 bytes per parameter in host memory
    psi = sum(p.numel() for p in from_recipe("gpt_1b").parameters())
    assert (f"CPU offload: zero0 with offload_optimizer=True keeps the fp32 masters, gradient shards and optimizer "
            f"state in host memory ({16 * psi / 2**30:.1f} GiB per rank of host RAM)") in msg
    low = re.search(r"the leanest, zero0 \(defer\), needs ([\d.]+) GiB", msg).group(1)
    after = re.search(r"and needs ([\d.]+) GiB per rank on the device: fits", msg).group(1)
    assert abs(float(low) - float(after) - 8 * psi / 2**30) < 0.15, (low, after)
    big = from_shape(params=70e9, seq=1024)
    with pytest.raises(ValueError, match="(?s)full gradient buffers.*Smaller micro-batch: activations take"):
        plan(big, "pcie_8", None, 64, 8)


def test_unknown_recipe_and_precision():
    with pytest.raises(ValueError, match="unknown recipe 'gpt_9b'.*--params"):
        from_recipe("gpt_9b")
    with pytest.raises(ValueError, match="precision 'fp8'"):
        plan(from_recipe("gpt_tiny"), "cpu", 2, 4, 1, precision="fp8")


def test_meta_model_needs_no_memory():
    m = from_recipe("gpt_7b")
    assert all(p.device.type == "meta" for p in m.parameters())
    assert 6e9 < sum(p.numel() for p in m.parameters()) < 7e9
    assert torch.empty(0).device.type == "cpu"
