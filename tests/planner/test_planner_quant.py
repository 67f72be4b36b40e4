"""The planner and compressed communication (issue 14): bytes per collective from the quantized layout, the
residual and island copies in memory, the choice ``strategy=auto`` makes (only for a stated margin), and rows that
the real strategy classes accept."""

from __future__ import annotations

import functools

import pytest

from lightning_shard.engine.comm.quant import piece_bytes
from lightning_shard.planner.config import Job, StrategyConfig
from lightning_shard.planner.memory import peak_bytes
from lightning_shard.planner.models import from_recipe
from lightning_shard.planner.recommend import QUANT_MARGIN, plan, quantized_variant
from lightning_shard.planner.traffic import step_collectives


@functools.lru_cache(maxsize=None)
def _gpt(name: str = "gpt_7b"):
    return from_recipe(name)


def _rows(preset: str, *configs: StrategyConfig):
    return plan(_gpt(), preset, None, 64, 1, "bf16-true", configs=list(configs), require_fit=False)


def _layout(cfg: StrategyConfig, world: int = 8):
    from lightning_shard.planner.layout import plan_layout

    return plan_layout(_gpt("gpt_1b"), None, cfg.stage, world, cfg.bucket_mb, cfg.granularity, "auto",
                       param_dtype=Job(world, precision="bf16-true").param_dtype)


@pytest.mark.parametrize("gq,rq", [("int8", "none"), ("none", "int8"), ("none", "int4"), ("int8", "int4")])
def test_quantized_collectives_carry_the_formula_bytes(gq, rq):
    cfg = StrategyConfig("fsdp_shard", 3, gather_quant=gq, reduce_quant=rq, quant_block=128)
    layout, job = _layout(cfg), Job(world=8, accumulation=2, precision="bf16-true")
    plain = {(c.kind, c.bucket, c.micro_batch, c.phase): c for c in step_collectives(
        layout, cfg.with_(gather_quant="none", reduce_quant="none"), job, [])}
    for c in step_collectives(layout, cfg, job, []):
        b = layout.buckets[[x.index for x in layout.buckets].index(c.bucket)] if c.bucket >= 0 else None
        ref = plain[(c.kind, c.bucket, c.micro_batch, c.phase)]
        if c.kind == "unshard":
            want = 8 * piece_bytes(gq, 128, b.shard_numel) if gq != "none" else ref.bytes
            assert (c.op, c.bytes) == ("all_gather", want)
        elif c.kind == "grad":
            assert c.op == ("all_to_all" if rq != "none" else ref.op)
            assert c.bytes == (8 * piece_bytes(rq, 128, b.shard_numel) if rq != "none" else ref.bytes)
    # int8 gathers of bf16 parameters: about half the bytes (plus one fp32 scale per 128 elements)
    if gq == "int8":
        q = sum(c.bytes for c in step_collectives(layout, cfg, job, []) if c.kind == "unshard")
        p = sum(c.bytes for c in plain.values() if c.kind == "unshard")
        assert q / p == pytest.approx(0.5 + 2 / 128, rel=1e-3)


def test_error_feedback_and_island_copies_are_in_the_peak():
    base = StrategyConfig("zero3", 3)
    layout, job = _layout(base), Job(world=8, precision="bf16-true")
    p0 = peak_bytes(layout, base, job, 0)["persistent"]
    fb = peak_bytes(layout, base.with_(reduce_quant="int8"), job, 0)["persistent"]
    nofb = peak_bytes(layout, base.with_(reduce_quant="int8", quant_error_feedback=False), job, 0)["persistent"]
    hpz = peak_bytes(layout, base.with_(secondary_shard=4), job, 0)["persistent"]
    assert fb - p0 == sum(b.padded_numel * 4 for b in layout.trainable)  # fp32 residual per trainable element
    assert nofb == p0
    assert hpz - p0 == sum(b.padded_numel // 4 * b.itemsize for b in layout.buckets)  # 1/I of every unit


def test_auto_takes_compressed_communication_only_past_the_margin():
    # two H100 nodes over InfiniBand, fsdp_shard over all 16 ranks: hpZ keeps the backward gathers in the node
    slow = _rows("hgx_h100_2nodes_ib", StrategyConfig("fsdp_shard", 3))
    pick = quantized_variant(slow.context, slow.best)
    assert pick is not None and pick.time.total <= (1 - QUANT_MARGIN) * slow.best.time.total
    assert pick.config.secondary_shard == 8 or pick.config.gather_quant == "int8"
    # one NVSwitch node: quantizing costs more time than the bytes it saves
    fast = _rows("hgx_h100_8", StrategyConfig("zero3", 3))
    assert quantized_variant(fast.context, fast.best) is None
    # what strategy=auto does with the rows it chose itself: the reason says so when it takes one
    res = plan(_gpt(), "hgx_h100_8", None, 64, 1, "bf16-true")
    assert "compressed" not in res.reason and res.best.config.gather_quant == "none"


@pytest.mark.parametrize("cfg", [
    StrategyConfig("zero3", 3, gather_quant="int8", reduce_quant="int4", quant_block=64),
    StrategyConfig("fsdp_shard", 3, secondary_shard=8, gather_quant="int8"),
    StrategyConfig("zero2", 2, reduce_quant="int8", quant_error_feedback=False),
])
def test_rows_with_compression_build_the_registered_strategy(cfg):
    from lightning.pytorch.strategies import StrategyRegistry

    entry = StrategyRegistry[cfg.registered]
    kwargs = cfg.kwargs()
    strategy = entry["strategy"](**dict(entry["init_params"], **kwargs))
    assert strategy.options.changed() == kwargs  # every option the row sets reached the strategy, nothing else
    c = strategy.options.compression
    assert (c.gather_quant, c.reduce_quant, c.block, c.error_feedback) == (
        cfg.gather_quant, cfg.reduce_quant, cfg.quant_block, cfg.quant_error_feedback)
    assert getattr(strategy.options, "secondary_shard", None) == cfg.secondary_shard


def test_planner_refuses_what_the_strategies_refuse():
    with pytest.raises(ValueError, match="only stage 3 has"):
        StrategyConfig("zero2", 2, gather_quant="int8")
    with pytest.raises(ValueError, match="secondary_shard"):
        StrategyConfig("zero3", 3, secondary_shard=2, shard_size=4)
