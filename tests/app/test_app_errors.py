"""Bad input to the train command: one message that names the key and the fix, before any rank starts.

``preflight(argv)`` is what ``python -m lightning_shard.train`` runs first (exit status 2 on error); it is
called here in-process, which composes exactly as the command does.
"""

from __future__ import annotations

import pytest

from lightning_shard.train import preflight, sweep_combinations


@pytest.mark.parametrize("argv,expected", [
    # unknown group option: the choices are listed, with the close match
    (["strategy=zero9"], ["strategy=zero9", "did you mean 'zero3'", "zero0, zero1, zero2"]),
    (["topology=hgx_h100_9"], ["topology=hgx_h100_9", "hgx_h100_8"]),
    (["recipe=gpt_huge"], ["recipe=gpt_huge", "gpt_tiny", "digits"]),
    # typo in an option: the key, the close match, the valid keys (of the strategy, of a group)
    (["strategy.acumulation=defer"], ["strategy.acumulation", "did you mean 'accumulation'", "valid keys of strategy"]),
    (["strategy.tuning.bucket_mbb=3"], ["strategy.tuning.bucket_mbb", "did you mean 'bucket_mb'",
                                        "valid keys of strategy.tuning"]),
    (["strategy.tunning.bucket_mb=3"], ["strategy.tunning", "did you mean 'tuning'"]),
    (["trainer.max_step=3"], ["trainer.max_step", "did you mean 'max_steps'"]),
    (["+recipe.model.n_layr=2"], ["recipe.model.n_layr", "did you mean 'n_layer'"]),
    # an option of a group given flat (the flat knob list of before): the key and where it lives now
    (["strategy.bucket_mb=5"], ["strategy.bucket_mb: no such key", "strategy.tuning.bucket_mb=5"]),
    (["strategy=zero3", "strategy.prefetch_depth=2"], ["strategy.prefetch_depth", "strategy.tuning.prefetch_depth=2"]),
    (["strategy.start_method=fork"], ["strategy.start_method", "strategy.launch.start_method=fork"]),
    (["strategy.quant_block=64"], ["strategy.quant_block", "did you mean strategy.compression.block"]),
    (["+strategy.overlap=false"], ["strategy.overlap: not an option", "strategy.tuning.overlap=false"]),
    # wrong type: the key, the expected type, an example
    (["strategy.tuning.bucket_mb=fast"], ["strategy.tuning.bucket_mb", "Float", "strategy.tuning.bucket_mb=25.0"]),
    (["strategy.tuning.overlap=maybe"], ["strategy.tuning.overlap", "bool", "strategy.tuning.overlap=true"]),
    (["recipe.micro_batch_size=two"], ["recipe.micro_batch_size", "Integer"]),
    # a value outside the choices of that strategy
    (["strategy.accumulation=defer_it"], ["strategy.accumulation='defer_it'", "auto, defer, per_micro_batch"]),
    (["strategy=zero1", "strategy.accumulation=per_micro_batch"], ["Zero1Strategy", "choose one of auto, defer"]),
    (["strategy=zero3", "strategy.accumulation=defer"], ["keep_unsharded_grads", "keep_params"]),
    (["strategy.launch.start_method=thread"], ["strategy.launch.start_method='thread'", "popen, fork, spawn"]),
    (["strategy=zero3", "strategy.compression.reduce_quant=int2"], ["strategy.compression.reduce_quant='int2'",
                                                                  "none, int8, int4"]),
    # a recipe path that does not exist
    (["recipe=hf_causal_lm", "recipe.model.name_or_path=./models/does-not-exist"],
     ["recipe.model.name_or_path", "no such file or directory", "hub id"]),
    (["recipe.data._target_=lightning_shard.recipes.nope.DataModule"],
     ["recipe.data._target_", "module 'lightning_shard.recipes.nope' not found"]),
    (["recipe.model._target_=lightning_shard.recipes.gpt.GPTModule"],
     ["recipe.model._target_", "did you mean 'GPTLightningModule'"]),
    # micro batch larger than the global batch, and not divisible
    (["recipe.micro_batch_size=64"], ["recipe.micro_batch_size * world_size = 64 * 2 = 128", "Fix:"]),
    (["recipe.global_batch_size=30", "recipe.micro_batch_size=4"], ["recipe.global_batch_size = 30", "24 or 32"]),
    # impossible combination: hybrid sharding on a one-island machine
    (["strategy=zero3_hybrid"], ["strategy.shard_size=auto", "one island", "topology=cpu_2x2"]),
    (["strategy=zero2", "strategy.shard_size=2"], ["strategy.shard_size=2", "more than one group"]),
    # accumulation is derived, never typed
    (["+trainer.accumulate_grad_batches=4"], ["trainer.accumulate_grad_batches is derived",
                                               "recipe.global_batch_size", "recipe.micro_batch_size"]),
    (["trainer.accumulate_grad_batches=4"], ["trainer.accumulate_grad_batches is derived",
                                              "recipe.global_batch_size", "recipe.micro_batch_size"]),
    # a Trainer keyword the schema does not list, and a misspelt one (before any run folder is made)
    (["trainer.detect_anomaly=true"], ["+trainer.detect_anomaly=..."]),
    (["+trainer.max_stpes=3"], ["trainer.max_stpes: not a keyword of lightning.Trainer", "did you mean 'max_steps'"]),
    # resuming with nothing to resume from
    (["ckpt_path=/nonexistent/run"], ["ckpt_path=/nonexistent/run: no such checkpoint or run folder"]),
    # a topology key's value: the key, the value and the choices (not the trainer key that interpolates it)
    (["topology=cpu", "topology.network=eth"], ["topology.network='eth'", "ib_ndr, roce_200g"]),
    (["topology=cpu", "topology.nvlink_gen=9"], ["topology.nvlink_gen=9", "1, 2, 3, 4, 5"]),
    (["topology=cpu", "topology.pcie_gen=7"], ["topology.pcie_gen=7", "3, 4, 5"]),
    (["topology=cpu", "topology.kind=tpu"], ["topology.kind='tpu'", "gpu, cpu"]),
    (["topology=cpu", "topology.devices=0"], ["topology.devices=0", "whole number >= 1"]),
    (["topology=hgx_h100_2nodes_ib", "topology.nodes=0"], ["topology.nodes=0", "whole number >= 1"]),
    (["topology=hgx_h100_2nodes_ib", "topology.nics_per_node=0"], ["topology.nics_per_node=0", ">= 1"]),
    (["topology=cpu", "topology.uniform=NVX"], ["topology.uniform='NVX'", "NV<n>, PIX"]),
    (["topology=cpu", "topology.numa=[0]"], ["topology.numa lists 1 entries for 2 devices"]),
])
def test_bad_input_names_the_key_and_the_fix(argv, expected):
    message = preflight(argv)
    assert message is not None, argv
    for part in expected:
        assert part in message, f"{part!r} not in {message!r}"


def test_resume_from_last_without_a_checkpoint_is_not_refused_before_launch(tmp_path):
    """``ckpt_path=last`` serves a job's first start too (it warns and starts fresh: tests/app/test_resume_last.py)."""
    assert preflight(["ckpt_path=last", f"hydra.run.dir={tmp_path}/run"]) is None
    assert "no such checkpoint" in preflight([f"ckpt_path={tmp_path}/nothing", f"hydra.run.dir={tmp_path}/run"])


@pytest.mark.slow
def test_a_misspelt_trainer_key_leaves_no_run_folder(tmp_path):
    import subprocess
    import sys

    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "lightning_shard.train", "+trainer.max_stpes=3",
                           f"hydra.run.dir={run}"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "trainer.max_stpes: not a keyword of lightning.Trainer" in proc.stderr
    assert "Traceback" not in proc.stderr and not run.exists()


def test_a_sweep_is_checked_job_by_job_before_any_starts():
    assert preflight(["-m", "strategy=zero1,zero2", "recipe=gpt_test"]) is None
    message = preflight(["-m", "strategy=zero2,zero3_hybrid", "recipe=gpt_test"])
    assert message is not None and "strategy.shard_size=auto" in message


def test_sweep_combinations_include_config_sweeper_params():
    jobs = sweep_combinations(["experiment=strategies_cpu"], multirun=True)
    assert [j[0] for j in jobs] == [f"strategy={s}" for s in ("zero0", "zero1", "zero2", "zero3", "fsdp_shard")]
    jobs = sweep_combinations(["strategy=zero1,zero2", "recipe=gpt_test,digits"], multirun=True)
    assert len(jobs) == 4


def test_good_input_passes():
    assert preflight([]) is None
    assert preflight(["strategy=fsdp_shard", "recipe=digits", "strategy.accumulation=keep_params"]) is None
    assert preflight(["strategy=zero2_hybrid", "topology=cpu_2x2"]) is None
    assert preflight(["strategy=zero3", "strategy.tuning.prefetch_depth=2", "strategy.launch.start_method=fork",
                      "strategy.compression.reduce_quant=int8", "strategy.safety.timeout_s=60"]) is None
    assert preflight(["--cfg", "job"]) is None  # Hydra's own modes are left to Hydra
