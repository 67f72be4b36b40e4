"""torch.distributed.checkpoint (``state_dict_type="dcp"``): DCP's own consolidation reads our directories; they
resume under another of our strategies; torch FSDP2 (Lightning's ModelParallelStrategy) checkpoints resume under
ours and ours under FSDP2, weights and Adam state, equal to one uninterrupted process; so does a folder in the layout
of Lightning FSDPStrategy(state_dict_type="sharded")."""

from __future__ import annotations

import pytest
import torch

from tests import dcp_scenarios as ds
from tests import fabric_scenarios as fs
from tests import scenarios as sc
from tests.zoo import max_diff

WORLD, STEPS, ACC = 2, 3, 2
DCP = {"state_dict_type": "dcp"}
STEP3 = "epoch=0-step=3.ckpt"  # ModelCheckpoint's name for the checkpoint of step 3


@pytest.fixture(scope="module")
def world(worlds):
    return worlds(WORLD)


@pytest.fixture(scope="module")
def ref():
    """6 steps over an epoch of 3 (run twice): a checkpoint of step 3 is at the epoch's end, where a resumed
    Trainer starts the data again, as the uninterrupted run does."""
    return fs.reference("tiny_lm", 2 * STEPS, ACC, WORLD, epoch_steps=STEPS)[0]


@pytest.fixture(scope="module")
def fresh():
    """The 3 steps a resume from step 3 runs, from scratch: where a resume that restored nothing but the loop state
    would end (a resume that restored nothing at all would start at step 0 and end at ``ref``)."""
    return fs.reference("tiny_lm", STEPS, ACC, WORLD, epoch_steps=STEPS)[0]


def resumed_at_step3(out: dict, fresh: dict) -> None:
    """``out`` started at step 3 (the first batch of epoch 1, where the checkpoint of step 3 stands), ran the 3
    remaining steps, and ended away from where those 3 steps take the initial weights."""
    assert out["first"] == (STEPS, 1, 0) and out["steps_taken"] == STEPS, (out["first"], out["steps_taken"])
    assert max_diff(out["state"], fresh) > 1e-2


def fit_ours(stage: int, steps: int, **kw):
    return sc.fit_zero(stage, "auto", ACC, steps, optimizer="adam", model="tiny_lm", data_steps=STEPS, **kw)


def test_dcp_directory_consolidates_with_dcp_tools(world, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ckpt = tmp_path / "z2.ckpt"
    out = world.run(fit_ours, 2, STEPS, save_to=str(ckpt), strategy_kwargs=DCP)[0]
    assert (ckpt / ".metadata").is_file() and (ckpt / "meta.pt").is_file()
    dcp_to_torch_save(ckpt, tmp_path / "full.pt")
    full = torch.load(tmp_path / "full.pt", weights_only=False)
    for name, value in out["state"].items():
        assert torch.equal(full[f"state_dict.{name}"], value), name
    names = [n for n in out["state"] if "wpe" in n or "blocks.0.attn" in n]
    for name in names:  # Adam's moments in torch's FQN-keyed layout, full shape
        assert full[f"optimizer_0.state.{name}.exp_avg"].shape == out["state"][name].shape
        assert full[f"optimizer_0.state.{name}.step"].dim() == 0
    groups = [full[f"optimizer_0.param_groups.{g}.params"] for g in range(2)]  # DCP's flattened layout
    assert "optimizer_0.param_groups.2.params" not in full
    assert (len(groups[0]), len(groups[1])) == (10, 18)  # the decay / no-decay groups, by parameter name
    assert set(groups[0]) | set(groups[1]) <= set(out["state"])
    assert full["optimizer_0.param_groups.1.lr"] == 0.05
    from lightning_shard.checkpoint.dcp import DCPReader
    from lightning_shard.cli import main  # and our own consolidation reads DCP directories

    reader = DCPReader(ckpt)  # one DCP load per range read, but the metadata file is read once
    names = reader.keys("param/")
    assert all(torch.equal(reader.full(f"param/{n}").view(out["state"][n].shape), out["state"][n]) for n in names)
    assert len(names) > 10 and reader._fs.metadata_reads == 1
    assert main(["consolidate", str(ckpt), str(tmp_path / "ours.pt")]) == 0
    ours = torch.load(tmp_path / "ours.pt", weights_only=True)
    assert ours.keys() == out["state"].keys() and all(torch.equal(ours[k], v) for k, v in out["state"].items())


def test_dcp_checkpoint_resumes_under_another_strategy(world, ref, fresh, tmp_path):
    """zero2 writes DCP checkpoints every 3 steps (mid-epoch); zero3 resumes the one of step 3 (loops from
    meta.pt) and matches one process, as does the uninterrupted zero2 run."""
    straight = world.run(fit_ours, 2, 2 * STEPS, ckpt_dir=str(tmp_path), strategy_kwargs=DCP)[0]
    assert max_diff(straight["state"], ref) < 1e-5
    out = world.run(fit_ours, 3, 2 * STEPS, resume_from=str(tmp_path / STEP3))[0]
    resumed_at_step3(out, fresh)  # resumed at step 3, the start of epoch 1, not from scratch
    assert max_diff(out["state"], ref) < 1e-5


def test_fsdp2_checkpoint_resumes_under_ours(world, ref, fresh, tmp_path):
    """Lightning ModelParallelStrategy (torch fully_shard) writes DCP checkpoints; zero1 resumes weights, Adam
    state and loops from the one of step 3."""
    fsdp2 = world.run(ds.fit_fsdp2, 2 * STEPS, ACC, data_steps=STEPS, ckpt_dir=str(tmp_path))[0]
    assert max_diff(fsdp2["state"], ref) < 1e-5  # FSDP2 itself matches one process
    out = world.run(fit_ours, 1, 2 * STEPS, resume_from=str(tmp_path / STEP3))[0]
    resumed_at_step3(out, fresh)
    assert max_diff(out["state"], ref) < 1e-5


def test_ours_resumes_under_fsdp2(world, ref, fresh, tmp_path):
    """Our zero3 DCP checkpoint of step 3 loads into FSDP2 through Lightning's own ModelParallelStrategy."""
    world.run(fit_ours, 3, 2 * STEPS, ckpt_dir=str(tmp_path), strategy_kwargs=DCP)
    out = world.run(ds.fit_fsdp2, 2 * STEPS, ACC, data_steps=STEPS, resume_from=str(tmp_path / STEP3))[0]
    assert out["global_step"] == 2 * STEPS
    resumed_at_step3(out, fresh)
    assert max_diff(out["state"], ref) < 1e-5



def test_lightning_fsdp_sharded_layout_resumes_under_ours(world, ref, fresh, tmp_path):
    """The layout of Lightning FSDPStrategy(state_dict_type="sharded") (torch FSDP1): ``model.``-prefixed keys and
    a nested FQN-keyed optimizer state, written by Lightning's own DCP save function (FSDP1 itself needs an
    accelerator); zero3 resumes weights, Adam state and loops from it."""
    world.run(fit_ours, 2, 2 * STEPS, ckpt_dir=str(tmp_path / "ours"), strategy_kwargs=DCP)
    fsdp1 = tmp_path / "fsdp1.ckpt"
    ds.as_fsdp1_folder(str(tmp_path / "ours" / STEP3), str(fsdp1))
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(fsdp1)).read_metadata().state_dict_metadata
    assert "model.model.blocks.0.attn.qkv.weight" in keys and not any(k.startswith("state_dict.") for k in keys)
    assert "optimizer_0.state.model.blocks.0.attn.qkv.weight.exp_avg" in keys
    out = world.run(fit_ours, 3, 2 * STEPS, resume_from=str(fsdp1))[0]
    resumed_at_step3(out, fresh)
    assert max_diff(out["state"], ref) < 1e-5
