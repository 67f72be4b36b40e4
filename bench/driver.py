"""Command line and multi-process driver of the peak and speed suites (``bench_peak.py`` and ``bench_speed.py`` are
their entry points, ``bench_budget.py`` measures through :func:`run_one`; ``python bench/driver.py --variant V
--rank-out P`` is one variant's run).

Each suite is a table of variants trained on the same model (Hugging Face GPT-2 by default, ``--model gpt`` the recipe
``lightning_shard.recipes.gpt.GPT``; synthetic tokens, fixed seed, AdamW), each variant in a fresh Python process with
N CPU ranks (gloo, 1 thread per rank):

* ``peak`` -> ``bench/results/peak_<hardware>_<date>.{json,md}`` (``bench_peak.py``): peak memory per rank of ``ddp``,
  ``zero0``, ``zero1``, ``zero2``, ``fsdp2``, ``zero3``, ``fsdp_shard`` (default options), every rank started with
  ``MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=65536`` so that glibc returns large frees and the peak follows
  live tensors; against the ZeRO formula's saving per rung. ``--sizes 6x384 24x512`` adds row sets of other sizes to
  the same table.
* ``speed`` -> ``bench/results/speed_<hardware>_<date>.{json,md}`` (``bench_speed.py``, its tables: ``speed.py``).

Every variant uses a launcher that starts each rank as its own fresh interpreter, so peak RSS is per rank. Where
the modules are: ``variants.py`` (suites, model, module and strategy per variant), ``rank.py`` (one rank's fit),
``measure.py`` (what a rank measures, its result file), ``wire.py`` (bytes on the wire), ``peak.py`` (the peak
table), ``naming.py`` (the result's file name).

No speed thresholds: this script reports, it does not judge.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

from naming import result_stem
from peak import PEAK_MALLOC_ENV, add_planner, code_state, markdown_peak, peak_fields, sizes_of
from variants import MODELS, NOTES, SUITES, VARIANTS, model_param_count, suite_variants, unit_param_counts

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
def machine_info(args: argparse.Namespace) -> dict[str, Any]:
    import lightning
    import torch

    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    n_params = model_param_count(args)
    return {
        "cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
        "lightning": lightning.__version__, "platform": platform.platform(), "ranks": args.devices,
        "threads_per_rank": 1, "backend": "gloo", "params": n_params, "param_mib_fp32": n_params * 4 / 2**20,
        "model": model_info(args),
        "micro_batch_per_rank": args.batch_size, "tokens_per_step_per_rank": args.batch_size * args.block_size,
        "warmup_steps": args.warmup, "timed_steps": args.steps,
        "optimizer": "AdamW(lr=3e-4, betas=(0.9,0.95), wd=0.1/0)",
        "bucket_mb": args.bucket_mb, "comm_hook": args.comm_hook, "repeats": args.repeats,
        "profile_steps": args.profile_steps,
    } | ({"malloc_env": PEAK_MALLOC_ENV, "code": code_state()} if args.suite == "peak" else {})


def model_info(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {k: getattr(args, k) for k in ("vocab", "block_size", "n_layer", "n_head", "n_embd")}
    if args.model != "gpt" or args.suite == "peak":  # the other suites' JSON as before for the recipe GPT
        out["kind"] = args.model
    if args.suite == "peak":
        n = model_param_count(args)
        out.update(params=n, param_mib_fp32=n * 4 / 2**20, units=unit_param_counts(args))
    return out


def child_argv(args: argparse.Namespace, variant: str, rank_out: Path) -> list[str]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--variant", variant, "--rank-out", str(rank_out),
            "--suite", args.suite, "--model", args.model]
    for k in ("steps", "warmup", "n_layer", "n_head", "n_embd", "vocab", "block_size", "batch_size", "bucket_mb",
              "seed", "devices", "profile_steps"):
        argv += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    if not args.comm_hook:
        argv.append("--no-comm-hook")
    return argv


def suite_outputs(args: argparse.Namespace, suite: str) -> tuple[Path, Path]:
    """``--out-json`` / ``--out-md``, else ``<out-dir>/<suite>_<hardware>_<date>.{json,md}`` (``naming.py``)."""
    stem = result_stem(suite)
    out_json = Path(args.out_json) if args.out_json else Path(args.out_dir) / f"{stem}.json"
    out_md = Path(args.out_md) if args.out_md else Path(args.out_dir) / f"{stem}.md"
    return out_json, out_md


def variant_env(suite: str) -> dict[str, str]:
    """The environment of a variant's rank processes: 1 thread; the peak suite also gets its malloc settings."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    if suite == "peak":  # this suite only (it never runs together with another)
        env.update(PEAK_MALLOC_ENV)
    return env


def run_all(args: argparse.Namespace) -> None:
    env = variant_env(args.suite)
    info = machine_info(args)
    if args.suite == "speed":  # its own tables and row sets (speed.py)
        from speed import run_speed

        written = run_speed(args, run_suite, env, info, SUITES["speed"])
        print(f"wrote {', '.join(written)}")
        return
    suite = args.suite  # the peak suite: its row sets (``--sizes``), the planner beside the measurement
    print(f"model: {args.model} {info['params'] / 1e6:.1f}M params ({info['param_mib_fp32']:.0f} MiB fp32); "
          f"{args.devices} ranks x 1 thread; {args.warmup} warmup + {args.steps} timed steps; "
          f"{info['tokens_per_step_per_rank']} tokens/step/rank; suite {suite}; "
          f"env {' '.join(f'{k}={v}' for k, v in PEAK_MALLOC_ENV.items())}", flush=True)
    variants = [v for v in suite_variants(suite) if v in args.variants]
    tmp = Path(args.out_dir) / f"{suite}.tmp"  # per-rank files and logs (default: bench/results/<suite>.tmp)
    tmp.mkdir(parents=True, exist_ok=True)
    t_suite = time.perf_counter()
    row_sets = []
    for i, size_args in enumerate(sizes_of(args)):
        t_set = time.perf_counter()
        if i:
            n = model_param_count(size_args)
            print(f"row set {i + 1}: {size_args.n_layer} layers x {size_args.n_embd} wide, {size_args.n_head} "
                  f"heads: {n / 1e6:.1f}M params", flush=True)
        tag = "" if not i else f"{size_args.n_layer}x{size_args.n_embd}."
        results = run_suite(size_args, suite, variants, tmp, env, {}, tag)
        add_planner(size_args, results)  # the planner's prediction for the same job beside the measurement
        row_sets.append({"model": model_info(size_args), "results": results, "wall_s": time.perf_counter() - t_set})
    # the default size's rows are ``results``; further sizes, each with its model, in ``row_sets``
    doc = {"suite": suite, "machine": info, "command": " ".join([Path(sys.executable).name] + sys.argv),
           "wall_s": time.perf_counter() - t_suite, "results": row_sets[0]["results"],
           "row_set_wall_s": row_sets[0]["wall_s"], "row_sets": row_sets[1:]}
    out_json, out_md = suite_outputs(args, suite)
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(doc, indent=1))
    md = markdown_peak(doc)
    out_md.parent.mkdir(parents=True, exist_ok=True)
    out_md.write_text(md)
    print("\n" + md, flush=True)
    print(f"wrote {out_json}, {out_md}")


def run_suite(args: argparse.Namespace, suite: str, variants: list[str], tmp: Path, env: dict[str, str],
              done: dict[str, tuple[str, dict[str, Any]]], tag: str = "") -> dict[str, dict[str, Any]]:
    """Every variant of one table (repeats interleaved), merged; ``done``: variants an earlier table measured."""
    todo = [v for v in variants if v not in done]
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in todo}
    for rep in range(args.repeats):
        order = list(todo) if rep % 2 == 0 else list(reversed(todo))  # ABC CBA: spread drift
        for variant in order:
            runs[variant].append(run_one(args, variant, rep, tmp, env, tag))
    results: dict[str, dict[str, Any]] = {}
    for v in variants:
        if v in done:  # measured in an earlier table of this invocation: reuse, say so
            results[v] = dict(done[v][1], reused_from_suite=done[v][0])
        else:
            results[v] = merge_repeats(v, runs[v])
            if suite != "peak":  # its own model and environment: nothing shared with another table
                done[v] = (suite, results[v])
    tps = "tokens_per_s_best" if suite == "speed" else "tokens_per_s_mean"  # speed: the best run of each variant
    for key, base_variant in (("ratio_vs_ddp", "ddp"), ("ratio_vs_fsdp2", "fsdp2")):
        base = results.get(base_variant, {}).get(tps)
        if base_variant in results:
            for r in results.values():
                if "error" not in r:
                    r[key] = r[tps] / base if base else None
    return results


def run_one(args: argparse.Namespace, variant: str, rep: int, tmp: Path, env: dict[str, str],
            tag: str = "") -> dict[str, Any]:
    rank_out = tmp / f"{tag}{variant}.r{rep}.json"
    for r in range(args.devices):
        rank_out.with_suffix(f".rank{r}.json").unlink(missing_ok=True)
    log_path = tmp / f"{tag}{variant}.r{rep}.log"
    code0 = code_state()["lightning_shard_py_sha256"] if args.suite == "peak" else None
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run(child_argv(args, variant, rank_out), cwd=REPO, env=env, stdout=log,
                                  stderr=subprocess.STDOUT, timeout=args.timeout)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    files = [rank_out.with_suffix(f".rank{r}.json") for r in range(args.devices)]
    deadline = time.time() + (60 if rc == 0 else 0)
    while not all(f.exists() for f in files) and time.time() < deadline:
        time.sleep(0.5)
    wall = time.perf_counter() - t0
    code = {} if code0 is None else {"code_sha256_start": code0,
                                     "code_sha256_end": code_state()["lightning_shard_py_sha256"]}
    exit_error = None
    if rc != 0 and args.suite == "peak" and all(f.exists() for f in files):
        # every rank wrote its result (end of training) and then the job failed (e.g. a crash at interpreter exit):
        # the peak suite keeps the measurement and reports the exit beside it
        tail = log_path.read_text()[-3000:]
        try:
            ranks = [json.loads(f.read_text()) for f in files]
            exit_error = {"rc": rc, "error_line": error_line(tail), "log_tail": tail}
            print(f"[{variant} #{rep}] exited rc={rc} AFTER every rank wrote its result ({exit_error['error_line']}); "
                  "results kept, exit reported", flush=True)
        except ValueError:
            pass
    if exit_error is None and (rc != 0 or not all(f.exists() for f in files)):
        tail = log_path.read_text()[-3000:]
        print(f"[{variant} #{rep}] FAILED (rc={rc}); log tail:\n{tail}", flush=True)
        return {"variant": variant, "note": NOTES[variant], "error": f"rc={rc}", "error_line": error_line(tail),
                "log_tail": tail, "variant_wall_s": wall, **code}
    if exit_error is None:
        time.sleep(0.5)  # let the last rank finish writing
        ranks = [json.loads(f.read_text()) for f in files]
    r = summarize(variant, ranks, wall)
    r.update(code)
    if exit_error is not None:
        r["exit_error"] = exit_error
    print(f"[{variant} #{rep}] {r['tokens_per_s_mean']:.0f} tok/s/rank, model state "
          f"{'/'.join(f'{x:.1f}' for x in r['model_state_mib_per_rank'])} MiB (opt "
          f"{'/'.join(f'{x:.1f}' for x in r['optimizer_state_mib_per_rank'])}), "
          f"peak RSS {r['peak_rss_mib_max']:.0f} MiB, wire {r['wire_mib_per_step_per_rank']:.1f} MiB/step, "
          f"final loss {r['final_loss_rank0']:.4f} ({wall:.0f}s)", flush=True)
    return r


def error_line(log_tail: str) -> str:
    """The last line of a failed run's log that names an exception (else its last line)."""
    lines = [ln.strip() for ln in log_tail.splitlines() if ln.strip()]
    for ln in reversed(lines):
        head = ln.split(":", 1)[0]
        if head.endswith(("Error", "Exception", "Interrupt")) or head in ("AssertionError", "Killed"):
            return ln[:300]
    return lines[-1][:300] if lines else ""


def merge_repeats(variant: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean tokens/s over repeats; memory and bytes from the first good run (they do not depend on timing)."""
    good = [r for r in runs if "error" not in r]
    if not good:
        return runs[0]
    out = dict(good[0])
    out["repeats"] = [{k: r.get(k) for k in ("tokens_per_s_mean", "tokens_per_s_per_rank", "median_step_s_per_rank",
                                             "phase_s_per_step_rank0", "engine_s_per_step_rank0", "variant_wall_s",
                                             "off_cpu_s_per_step_rank0", "minor_faults_per_step_rank0",
                                             "minor_faults_per_step_per_rank", "cpu_s_per_step_rank0",
                                             "process_cpu_s_per_step_all_ranks", "step_times_s_rank0")}
                      for r in good]
    out["failed_repeats"] = len(runs) - len(good)
    out["tokens_per_s_mean"] = sum(r["tokens_per_s_mean"] for r in good) / len(good)
    out["tokens_per_s_best"] = max(r["tokens_per_s_mean"] for r in good)
    out["tokens_per_s_rank0"] = sum(r["tokens_per_s_rank0"] for r in good) / len(good)
    if "train_peak_rss_mib_per_rank" in out:  # peak suite: every memory figure from one run (the first good one)
        out["peak_rss_mib_per_rank_each_repeat"] = [r["peak_rss_mib_per_rank"] for r in good]
    else:
        out["peak_rss_mib_max"] = max(r["peak_rss_mib_max"] for r in good)
        out["peak_rss_mib_per_rank"] = [max(r["peak_rss_mib_per_rank"][i] for r in good)
                                        for i in range(len(good[0]["peak_rss_mib_per_rank"]))]
    for key in ("phase_s_per_step_rank0", "engine_s_per_step_rank0", "off_cpu_s_per_step_rank0",
                "labels_s_per_step_rank0", "cpu_s_per_step_rank0"):  # the mean over the runs that have each figure
        names = dict.fromkeys(k for r in good for k in r.get(key, {}))
        out[key] = {k: sum(r[key][k] for r in good if k in r.get(key, {})) / sum(k in r.get(key, {}) for r in good)
                    for k in names}
    # page faults per step of each rank, the mean over the runs that counted them (the ranks of one run can differ
    # several-fold: glibc's heap is each process's own)
    counted = [r["minor_faults_per_step_per_rank"] for r in good
               if r.get("minor_faults_per_step_per_rank") and None not in r["minor_faults_per_step_per_rank"]]
    out["minor_faults_per_step_per_rank"] = [sum(c[i] for c in counted) / len(counted)
                                             for i in range(len(counted[0]))] if counted else None
    cpu_all = [r["process_cpu_s_per_step_all_ranks"] for r in good if r.get("process_cpu_s_per_step_all_ranks")]
    out["process_cpu_s_per_step_all_ranks"] = sum(cpu_all) / len(cpu_all) if cpu_all else None
    out["median_step_s_per_rank"] = [sorted(r["median_step_s_per_rank"][i] for r in good)[len(good) // 2]
                                     for i in range(len(good[0]["median_step_s_per_rank"]))]
    return out


def summarize(variant: str, ranks: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    mib = 2**20
    tps = [r["tokens_per_s"] for r in ranks]
    return {
        "variant": variant, "note": NOTES[variant], "variant_wall_s": wall,
        "tokens_per_s_rank0": tps[0], "tokens_per_s_mean": sum(tps) / len(tps), "tokens_per_s_per_rank": tps,
        "median_step_s_per_rank": [r["median_step_s"] for r in ranks],
        "step_times_s_rank0": ranks[0].get("step_times_s"),
        "optimizer_state_mib_per_rank": [round(r["optimizer_state_bytes"] / mib, 2) for r in ranks],
        "model_state_mib_per_rank": [round(r["model_state"]["total"] / mib, 2) for r in ranks],
        "model_state_bytes_each_rank": [r["model_state"] for r in ranks],
        "peak_rss_mib_per_rank": [round(r["peak_rss_bytes"] / mib, 1) for r in ranks],
        "peak_rss_mib_max": max(r["peak_rss_bytes"] for r in ranks) / mib,
        "wire_mib_per_step_per_rank": max(r["wire_bytes_per_step"] for r in ranks) / mib,
        "wire_mib_per_step_each_rank": [r["wire_bytes_per_step"] / mib for r in ranks],
        "wire_formula_mib_per_step": ranks[0]["wire_formula_bytes_per_step"] / mib,
        "wire_source": ranks[0]["wire_source"], "wire_detail_rank0": ranks[0]["wire_detail"],
        "phase_s_per_step_rank0": ranks[0]["phase_s_per_step"],
        "phase_s_per_step_rank1": ranks[-1]["phase_s_per_step"],
        "engine_s_per_step_rank0": ranks[0]["engine_s_per_step"],
        "off_cpu_s_per_step_rank0": ranks[0].get("off_cpu_s_per_step", {}),
        "labels_s_per_step_rank0": ranks[0].get("labels_s_per_step", {}),
        "minor_faults_per_step_rank0": ranks[0].get("minor_faults_per_step"),
        "minor_faults_per_step_per_rank": [r.get("minor_faults_per_step") for r in ranks],
        "cpu_s_per_step_rank0": ranks[0].get("cpu_s_per_step") or {},
        "process_cpu_s_per_step_all_ranks": (sum(r["cpu_s_per_step"]["process"] for r in ranks)
                                             if all(r.get("cpu_s_per_step") for r in ranks) else None),
        "model_state_rank0": ranks[0]["model_state"],
        "final_loss_rank0": ranks[0]["losses"][-1], "losses_rank0": ranks[0]["losses"],
        "torch_threads": ranks[0]["torch_threads"],
    } | (peak_fields(variant, ranks) if "train_peak_rss_bytes" in ranks[0] else {})


def parse_args(argv: Optional[list[str]] = None, default_suite: str = "peak",
               description: Optional[str] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(description or __doc__ or "").split("\n\n")[0])
    p.add_argument("--suite", choices=tuple(SUITES), default=default_suite,
                   help=f"which suite: peak {SUITES['peak']} or speed {SUITES['speed']} (default {default_suite})")
    p.add_argument("--model", choices=MODELS, default=None,
                   help="hf_gpt2: Hugging Face GPT2LMHeadModel (the default); gpt: the recipe GPT (the speed suite: "
                        "its main table runs both, --model narrows it to one)")
    p.add_argument("--sizes", nargs="+", default=[], metavar="LxE[xH]",
                   help="peak suite: further row sets at these sizes (layers x width [x heads; default width/64 for "
                        "hf_gpt2]), e.g. --sizes 24x512 for ~84M parameters; the run's own size comes first. Speed "
                        "suite: the sizes table's row sets instead of its four (recipe GPT)")
    p.add_argument("--variants", nargs="+", default=None, choices=VARIANTS,
                   help="these variants, the suite's own and its opt-in ones (default: the suite's table)")
    p.add_argument("--steps", type=int, default=None, help="timed optimizer steps per variant")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps before timing")
    p.add_argument("--n-layer", type=int, default=None)
    p.add_argument("--n-head", type=int, default=None, help="default 8 (gpt), width/64 (hf_gpt2)")
    p.add_argument("--n-embd", type=int, default=None)
    p.add_argument("--vocab", type=int, default=None, help="default 16384 (the speed suite's recipe GPT rows 8192)")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=None, help="sequences per rank per step")
    p.add_argument("--repeats", type=int, default=None,
                   help="runs per variant, order reversed every other round; tokens/s is their mean")
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--profile-steps", type=int, default=None,
                   help="steps after the timed ones run under torch.profiler for the engine phase times (0: none; "
                        "default 2, peak suite 0)")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--tables", nargs="+", default=["main"], choices=("main", "scaling", "sizes", "all"),
                   help="speed suite: which tables (speed.py): main (ours and the peers, two models; the suite's "
                        "result), scaling (world 1/2/4), sizes; all: all three")
    p.add_argument("--quick", action="store_true", help="~1 minute smoke run per suite (smaller model, few steps)")
    p.add_argument("--no-comm-hook", dest="comm_hook", action="store_false",
                   help="plain DDP (no counting hook): DDP/ZeRO-R bytes are then computed, not measured")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per variant before giving up")
    p.add_argument("--out-dir", default=str(RESULTS),
                   help="where <suite>_<hardware>_<date>.json / .md go (naming.py; default bench/results)")
    p.add_argument("--out-json", default=None, help="JSON path instead (only when a single table runs)")
    p.add_argument("--out-md", default=None, help="Markdown path instead (only when a single table runs)")
    p.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # internal: one variant, one rank
    p.add_argument("--rank-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.model_given = args.model is not None  # speed suite: --model narrows the main table to that model
    if args.suite == "speed":  # per table row sets set model and batch (speed.py); DDP without a counting hook
        full = dict(model="hf_gpt2", repeats=3, steps=10, warmup=3, n_layer=6, n_embd=384, batch_size=8,
                    vocab=16384, profile_steps=2)
        quick = dict(full, repeats=1, steps=2, warmup=1, n_layer=2, n_embd=128, batch_size=2)
        args.comm_hook = False
    else:  # the peak suite: HF GPT-2 ~17M, a few steps (timing is not the point), no profiled steps
        full = dict(model="hf_gpt2", repeats=1, steps=3, warmup=2, n_layer=6, n_embd=384, batch_size=4, vocab=16384,
                    profile_steps=0)
        quick = dict(full, steps=1, warmup=1, n_layer=2, n_embd=192)
    for k, v in (quick if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)

    def heads(n_embd: int) -> int:
        return max(1, n_embd // 64) if args.model == "hf_gpt2" else 8

    explicit_heads = args.n_head
    if args.n_head is None:
        args.n_head = heads(args.n_embd)
    sizes = []
    for spec in args.sizes:
        try:
            dims = [int(x) for x in spec.lower().split("x")]
        except ValueError:
            dims = []
        if len(dims) not in (2, 3) or min(dims) < 1:
            p.error(f"--sizes {spec!r}: expected LAYERSxWIDTH or LAYERSxWIDTHxHEADS, e.g. 24x512")
        n_head = dims[2] if len(dims) == 3 else explicit_heads or heads(dims[1])
        if dims[1] % n_head:
            p.error(f"--sizes {spec}: width {dims[1]} is not divisible by {n_head} heads")
        sizes.append((dims[0], dims[1], n_head))
    args.sizes = sizes
    args.tables = ["main", "scaling", "sizes"] if "all" in args.tables else list(dict.fromkeys(args.tables))
    args.variants_given = args.variants is not None
    if args.variants is None:
        args.variants = list(SUITES[args.suite])
    elif not args.variant:
        stray = [v for v in args.variants if v not in suite_variants(args.suite)]  # the table's and the opt-in ones
        if stray:
            p.error(f"variant(s) {stray} are not in suite {args.suite}")
    if (args.out_json or args.out_md) and len(args.tables) > 1:
        p.error("--out-json/--out-md name one table's files; with several --tables use --out-dir")
    if args.n_embd % args.n_head:
        p.error(f"--n-embd {args.n_embd} is not divisible by --n-head {args.n_head}")
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.profile_steps < 0:
        p.error("--profile-steps must be >= 0")
    if args.steps < 1 or args.warmup < 1:
        p.error("--steps and --warmup must be >= 1 (the first step pays one-time setup costs)")
    return args


def main(default_suite: str = "peak", description: Optional[str] = None) -> None:
    args = parse_args(default_suite=default_suite, description=description)
    if args.variant:
        from rank import run_variant

        run_variant(args)
    else:
        run_all(args)


if __name__ == "__main__":
    main()
