"""The ZeRO memory ladder, measured outside the engine: each rank's peak resident set (``VmHWM``), not
``engine.memory_report()`` nor ``peak_gathered``.

Model (tests/memory_peak_job.py): 24 x Linear(1024, 1024), Psi = 25.2M fp32 parameters, so one full copy of the model
is M = 4 Psi bytes = 96.1 MiB; Adam (two fp32 states), 3 steps, world N = 2, batch 4 x 1024. Every strategy runs in
fresh rank processes started with ``MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=65536`` (freed tensors leave
the resident set); the peak is ``VmHWM`` after fit less ``VmRSS`` when the scenario starts (interpreter, torch,
Lightning).

Model state per rank from the formulas (params 4 Psi + grads 4 Psi + Adam 8 Psi, the sharded parts divided by N):

=========  =========================  =========  ====================================================  ============
strategy   formula                    bytes      what the engine's design adds at its peak              measured
=========  =========================  =========  ====================================================  ============
zero0      16 Psi           = 4 M     384 MiB    (the replicated run; Lightning DDP: + 4 Psi reducer)   ~457 MiB
zero1      4+4+8/N Psi      = 3 M     288 MiB    + M/2: the other rank's piece of each bucket is        ~404 MiB
                                                 received into a shard-sized buffer, all waited at the
                                                 end of backward
zero2      4+4/N+8/N Psi    = 2.5 M   240 MiB    + at most 3 buckets (bucket_mb=4) of full gradients   ~315 MiB
zero3      16/N Psi         = 2 M     192 MiB    + M: stage 3 waits no reduction inside backward        ~358 MiB
                                                 (engine/buckets/sync.py), so every unit's full gradients are
                                                 alive at its end (+ the gathered units, 4 MiB each)
=========  =========================  =========  ====================================================  ============

(measured on the 2-core CPU machine; DDP ~552 MiB.) The rest of each peak, ~70 MiB (Adam's per-chunk temporaries,
autograd's fresh gradient before it lands in a bucket, Lightning, gloo), is common to every strategy: the test
asserts differences, per rank, each at half of what the formula (with the engine's additions above) says is saved:

* zero0 - zero1 >= M/4: the formula saves (N-1)/N x 8 Psi = M, the receive buffers take back M/2; half of M/2.
* zero1 - zero2 >= M/4: the formula saves (N-1)/N x 4 Psi = M/2 (the full gradients); half of it. A zero2 that kept
  its full gradients would save nothing.
* zero0 - zero3 >= M/2: the formula saves (N-1)/N x 16 Psi = 2 M, the full gradients at the end of backward take
  back M; half of M, i.e. a quarter of the textbook saving. A zero3 that kept its units gathered (+M) would not.

Runs on the CPU (gloo) also where CUDA is present; skipped where ``/proc/self/status`` has no ``VmHWM`` or the C
library is not glibc (the allocator variables would not apply).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from tests.memory_peak_job import MALLOC_ENV, n_params, status_bytes

REPO = Path(__file__).resolve().parents[2]
MIB = 2**20
WORLD = 2
STRATEGIES = ("zero0", "zero1", "zero2", "zero3")

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    status_bytes("VmHWM") is None or platform.libc_ver()[0] != "glibc",
    reason="needs Linux's /proc/self/status VmHWM and glibc's MALLOC_* variables")]


@pytest.fixture(scope="module")
def peaks(tmp_path_factory) -> dict[str, list[int]]:
    """Peak bytes above the start of the scenario, per strategy and rank (one job, a fresh World per strategy)."""
    out = tmp_path_factory.mktemp("peak") / "peak.json"
    env = {**os.environ, **MALLOC_ENV, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "tests.memory_peak_job", str(out), *STRATEGIES], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    res = json.loads(out.read_text())
    return {name: [r["peak"] for r in res[name]] for name in STRATEGIES}


def _table(peaks: dict[str, list[int]]) -> str:
    return "; ".join(f"{k} " + "/".join(f"{p / MIB:.0f}" for p in v) + " MiB" for k, v in peaks.items())


def _saves(peaks: dict[str, list[int]], more: str, less: str, at_least: float) -> None:
    for rank in range(WORLD):
        saved = peaks[more][rank] - peaks[less][rank]
        assert saved >= at_least, (f"rank {rank}: {less}'s peak is {saved / MIB:.1f} MiB below {more}'s, expected at "
                                   f"least {at_least / MIB:.1f} MiB (peaks: {_table(peaks)})")


def model_bytes() -> int:
    return 4 * n_params()  # M: one fp32 copy of the model


def test_zero1_shards_the_optimizer_state(peaks):
    _saves(peaks, "zero0", "zero1", model_bytes() / 4)


def test_zero2_peak_is_below_zero1(peaks):
    """zero2 frees each bucket's full gradients after its reduce-scatter; zero1 keeps them."""
    _saves(peaks, "zero1", "zero2", model_bytes() / 4)


def test_zero3_peak_is_below_the_replicated_run(peaks):
    """zero3 holds shards of the parameters, gradients and Adam state, the units' full parameters only while used."""
    _saves(peaks, "zero0", "zero3", model_bytes() / 2)
