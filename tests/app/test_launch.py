"""Launches for real: torchrun processes on loopback, as users launch on clusters (the Hydra app under
``torchrun``), with the failures a long job meets. Every run trains the ``gpt_test`` recipe (fp32, 2 ranks unless
said) and is compared with an uninterrupted run by its consolidated weights.

* one job, one run folder: every rank, node and restart writes into the same folder;
* ``--max-restarts`` with ``ckpt_path=last``: a rank SIGKILLed after a checkpoint (once, then twice) -> the job ends
  rc 0, resumed from the step of the last checkpoint, equal to the uninterrupted run;
* two torchrun "nodes" of one rank each equal one node of two ranks."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
COMMON = ["recipe=gpt_test", "trainer=quiet", "seed=1234", "recipe.model.warmup_steps=8", "trainer.max_steps=6"]

pytestmark = pytest.mark.slow


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_", "LIGHTNING_SHARD_"))}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **extra}


def torchrun(cwd: Path, overrides: list[str], *, nproc: int = 2, nnodes: int = 1, node_rank: int = 0,
             port: int = 0, max_restarts: int = 0, rdzv_id: str = "") -> subprocess.Popen:
    """``torchrun``: several nodes with the static rendezvous (``--node-rank``, ``--master-addr``), one node with the
    c10d rendezvous, which restarts need (torch 2.13's static rendezvous hangs at a restart's rendezvous)."""
    cmd = [TORCHRUN, f"--nnodes={nnodes}", f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}",
           "--monitor-interval=0.5"]
    if nnodes > 1:
        cmd += [f"--node-rank={node_rank}", "--master-addr=127.0.0.1", f"--master-port={port or _port()}"]
    else:
        cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port or _port()}"]
        cmd += [f"--rdzv-id={rdzv_id}"] if rdzv_id else []
    cmd += ["-m", "lightning_shard.train", *overrides]
    return subprocess.Popen(cmd, cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen, timeout: int = 400) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-4000:]
    return out


def _run_folders(cwd: Path) -> list[Path]:
    return sorted(p.parent for p in cwd.glob("outputs/*/*/*/.hydra"))


def _weights(run: Path, out: Path) -> dict[str, torch.Tensor]:
    done = subprocess.run([sys.executable, "-m", "lightning_shard.cli", "consolidate", str(run / "checkpoints" /
                           "last.ckpt"), str(out)], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out, weights_only=True)


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[str, torch.Tensor]:
    cwd = tmp_path_factory.mktemp("whole")
    _finish(torchrun(cwd, COMMON))
    (run,) = _run_folders(cwd)
    return _weights(run, cwd / "whole.pt")


@pytest.mark.parametrize("kills,rdzv_id", [([3], ""), ([3, 5], "job-7")], ids=["killed_once", "killed_twice"])
def test_a_killed_rank_restarts_from_the_last_checkpoint_and_ends_equal(tmp_path, uninterrupted, kills, rdzv_id):
    """Without a job id (``--rdzv-id``) the ranks agree on the run folder through torchrun's store; with one, the
    folder is named by it. Either way the restarts find the job's own checkpoint."""
    marker = tmp_path / "marker"
    marker.mkdir()
    kill = ["+callbacks.kill._target_=tests.launch_callbacks.KillAt", f"+callbacks.kill.steps={kills}",
            f"+callbacks.kill.marker={marker}"]
    out = _finish(torchrun(tmp_path, [*COMMON, "ckpt_path=last", *kill], max_restarts=len(kills), rdzv_id=rdzv_id))
    (run,) = _run_folders(tmp_path)  # one folder for the job and its restarts
    assert run.name == (f"torchrun-{rdzv_id}" if rdzv_id else run.name)
    assert "ckpt_path=last: no complete checkpoints/last.ckpt" in out  # the first start: nothing yet, fresh
    resumed = [int(s) for s in _resumed_steps(out)]
    # checkpoints every val_every_n_steps = 2 optimizer steps: a kill as step k starts resumes from the even step
    # before it
    assert resumed == [k - k % 2 if k % 2 == 0 else k - 1 for k in kills], out[-3000:]
    diff = _max_diff(_weights(run, tmp_path / "killed.pt"), uninterrupted)
    summary = json.loads((run / "summary.json").read_text())
    delays = [float((marker / f"resumed-{i + 1}").read_text().split()[0]) - float((marker / f"kill-{k}").read_text())
              for i, k in enumerate(kills)]
    print(f"kills at steps {kills}: resumed at steps {resumed}, max |diff| {diff:.3g}, seconds from kill to "
          f"training again {[round(d, 1) for d in delays]}")
    assert summary["optimizer_steps"] == 6
    assert diff == 0.0, f"the restarted job ends {diff} away from the uninterrupted one"


def _resumed_steps(out: str) -> list[str]:
    return [line.split("resumed at optimizer step ")[1].split()[0] for line in out.splitlines()
            if "resumed at optimizer step " in line]


def test_two_nodes_of_one_rank_equal_one_node_of_two(tmp_path, uninterrupted):
    port = _port()
    nodes = ["trainer.devices=1", "trainer.num_nodes=2"]
    first = torchrun(tmp_path, [*COMMON, *nodes], nproc=1, nnodes=2, node_rank=0, port=port)
    time.sleep(2)  # the second node starts late
    second = torchrun(tmp_path, [*COMMON, *nodes], nproc=1, nnodes=2, node_rank=1, port=port)
    _finish(first), _finish(second)
    (run,) = _run_folders(tmp_path)  # the nodes agreed on one run folder
    assert _max_diff(_weights(run, tmp_path / "nodes.pt"), uninterrupted) == 0.0


def test_nodes_with_different_machines_are_named_before_training(tmp_path):
    """Each node reads its own capture (as ``"detect"`` reads its own GPUs): node 1 has NVLink pairs where node 0 has
    NVSwitch. Both ranks stop at setup with one message naming node 1 and what it has."""
    port = _port()
    assets = ROOT / "tests" / "assets" / "topology"
    nodes = ["trainer.devices=1", "trainer.num_nodes=2"]
    procs = [torchrun(tmp_path, [*COMMON, *nodes, f"strategy.topology={assets / capture}"], nproc=1, nnodes=2,
                      node_rank=rank, port=port)
             for rank, capture in enumerate(["f03_h100_sxm_nvswitch_tabs.txt", "f08_h100_nvl_pairs.txt"])]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode != 0
        assert "do not have the same machine" in out and "node 1 (" in out, out[-3000:]
        assert "pairs: NODE x 8, NV12 x 4, SYS x 16" in out and "pairs: NV18 x 28" in out
        assert "optimizer step" not in out.split("do not have the same machine")[0]
    message = next(line for line in outs[0].splitlines() if "do not have the same machine" in line)
    print(message)


def test_two_nodes_of_two_ranks_hybrid_equal_four_ranks(tmp_path):
    """zero3_hybrid over two torchrun nodes of two ranks (shard inside each node's island, replicate across) ends
    within fp32 rounding (1e-5) of zero3 over four ranks of one node: the same global batch, reduced in another
    order."""
    batch = ["recipe.global_batch_size=16", "trainer.max_steps=4"]
    one = tmp_path / "one"
    one.mkdir()
    _finish(torchrun(one, [*COMMON, *batch, "strategy=zero3", "topology=cpu", "topology.devices=4"], nproc=4))
    two = tmp_path / "two"
    two.mkdir()
    port = _port()
    hybrid = [*COMMON, *batch, "strategy=zero3_hybrid", "topology=cpu", "topology.devices=2", "topology.nodes=2"]
    procs = [torchrun(two, hybrid, nproc=2, nnodes=2, node_rank=rank, port=port) for rank in (0, 1)]
    outs = [_finish(p) for p in procs]
    (run_one,), (run_two,) = _run_folders(one), _run_folders(two)
    summary = json.loads((run_two / "summary.json").read_text())
    assert summary["world_size"] == 4 and run_two.parent.name == "zero3_hybrid-cpu", outs[0][-2000:]
    diff = _max_diff(_weights(run_one, tmp_path / "one.pt"), _weights(run_two, tmp_path / "two.pt"))
    print(f"2 nodes x 2 ranks zero3_hybrid vs 1 node x 4 ranks zero3: max |diff| {diff:.3g}")
    assert diff <= 1e-5


def _slurm_task(cwd: Path, overrides: list[str], rank: int, port: int, bin_dir: Path) -> subprocess.Popen:
    """One task of ``srun --ntasks=2`` on one node, as SLURM starts it (its environment), with ``scontrol`` on the
    PATH replaced by a script that records its arguments."""
    env = _env(SLURM_JOB_ID="4242", SLURM_JOB_NAME="train", SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="2",
               SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_NODEID="0", SLURM_NODELIST="localhost",
               SLURM_JOB_NUM_NODES="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return subprocess.Popen([sys.executable, "-m", "lightning_shard.train", *overrides], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_slurm_signal_saves_at_a_step_requeues_and_the_requeued_job_resumes(tmp_path, uninterrupted):
    """``--signal=USR1@90`` reaches rank 0 only, as step 4 starts: the ranks agree at the end of that step, save
    ``last.ckpt`` there, rank 0 calls ``scontrol requeue 4242`` and both exit 0. The requeued job (the same command,
    the same job id: the same run folder) resumes from step 4 and ends equal to the uninterrupted run."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "scontrol.calls"
    (bin_dir / "scontrol").write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\n")
    (bin_dir / "scontrol").chmod(0o755)
    signal_at = ["+callbacks.usr1._target_=tests.launch_callbacks.SignalAt", "+callbacks.usr1.step=3",
                 f"+callbacks.usr1.marker={tmp_path / 'signalled'}"]
    overrides = [*COMMON, "ckpt_path=last", *signal_at]
    for attempt in ("first", "requeued"):
        port = _port()
        procs = [_slurm_task(tmp_path, overrides, rank, port, bin_dir) for rank in (0, 1)]
        outs = [_finish(p, timeout=240) for p in procs]
        out = outs[0]
        if attempt == "first":
            assert "saved step 4" in out and "requeued SLURM job 4242" in out, out[-3000:]
            assert calls.read_text().split() == ["requeue", "4242"]
    assert "resumed at optimizer step 4" in out, out[-3000:]
    (run,) = _run_folders(tmp_path)
    assert run.name == "slurm-4242"
    diff = _max_diff(_weights(run, tmp_path / "slurm.pt"), uninterrupted)
    print(f"SLURM signal at step 4, requeued, resumed at step 4: max |diff| {diff:.3g}")
    assert diff == 0.0
