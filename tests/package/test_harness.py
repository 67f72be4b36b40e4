"""The test harness itself (tests/harness.py): ranks never outlive the test process that started them."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"  # a zombie has exited; only its parent (init, now) has not reaped it yet


def test_ranks_exit_when_the_test_process_is_killed(tmp_path):
    """A pytest run killed by a CI timeout or by hand (SIGKILL: no atexit, no daemon clean-up) must not leave its
    rank processes waiting for work forever: each rank reads the end of its pipe and exits."""
    script = tmp_path / "world.py"
    script.write_text("import sys, time\nfrom tests.harness import World\nw = World(2)\n"
                      "print(' '.join(str(p.pid) for p in w.procs), flush=True)\ntime.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, str(script)], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    try:
        pids = [int(x) for x in proc.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.2)
    left = [p for p in pids if _alive(p)]
    for p in left:  # do not leave them behind even when the test fails
        subprocess.run(["kill", "-9", str(p)], check=False)
    assert not left, f"rank processes {left} outlived the killed test process"
