"""A rank dying or stalling ends the job with a readable error within the collective timeout, and a restart
from ckpt_path="last" ends where an uninterrupted run ends (issues 4 and 8). Safe loading of checkpoints."""

from __future__ import annotations

import os
import pickle
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

JOB = Path(__file__).parents[1] / "failure_job.py"


def run_job(mode: str, out: Path, limit: float = 240) -> tuple[int, str, float]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("LOCAL_RANK", None)
    t0 = time.monotonic()
    log = out / f"{mode}.log"
    with open(log, "w") as f:  # a file, not a pipe: a stalled rank would hold a pipe open after rank 0 exits
        proc = subprocess.Popen([sys.executable, str(JOB), mode, str(out)], stdout=f, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
        try:
            proc.wait(timeout=limit)  # rank 0 is the launching process: its exit ends the job
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the launched rank, if it outlived rank 0
            except ProcessLookupError:
                pass
    return proc.returncode, log.read_text(), time.monotonic() - t0


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    out = tmp_path_factory.mktemp("straight")
    code, output, _ = run_job("straight", out)
    assert code == 0, output[-3000:]
    return torch.load(out / "final.pt", weights_only=True)


def test_killed_rank_ends_the_job_and_last_checkpoint_resumes_exactly(tmp_path, straight):
    code, output, seconds = run_job("kill", tmp_path)
    assert code != 0
    assert "RANK1 STEP 5" in output, output[-3000:]  # rank 1 got to the step where it kills itself
    # rank 0's error is the library's, naming the collective that lost its peer, with gloo's reason. Which one
    # depends on timing: rank 1 dies at the start of step 5 while step 4's post-step all-gather (issued
    # asynchronously, waited on in the next forward) may still be in flight on its side; if it finished, rank 0
    # loses its peer in step 5's gradient reduction instead. Both are real collectives of this job's schedule.
    lost = re.search(r"rank 0: the (gradient reduction|post-step parameter all-gather) of bucket \d+ \([^)]*\) "
                     r"failed", output)
    assert lost, output[-3000:]
    assert any(s in output for s in ("Connection closed", "Connection reset", "Broken pipe")), output[-3000:]
    assert "waiting for clients" not in output and "DistStoreError" not in output  # not the start-up
    assert (tmp_path / "last.ckpt" / "meta.json").is_file()
    code, output, _ = run_job("resume", tmp_path)
    assert code == 0, output[-3000:]
    resumed = torch.load(tmp_path / "final.pt", weights_only=True)
    for k in straight:
        assert torch.equal(resumed[k], straight[k]), k


def test_stalled_rank_times_out_with_a_readable_error(tmp_path):
    """The failure is the *collective* timeout (10 s) of a step after training started, on rank 0 waiting for
    rank 1's part of a gradient reduction, not the rendezvous (whose timeout is the 1800 s default)."""
    code, output, seconds = run_job("sleep", tmp_path)
    assert code != 0
    assert "RANK0 STEP 3" in output and "RANK1 STEP 3" in output, output[-3000:]  # both ranks were training
    assert "the gradient reduction of bucket" in output and "failed" in output, output[-3000:]
    assert "Timed out waiting 10000ms" in output, output[-3000:]  # the collective timeout, in gloo's words
    assert "waiting for clients" not in output and "DistStoreError" not in output
    assert seconds < 300  # the job ended before the stalled rank woke up (its stall is 300 s)


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo PWNED > /tmp/lightning_shard_pwned",))


def test_malicious_pickle_is_refused(tmp_path):
    from lightning_shard.core.checkpoint import CheckpointError, Reader
    from lightning_shard.strategies import ShardedCheckpointIO, Zero2Strategy

    marker = Path("/tmp/lightning_shard_pwned")
    marker.unlink(missing_ok=True)
    evil_file = tmp_path / "evil.ckpt"
    torch.save({"state_dict": _Evil()}, evil_file)  # a real torch file: weights_only=False would run the payload
    for asked in (True, False, None):  # whatever the caller asks, nothing is unpickled beyond tensors
        with pytest.raises(Exception, match="(?i)weights.only|unpickl|unsupported"):
            ShardedCheckpointIO().load_checkpoint(evil_file, weights_only=asked)
        with pytest.raises(Exception, match="(?i)weights.only|unpickl|unsupported"):
            Zero2Strategy().load_checkpoint(evil_file, weights_only=asked)  # the strategies' own loading path
    # a sharded directory whose rank file carries the payload
    d = tmp_path / "evil_dir"
    d.mkdir()
    torch.save({"x": torch.zeros(1)}, d / "rank00000.pt")
    with open(d / "rank00000.pt", "wb") as f:
        pickle.dump({"param/x": _Evil()}, f)
    (d / "meta.json").write_text('{"format": "lightning_shard.sharded", "version": 1, "complete": true, '
                                 '"index": {"param/x": [[0, 0, 1]]}, "shapes": {"x": [1]}, "optimizers": []}')
    with pytest.raises(CheckpointError, match="cannot be read safely"):
        Reader(d).read("param/x")
    assert not marker.exists()
