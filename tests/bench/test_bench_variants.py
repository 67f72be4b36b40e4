"""The bench's A/A controls (bench/variants.py ``AA_CONTROLS``): ``ddp_aa`` and ``fsdp2_aa`` run their peer's
program under another name, so that a speed table's paired ratio of the control to the peer is the run's noise."""

import argparse
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def variants():
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import variants as mod

        yield mod
    finally:
        sys.path.remove(str(REPO / "bench"))


def _args(**kw):
    base = dict(suite="speed", model="gpt", n_layer=1, n_head=2, n_embd=32, vocab=64, block_size=8, devices=2,
                bucket_mb=25.0, seed=0)
    base.update(kw)
    return argparse.Namespace(**base)


def test_aa_controls_run_their_peers_program(variants):
    from lightning.pytorch.strategies import DDPStrategy

    assert variants.program_of("ddp_aa") == "ddp" and variants.program_of("fsdp2_aa") == "fsdp2"
    assert variants.program_of("zero2") == "zero2" and variants.program_of("fsdp_shard") == "fsdp_shard"
    for v in variants.AA_CONTROLS:
        assert v in variants.OPT_IN["speed"] and v not in variants.SUITES["speed"]  # opt-in: the default table stays
        assert v in variants.NOTES and v not in variants.OURS
    args = _args()
    ddp, again = variants.make_strategy(args, "ddp"), variants.make_strategy(args, "ddp_aa")
    assert type(ddp) is type(again) is DDPStrategy
    assert again._process_group_backend == ddp._process_group_backend == "gloo"
    fsdp2, fsdp2_aa = variants.make_strategy(args, "fsdp2"), variants.make_strategy(args, "fsdp2_aa")
    assert type(fsdp2) is type(fsdp2_aa)
    # the module too: FSDP2's needs configure_model (fully_shard per block), DDP's must not have it
    assert type(variants.make_module(args, "fsdp2_aa")).__name__ == type(variants.make_module(args, "fsdp2")).__name__
    assert type(variants.make_module(args, "ddp_aa")).__name__ == type(variants.make_module(args, "ddp")).__name__
    assert type(variants.make_module(args, "fsdp2")).__name__ != type(variants.make_module(args, "ddp")).__name__


def _ours(variants) -> list[tuple[str, str]]:
    return [(suite, v) for suite in variants.SUITES for v in variants.suite_variants(suite) if v in variants.OURS]


def _contains(changed: dict, wanted: dict) -> bool:
    return all(_contains(changed.get(k, {}), v) if isinstance(v, dict) else changed.get(k) == v
               for k, v in wanted.items())


def test_every_variant_of_ours_builds_its_strategy_with_its_options(variants):
    """Every lightning_shard variant of every suite builds (groups as mappings: ``tuning``, ``compression``), with
    the options of its suffix and, for zero0/1/2, the suite's ``tuning.bucket_mb``; nothing else but fsdp_shard's
    wrap class changed."""
    built = 0
    for suite, v in _ours(variants):
        args = _args(suite=suite, bucket_mb=7.0)
        strategy = variants.make_strategy(args, v)
        changed = strategy.options.changed()
        base, suffix = variants.split_variant(v)
        suffix.pop("comm", None)  # not an option: the engine's choice, set on the strategy (below)
        assert _contains(changed, suffix), (suite, v, changed, suffix)
        if strategy.options.stage < 3:
            assert changed["tuning"]["bucket_mb"] == 7.0, (suite, v)
            suffix = {**suffix, "tuning": {**suffix.get("tuning", {}), "bucket_mb": 7.0}}
        changed.pop("wrap_classes", None)  # fsdp_shard's units: the model's block class
        assert changed == suffix, (suite, v, changed, suffix)  # the suites run every strategy with default options
        built += 1
    assert built >= 40


def test_the_variants_of_the_comm_choices_set_the_engines_choice(variants):
    """``_rs``, ``_ar``, ``_agc``, ``_nohuge``: how collectives run is the engine's per-backend choice, not an option;
    the bench sets it on the strategy (``strategy.comm``), which hands it to the engine."""
    wanted = {"_rs": ("reduce_scatter", "reduce_scatter"), "_ar": ("reduce_scatter", "all_reduce"),
              "_agc": ("all_gather", "all_gather"), "_nohuge": ("huge_pages", False)}
    seen = 0
    for suite, v in _ours(variants):
        for suffix, (field, value) in wanted.items():
            if v.endswith(suffix) and variants.split_variant(v)[1]:
                strategy = variants.make_strategy(_args(suite=suite), v)
                assert getattr(strategy.comm, field) == value, (suite, v)
                assert "comm" not in strategy.options.changed(), (suite, v)
                seen += 1
    assert seen >= 8
