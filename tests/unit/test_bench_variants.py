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
