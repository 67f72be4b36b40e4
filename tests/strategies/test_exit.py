"""A finished job exits 0: no abort at interpreter exit from gloo's worker threads (tests/exit_job.py says how the
harness provokes it; ``C.install_exit_guard`` says why it happens and what the guard does)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import free_port

pytestmark = pytest.mark.slow  # jobs that exit after their last collective, run several times

JOB = Path(__file__).parents[1] / "exit_job.py"
ABORT = "terminate called without an active exception"


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")
    env.pop("LOCAL_RANK", None)
    return env


def _run(argv: list[str], log: Path, limit: float = 180) -> int:
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, str(JOB), *argv], stdout=f, stderr=subprocess.STDOUT, env=_env(),
                                start_new_session=True)
        try:
            return proc.wait(timeout=limit)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # a launched rank that outlived rank 0
            except ProcessLookupError:
                pass


def _raw_pair(guard: str, tmp: Path, i: int) -> tuple[list[int], str]:
    """Both ranks of the raw job; their return codes and their output."""
    port = free_port()
    logs = [tmp / f"raw_{guard}_{i}_rank{r}.log" for r in (0, 1)]
    files = [open(p, "w") for p in logs]
    try:
        procs = [subprocess.Popen([sys.executable, str(JOB), "raw", guard, str(r), str(port)], stdout=files[r],
                                  stderr=subprocess.STDOUT, env=_env()) for r in (0, 1)]
        codes = []
        for p in procs:
            try:
                codes.append(p.wait(timeout=120))
            except subprocess.TimeoutExpired:
                p.kill()
                codes.append(p.wait())
    finally:
        for f in files:
            f.close()
    return codes, "".join(p.read_text() for p in logs)


def test_last_collective_then_exit_does_not_abort(tmp_path):
    """6 jobs with the guard (``C.init_process_group`` installs it) all exit 0 on both ranks, with no abort message.
    They run on every machine: whether this one provokes the abort without the guard is the control's question
    (the next test), not a condition for these."""
    for i in range(6):
        codes, out = _raw_pair("on", tmp_path, i)
        assert codes == [0, 0] and ABORT not in out, (i, codes, out[-2000:])
        assert out.count("DONE guard=True") == 2, out[-2000:]


def test_control_without_the_guard_aborts(tmp_path):
    """Control: the same job without the guard aborts a process at exit (rc -6, libstdc++'s message), which shows the
    guarded runs above could fail here. A machine where it cannot be provoked in 10 tries skips this control only:
    the guarded runs then still pass, but prove less on that machine."""
    for i in range(10):
        codes, out = _raw_pair("off", tmp_path, i)
        if any(c != 0 for c in codes):
            assert -signal.SIGABRT in codes and ABORT in out, (codes, out[-2000:])  # the abort, nothing else
            return
    pytest.skip("the harness did not provoke the exit abort without the guard in 10 jobs on this machine")


@pytest.mark.parametrize("strategy", ["zero3", "zero2"])
def test_fit_then_exit_is_clean(tmp_path, strategy):
    """A Lightning fit under each engine path installs the guard (both ranks say so after fit) and the job exits 0
    with no abort message from either rank (rank 1's output goes to the same log)."""
    log = tmp_path / f"{strategy}.log"
    rc = _run(["fit", strategy], log)
    out = log.read_text()
    assert rc == 0 and ABORT not in out, (rc, out[-3000:])
    assert out.count("DONE guard=True") == 2, out[-3000:]
