"""Proof on a GPU (issue 17): every strategy on CUDA + NCCL, measured, in one command.

    PYTHONPATH=. python3 bench/gpu_check.py [--out-dir DIR] [--phases ...] [--budget-s S] [--keep-going]
    PYTHONPATH=. python3 bench/gpu_check.py --cpu      # the same phases at tiny sizes on CPU (gloo), for CI

Phases, each in a fresh worker process (``--worker PHASE``) with a deadline, in this order:

* ``parity`` (gpu_parity.py): world 1 on NCCL, every registered strategy x fp32 / bf16-mixed / bf16-true x a small
  torch-Transformer LM and the GPT recipe against plain single-device Lightning; checkpoint at step 3 -> resume exact;
  ``lightning-shard consolidate``.
* ``world2`` (gpu_world2.py): two ranks on the one GPU: which collectives gloo runs on CUDA tensors (and whether NCCL
  takes two ranks on one device), then the engine at world 2 against one process, for each strategy that can.
* ``perf`` (gpu_perf.py): a ~1B-parameter recipe GPT in bf16-mixed: peak memory per strategy against plain training and
  FSDP2 ``fully_shard``, tokens/s and MFU side by side, with the profiler's phase labels.
* ``tests`` (gpu_tests.py): the suite's GPU-only tests (found by their ``skipif`` on CUDA), run by node id.

Writes ``gpu_check_<hardware>_<date>.json`` and ``.md`` (``naming.py``: e.g. ``gpu_check_h200_2026-12-06``;
``--cpu``: ``gpu_check_cpu<cores>_<date>``) under ``--out-dir`` (default ``bench/results``) after every check. Exit
status: 0 every check passed; 1 a check failed (the first one is printed with its numbers; without ``--keep-going``
nothing runs after it); 3 a phase ran out of its time budget. Nothing here asserts a speed: the
speed goals (<= 3% against plain training, at least FSDP2's tokens/s) are reported.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench/ modules, however this file is started

from gpu_common import (  # noqa: E402
    EXIT_FAIL,
    EXIT_INCOMPLETE,
    EXIT_PASS,
    PHASES,
    REPO,
    CheckFailed,
    OutOfTime,
    Recorder,
    load_doc,
    machine_info,
    out_paths,
    quiet_lightning,
    save_doc,
)
from naming import result_stem  # noqa: E402

# seconds each phase may take (CUDA: ~6 minutes in all on one H200; CPU: tiny sizes, about a minute and a half on 2
# cores); a phase that ends early leaves its time to the next ones; --budget-s bounds the whole run
PHASE_BUDGET = {"cuda": {"parity": 100, "world2": 50, "perf": 160, "tests": 50},
                "cpu": {"parity": 60, "world2": 45, "perf": 45, "tests": 45}}
DEFAULT_BUDGET = {"cuda": 360, "cpu": 240}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true",
                   help="tiny sizes on CPU with gloo (CI); results in gpu_check_cpu<cores>_<date>.*")
    p.add_argument("--out-dir", default=str(REPO / "bench" / "results"),
                   help="where gpu_check_<hardware>_<date>.json / .md go (naming.py; default bench/results)")
    p.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES))
    p.add_argument("--budget-s", type=float, default=None,
                   help=f"the whole run's time budget in seconds (default {DEFAULT_BUDGET})")
    p.add_argument("--keep-going", action="store_true",
                   help="record every failed check and run every phase (still exits 1) instead of stopping at the "
                        "first failure")
    p.add_argument("--perf", nargs="*", default=[], metavar="KEY=VALUE",
                   help="override the memory/speed model or schedule, e.g. n_layer=16 batch_size=4 rounds=1")
    p.add_argument("--perturb", action="append", default=[], metavar="RUN=DELTA",
                   help="test hook (tests/bench/test_gpu_check.py): add DELTA to one weight of the run whose id "
                        "matches RUN (fnmatch), e.g. 'parity/small_tf/32-true/zero2=1e-3'")
    p.add_argument("--worker", choices=PHASES, help=argparse.SUPPRESS)  # one phase, in its own process
    p.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)  # the worker's, epoch seconds
    p.add_argument("--stem", default=None, help=argparse.SUPPRESS)  # the result's file name: the orchestrator's
    args = p.parse_args(argv)
    if args.stem is None:  # named once per run (the orchestrator hands it to every worker): one file across midnight
        args.stem = result_stem("gpu_check", device="cpu" if args.cpu else "cuda")
    return args


# ============================================================================================ one phase (worker)
def run_worker(args: argparse.Namespace) -> int:
    import importlib

    quiet_lightning()
    if args.cpu:
        import torch

        torch.set_num_threads(1)
    rec = Recorder(args, args.worker)
    doc = load_doc(args)
    doc["machine"].update(machine_info("cpu" if args.cpu else "cuda"))
    save_doc(args, doc)
    module = importlib.import_module({"parity": "gpu_parity", "world2": "gpu_world2", "perf": "gpu_perf",
                                      "tests": "gpu_tests"}[args.worker])
    try:
        module.run(rec)
    except CheckFailed:
        rec.finish("fail")
        return EXIT_FAIL
    except OutOfTime:
        rec.finish("incomplete")
        return EXIT_INCOMPLETE if not rec.failed else EXIT_FAIL
    except Exception as err:  # noqa: BLE001 - a crash is a failed check, loudly
        try:
            rec.error(f"{args.worker}/crash", err, "the phase raised")
        except CheckFailed:
            pass
        rec.finish("fail")
        return EXIT_FAIL
    rec.finish("fail" if rec.failed else "pass")
    return EXIT_FAIL if rec.failed else EXIT_PASS


# ============================================================================================ the run (orchestrator)
def worker_env(args: argparse.Namespace, phase: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    if args.cpu:
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        if phase == "perf":  # glibc returns large frees, so peak RSS follows live tensors ("Design rules" 9)
            env.update(MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="65536")
    return env


def run_phase(args: argparse.Namespace, phase: str, timeout: float) -> tuple[int, float, bool]:
    """The phase's worker, killed with its whole process group (its ranks included) past ``timeout``."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", phase, "--deadline", str(time.time() + timeout),
            "--out-dir", str(args.out_dir), "--stem", args.stem]
    argv += ["--cpu"] * args.cpu + ["--keep-going"] * args.keep_going
    argv += [a for item in args.perturb for a in ("--perturb", item)]
    argv += ["--perf", *args.perf] if args.perf else []
    t = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=REPO, env=worker_env(args, phase), start_new_session=True)

    def stop(signum: int, frame: Any) -> None:  # this run is being stopped: its worker and ranks go with it
        os.killpg(proc.pid, signal.SIGKILL)
        raise SystemExit(128 + signum)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        rc = proc.wait(timeout=timeout + 15)  # the worker stops itself at its deadline; 15 s of grace
        return rc, time.perf_counter() - t, False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return EXIT_INCOMPLETE, time.perf_counter() - t, True
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.worker:
        return run_worker(args)
    mode = "cpu" if args.cpu else "cuda"
    budget = args.budget_s or DEFAULT_BUDGET[mode]
    t0 = time.time()
    out_json, out_md = out_paths(args)
    out_json.unlink(missing_ok=True)  # this run's document only
    doc = load_doc(args)
    doc.update(command=" ".join(["python3" if not args.cpu else Path(sys.executable).name, *sys.argv]),
               budget_s=budget, phases_requested=args.phases, started=time.strftime("%Y-%m-%d %H:%M:%S"))
    save_doc(args, doc)
    status = EXIT_PASS
    for i, phase in enumerate(args.phases):
        later = sum(PHASE_BUDGET[mode][p] for p in args.phases[i + 1:])
        remaining = budget - (time.time() - t0)
        timeout = min(remaining, max(PHASE_BUDGET[mode][phase], remaining - later))  # its share, plus any slack
        print(f"\n=== gpu_check {phase} ({mode}): up to {max(timeout, 0):.0f} s ===", flush=True)
        if timeout < 10:
            rc, wall, killed = EXIT_INCOMPLETE, 0.0, False
            doc = load_doc(args)
            doc["phases"][phase] = {"status": "skipped: out of budget", "checks": [], "notes": []}
            save_doc(args, doc)
        else:
            rc, wall, killed = run_phase(args, phase, timeout)
        doc = load_doc(args)
        sec = doc["phases"].setdefault(phase, {"status": "did not start", "checks": [], "notes": []})
        sec.update(exit_code=rc, wall_s=wall, budget_s=timeout)
        if killed:
            sec["status"] = "killed at its time budget"
            sec["notes"].append(f"killed after {wall:.0f} s (budget {timeout:.0f} s): the results above are partial")
        elif rc not in (EXIT_PASS, EXIT_FAIL, EXIT_INCOMPLETE):
            sec["status"] = f"worker died (exit {rc})"
        save_doc(args, doc)
        if rc == EXIT_FAIL or rc not in (EXIT_PASS, EXIT_INCOMPLETE):
            status = EXIT_FAIL
            if not args.keep_going:
                break
        elif rc == EXIT_INCOMPLETE and status == EXIT_PASS:
            status = EXIT_INCOMPLETE
    doc = load_doc(args)
    doc["status"] = {EXIT_PASS: "pass", EXIT_FAIL: "fail", EXIT_INCOMPLETE: "incomplete"}[status]
    doc["wall_s"] = time.time() - t0
    save_doc(args, doc)
    summary = out_md.read_text().split("\n## ", 1)[0]  # the title, the machine and the table of phases
    print(f"\n{summary}\nwrote {out_json} and {out_md} ({doc['status']}, {doc['wall_s']:.0f} s)", flush=True)
    first = doc.get("first_failure")
    if first:
        print(f"GPU CHECK FAILED (first failure): {first['name']}: "
              f"{first.get('error') or json.dumps({k: first.get(k) for k in ('what', 'value', 'op', 'bound')})}",
              file=sys.stderr, flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
