"""The train command end to end on 2 CPU processes (gpt_test recipe, a few steps), and parity with Python.

- the main-job path: ``python -m lightning_shard.train`` with the default popen launcher (every rank re-runs
  the command), summary table and ``summary.json``;
- ``-m`` over every non-hybrid strategy with ``strategy.launch.start_method=fork`` (one start-up for all jobs): every
  job's summary plus ``report.md`` / ``report.png`` in the sweep folder;
- parity: the same fit written directly in Python (Trainer + strategy object, same seed) gives the same
  final validation loss as the command, within 1e-6 (fp32 on CPU: in practice bit-identical).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

from tests.optional import missing

pytestmark = pytest.mark.slow  # the train command in subprocesses (popen launcher, sweeps, resume)

ROOT = Path(__file__).resolve().parents[2]
SWEPT = ("zero0", "zero1", "zero2", "zero3", "fsdp_shard")
# gpt_test, as conf/recipe/gpt_test.yaml: 4 optimizer steps, validation every 2 (so the last one is at step 4)
COMMON = ["recipe=gpt_test", "trainer=quiet", "callbacks=minimal", "seed=1234"]


def _run(args: list[str], timeout: int = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-m", "lightning_shard.train", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sweep")
    _run(["-m", f"strategy={','.join(SWEPT)}", "strategy.launch.start_method=fork", *COMMON, f"hydra.sweep.dir={out}"])
    return out


def _summaries(sweep_dir: Path) -> dict[str, dict]:
    rows = [json.loads(p.read_text()) for p in sweep_dir.glob("*/summary.json")]
    return {r["strategy_config"]: r for r in rows}


def _consolidated(ckpt: str, out: Path) -> dict[str, torch.Tensor]:
    proc = subprocess.run([sys.executable, "-m", "lightning_shard.cli", "consolidate", ckpt, str(out),
                           "--strip-prefix", "model."], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out, weights_only=True)


def test_main_job_path_popen(tmp_path):
    """The main job's path (popen launcher, default callbacks): summary, run folder and checkpoint printed at
    the end; then resume with ``ckpt_path=last`` and consolidate what it wrote, as the end of the run says."""
    # warm-up longer than the run: the learning rate of steps 1-4 does not depend on max_steps (a cosine over
    # max_steps would differ between a 2-step run and a 4-step one, and so would the weights)
    quiet = ["strategy=zero2", "recipe=gpt_test", "trainer=quiet", "seed=1234", "recipe.model.warmup_steps=8"]
    whole = tmp_path / "whole" / "run"
    proc = _run([*quiet, f"hydra.run.dir={whole}"])
    assert "lightning_shard run summary" in proc.stdout
    assert f"run folder: {whole}" in proc.stdout
    s = json.loads((whole / "summary.json").read_text())
    assert (s["strategy"], s["topology"], s["recipe"], s["world_size"]) == ("zero2", "cpu", "gpt_test", 2)
    assert s["accumulate_grad_batches"] == 2 and s["optimizer_steps"] == 4
    assert s["accumulation_policy"] in ("defer", "per_micro_batch")
    assert s["wire_bytes_per_step"] > 0 and s["memory"]["total"] > 0 and s["tokens_per_s"] > 0
    assert s["final_val_step"] == 4 and s["final_val_loss"] < s["step_losses"][0]
    metrics = next(whole.glob("gpt_test/version_*/metrics.csv")).read_text().splitlines()[0].split(",")
    assert {"comm/total", "mem/total", "mem/gathered_params_peak", "train_loss", "val_loss"} <= set(metrics)
    # zero2 on gloo: its gradient reduce-scatters run as all-to-alls (the engine's choice on gloo)
    assert any(m.startswith("comm/all_to_all[") for m in metrics)
    logs = (whole / "train.log").read_text()
    assert "Initializing distributed: GLOBAL_RANK: 0" in logs and "accumulation=" in logs
    assert "GLOBAL_RANK: 1" in (whole / "train_ddp_process_1.log").read_text()
    assert s["checkpoint"] == str(whole / "checkpoints" / "last.ckpt") and s["resumed_from"] is None
    printed = {line.split(":", 1)[0].strip(): line.split(":", 1)[1].strip() for line in proc.stdout.splitlines()
               if line.startswith("  ") and line.strip().startswith(("resume:", "consolidate:"))}
    python = os.path.relpath(sys.executable, ROOT)  # relative when the venv is inside the repository
    python = sys.executable if python.startswith("..") else python
    assert printed["resume"] == (f"{python} -m lightning_shard.train {' '.join(quiet)} "
                                 f"ckpt_path={s['checkpoint']} trainer.max_steps=<more>")  # own run folder: its path
    consolidate = shlex.split(printed["consolidate"])  # run as printed (from the repository root, as the user is)
    assert consolidate[-3:] == ["model.pt", "--strip-prefix", "model."] and s["checkpoint"] in consolidate
    done = subprocess.run(consolidate[:-3] + [str(tmp_path / "printed.pt")] + consolidate[-2:], cwd=ROOT,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0 and done.stdout.startswith("wrote "), done.stderr[-2000:]
    assert (tmp_path / "printed.pt").is_file()

    # the same 4 steps as 2 + a resumed 2: same weights, and consolidate -> the bare network loads them
    first, second = tmp_path / "split" / "a", tmp_path / "split" / "b"
    _run([*quiet, "trainer.max_steps=2", f"hydra.run.dir={first}"])
    proc = _run([*quiet, "ckpt_path=last", f"hydra.run.dir={second}"])
    resumed = json.loads((second / "summary.json").read_text())
    assert resumed["resumed_from"] == str(first / "checkpoints" / "last.ckpt")
    assert f"resuming from {first / 'checkpoints' / 'last.ckpt'}" in proc.stdout + proc.stderr
    assert resumed["optimizer_steps"] == 4 and "Restored all states" in (second / "train.log").read_text()
    w_whole = _consolidated(s["checkpoint"], tmp_path / "whole.pt")
    w_resumed = _consolidated(resumed["checkpoint"], tmp_path / "resumed.pt")
    assert w_whole.keys() == w_resumed.keys()
    diff = max((w_whole[k] - w_resumed[k]).abs().max().item() for k in w_whole)
    assert diff <= 1e-6, f"resumed run ends {diff} away from the uninterrupted one"
    assert abs(resumed["final_val_loss"] - s["final_val_loss"]) <= 1e-5

    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    recipe = OmegaConf.load(whole / ".hydra" / "config.yaml").recipe
    bare = instantiate(recipe.model, _convert_="all").model  # the recipe's network, no Lightning, no engine
    bare.load_state_dict(w_resumed, strict=True)
    assert all(torch.equal(bare.state_dict()[k], w_resumed[k]) for k in w_resumed)


def test_sweep_runs_every_strategy_and_writes_the_report(sweep):
    rows = _summaries(sweep)
    assert set(rows) == set(SWEPT)
    for name, s in rows.items():
        assert s["world_size"] == 2 and s["optimizer_steps"] == 4 and s["final_val_step"] == 4, name
        assert s["wire_bytes_per_step"] > 0 and s["memory"]["total"] > 0, name
    # the folders are named by strategy / topology / recipe
    assert {p.name.split("-", 1)[1] for p in sweep.iterdir() if p.is_dir()} >= {f"{s}-cpu-gpt_test" for s in SWEPT}
    report = (sweep / "report.md").read_text()
    assert all(f"| {s} | cpu | gpt_test |" in report for s in SWEPT)
    assert (sweep / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # ZeRO's memory ordering per rank: zero0 >= zero1 >= zero2 >= zero3 (model state, same model)
    mem = {k: v["memory"]["total"] for k, v in rows.items()}
    assert mem["zero0"] > mem["zero1"] >= mem["zero2"] >= mem["zero3"]
    # every strategy trains the same model to the same losses (fp32, same seed, same data order)
    for name in SWEPT[1:]:
        assert rows[name]["final_val_loss"] == pytest.approx(rows["zero0"]["final_val_loss"], abs=1e-5), name


def _direct_fit(strategy_cls) -> float:
    """The gpt_test run written by hand: no Hydra, no lightning_shard.train."""
    from lightning_shard.recipes.corpus import StdlibTextDataModule
    from lightning_shard.recipes.gpt import GPTLightningModule
    from lightning_shard.strategies import Zero0Strategy  # noqa: F401 - registers the names

    torch.set_num_threads(1)
    L.seed_everything(1234, workers=True)
    strategy = strategy_cls(launch={"start_method": "fork"})
    dm = StdlibTextDataModule(block_size=32, micro_batch_size=2, max_bytes=100_000, val_fraction=0.1,
                              max_val_windows=16, num_workers=0, seed=1234)
    module = GPTLightningModule(vocab_size=256, block_size=32, n_layer=1, n_head=2, n_embd=32, dropout=0.0,
                                tie_weights=True, lr=1e-2, weight_decay=0.1, betas=[0.9, 0.95], eps=1e-6,
                                warmup_steps=1, min_lr_ratio=0.1)
    trainer = L.Trainer(accelerator="cpu", devices=2, num_nodes=1, strategy=strategy, max_steps=4,
                        accumulate_grad_batches=2, val_check_interval=2 * 2, limit_val_batches=1.0,
                        num_sanity_val_steps=0, precision="32-true", gradient_clip_val=1.0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, datamodule=dm)
    return float(trainer.callback_metrics["val_loss"])


@pytest.mark.parametrize("name", ["zero2", "zero3"])
def test_command_matches_a_direct_python_fit(sweep, name):
    from lightning_shard.strategies import Zero2Strategy, Zero3Strategy

    cls = {"zero2": Zero2Strategy, "zero3": Zero3Strategy}[name]
    assert _direct_fit(cls) == pytest.approx(_summaries(sweep)[name]["final_val_loss"], abs=1e-6)


def test_console_command_reports_bad_input_before_launch():
    exe = Path(sys.executable).with_name("lightning-shard")
    if not exe.exists():
        missing("the console script lightning-shard", "pip install -e .")
    proc = subprocess.run([str(exe), "train", "recipe=gpt_test", "recipe.micro_batch_size=8"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "recipe.micro_batch_size * world_size = 8 * 2 = 16" in proc.stderr and "Fix:" in proc.stderr
    assert "Trainer" not in proc.stdout  # nothing was launched


def test_last_checkpoint_holds_the_final_step_off_the_interval_under_zero3(tmp_path):
    """``last.ckpt`` is saved every validation interval (2 steps here) and after the final step (3): under zero3
    too, where the module is whole after fit (a save then would be a full file over the sharded folder)."""
    from lightning_shard.checkpoint.format import Reader

    run = tmp_path / "run"
    _run(["strategy=zero3", "recipe=gpt_test", "trainer=quiet", "trainer.max_steps=3", f"hydra.run.dir={run}"])
    last = run / "checkpoints" / "last.ckpt"
    reader = Reader(last)
    assert reader.trainer_state()["global_step"] == 3
    assert sorted(p.name for p in last.iterdir() if not p.name.startswith("data-")) == ["meta.json"]
