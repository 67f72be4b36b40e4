"""The budget search and its table (``bench/bench_budget.py`` is the command line): for a fixed width, the largest
GPT depth (number of transformer blocks) whose measured whole-process peak (VmHWM, max over ranks) stays within a
per-rank budget, per variant.

Every measurement is one run of the peak suite's machinery (``driver.run_one``: a fresh Python process per
variant with N ranks, the suite's malloc environment ``peak.PEAK_MALLOC_ENV``, its per-rank result files merged by
``driver.summarize``), at a depth chosen here:

1. two depths (``--fit-depths``, default 2 and 6) -> a least-squares line peak(d) = a + b*d;
2. the line's largest depth within the budget, clamped between the largest depth measured to fit and the smallest
   measured not to, is measured next; the line is refitted over every point measured so far;
3. repeated until a depth that fits and the depth one above it that does not are both measured (or the depth cap
   ``--max-depth`` / the run cap ``--max-runs`` is hit, said so in the row).

The table reports measured facts (the largest depth measured to fit, its peak, the first depth measured not to fit);
the fit is the search guide and is reported beside them (slope, intercept, worst residual). Assumed: peak is
non-decreasing in depth (a measured violation is flagged in the row).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

from driver import machine_info, run_one, variant_env
from naming import result_stem
from peak import PEAK_MALLOC_ENV
from variants import NOTES, model_param_count, split_variant

MIB = 2**20
BORDERLINE_MIB = 5.0  # a first-over peak this close to the budget is flagged: a rerun could fit


def at_depth(args: argparse.Namespace, depth: int) -> argparse.Namespace:
    return argparse.Namespace(**dict(vars(args), n_layer=depth))


def measure(args: argparse.Namespace, variant: str, depth: int, tmp: Path, env: dict[str, str],
            tag: str = "d") -> dict[str, Any]:
    """One peak-suite run of ``variant`` at ``depth`` blocks; the fields the budget table needs."""
    a = at_depth(args, depth)
    t0 = time.perf_counter()
    r = run_one(a, variant, 0, tmp, env, tag=f"{tag}{depth}.")
    wall = time.perf_counter() - t0
    out: dict[str, Any] = {"depth": depth, "params": model_param_count(a), "wall_s": round(wall, 1),
                           "load_avg_1m": round(os.getloadavg()[0], 2)}
    if "error" in r:
        out.update(error=r["error"], error_line=r.get("error_line"), log_tail=r.get("log_tail", "")[-1500:])
        return out
    tokens_per_step = a.batch_size * a.block_size
    out.update(
        peak_mib=round(r["peak_rss_mib_max"], 1), peak_mib_per_rank=r["peak_rss_mib_per_rank"],
        train_peak_mib_per_rank=r.get("train_peak_rss_mib_per_rank"),
        baseline_mib_per_rank=r.get("baseline_rss_mib_per_rank"),
        # the timed window's mean step: tokens per step per rank / the window's tokens/s, mean over ranks
        step_s=round(tokens_per_step / r["tokens_per_s_mean"], 3) if r["tokens_per_s_mean"] else None,
        median_step_s_per_rank=[round(x, 3) for x in r["median_step_s_per_rank"] if x is not None],
        final_loss_rank0=r["final_loss_rank0"],
        model_state_mib_per_rank=r["model_state_mib_per_rank"],
    )
    for k in ("code_sha256_start", "code_sha256_end", "exit_error"):
        if k in r:
            out[k] = r[k] if k != "exit_error" else r[k].get("error_line")
    return out


def fit_line(points: list[tuple[int, float]]) -> Optional[tuple[float, float]]:
    """Least-squares (a, b) of peak = a + b*depth; None under two distinct depths."""
    if len({d for d, _ in points}) < 2:
        return None
    n = len(points)
    mx = sum(d for d, _ in points) / n
    my = sum(p for _, p in points) / n
    sxx = sum((d - mx) ** 2 for d, _ in points)
    b = sum((d - mx) * (p - my) for d, p in points) / sxx
    return my - b * mx, b


def predicted_depth(line: tuple[float, float], budget: float, cap: int) -> int:
    a, b = line
    if b <= 0:
        return cap
    return max(0, min(cap, math.floor((budget - a) / b)))


def search(args: argparse.Namespace, variant: str, budget: float, tmp: Path, env: dict[str, str],
           log=print, prior: Optional[dict[tuple[str, int], dict[str, Any]]] = None) -> dict[str, Any]:
    """The largest depth in [1, max_depth] measured to fit ``budget`` (MiB, max over ranks) for one variant.
    ``prior``: good runs of an earlier invocation (same job), (variant, depth) -> run, taken instead of measuring
    again; a failed run is retried ``args.retries`` times (after a pause; the failed attempts are kept)."""
    runs: list[dict[str, Any]] = []
    failed: list[dict[str, Any]] = []
    by_depth: dict[int, dict[str, Any]] = {}

    def run(depth: int) -> dict[str, Any]:
        if prior and (variant, depth) in prior:
            m = dict(prior[(variant, depth)], reused=True)
        else:
            m = measure(args, variant, depth, tmp, env)
            for _ in range(getattr(args, "retries", 0)):
                if "error" not in m:
                    break
                log(f"  {variant} d={depth}: FAILED {m['error']} {m.get('error_line', '')}; retrying in 30 s")
                failed.append(m)
                time.sleep(30)
                m = measure(args, variant, depth, tmp, env)
        runs.append(m)
        by_depth[depth] = m
        if "error" in m:
            log(f"  {variant} d={depth}: FAILED {m['error']} {m.get('error_line', '')} ({m['wall_s']:.0f}s)")
        else:
            fits = "fits" if m["peak_mib"] <= budget else "over"
            log(f"  {variant} d={depth}: peak {m['peak_mib']:.0f} MiB/rank ({fits}), step {m['step_s']}s, "
                f"{m['params'] / 1e6:.1f}M params ({m['wall_s']:.0f}s, load {m['load_avg_1m']})"
                + (" [reused]" if m.get("reused") else ""))
        return m

    first_guess = None
    stop = None
    for d in args.fit_depths:
        if "error" in run(d):
            stop = f"run at depth {d} failed"
            break
    while stop is None:
        ok = [m for m in by_depth.values() if "error" not in m]
        line = fit_line([(m["depth"], m["peak_mib"]) for m in ok])
        fit_d = [m["depth"] for m in ok if m["peak_mib"] <= budget]
        over_d = [m["depth"] for m in ok if m["peak_mib"] > budget]
        lo = max(fit_d, default=0)
        hi = min((d for d in over_d if d > lo), default=args.max_depth + 1)
        if hi == lo + 1:
            if hi > args.max_depth:
                stop = f"depth cap {args.max_depth} fits"
            break
        if line is None:
            stop = "no line to fit"
            break
        guess = predicted_depth(line, budget, args.max_depth)
        if first_guess is None:
            first_guess = guess
        nxt = min(max(guess, lo + 1), hi - 1)
        if nxt in by_depth:  # (cannot happen with lo/hi from the measured points; guard against a loop)
            stop = f"search stalled at depth {nxt}"
            break
        if len(runs) >= args.max_runs:
            stop = f"run cap {args.max_runs} reached"
            break
        if "error" in run(nxt):
            stop = f"run at depth {nxt} failed"
            break

    ok = sorted((m for m in by_depth.values() if "error" not in m), key=lambda m: m["depth"])
    line = fit_line([(m["depth"], m["peak_mib"]) for m in ok])
    fit_d = [m["depth"] for m in ok if m["peak_mib"] <= budget]
    over_d = [m["depth"] for m in ok if m["peak_mib"] > budget]
    best = max(fit_d, default=0)
    first_over = min((d for d in over_d if d > best), default=None)
    monotone = all(x["peak_mib"] <= y["peak_mib"] for x, y in zip(ok, ok[1:]))
    out: dict[str, Any] = {
        "variant": variant, "note": NOTES.get(variant, ""), "budget_mib": budget,
        "max_depth_fits": best, "bracketed": first_over == best + 1,
        "first_depth_over": first_over, "stopped": stop,
        "peak_mib_at_max": by_depth[best]["peak_mib"] if fit_d else None,
        "peak_mib_per_rank_at_max": by_depth[best]["peak_mib_per_rank"] if fit_d else None,
        "params_at_max": by_depth[best]["params"] if fit_d else None,
        "peak_mib_first_over": by_depth[first_over]["peak_mib"] if first_over is not None else None,
        "first_prediction": first_guess, "monotone": monotone,
        "runs": runs, "n_runs": len(runs), "n_reused": sum(1 for m in runs if m.get("reused")),
        "failed_attempts": failed, "wall_s": round(sum(m["wall_s"] for m in runs + failed), 1),
    }
    if line is not None:
        a, b = line
        out.update(intercept_mib=round(a, 1), slope_mib_per_block=round(b, 2),
                   max_residual_mib=round(max(abs(m["peak_mib"] - (a + b * m["depth"])) for m in ok), 1),
                   final_prediction=predicted_depth(line, budget, args.max_depth))
    return out


def planner_max_depth(args: argparse.Namespace, variant: str, r: dict[str, Any], budget: float) -> dict[str, Any]:
    """The planner's answer for the same budget: the largest depth whose predicted whole-process peak fits, where
    predicted peak(d) = the process's memory outside the model (measured once: the RSS at train start of the
    variant's shallowest run, max over ranks, minus the planner's ``at_setup`` for it) + ``peak_bytes(...)["total"]``
    at depth d. Only for the rows the planner has (``peak.planner_config``: not FSDP2, checkpointing, offload, bf16)."""
    from peak import planner_config, planner_predictions

    if planner_config(args, variant) is None:
        return {"note": "not modelled"}
    good = [m for m in r["runs"] if "error" not in m and m.get("baseline_mib_per_rank")]
    if not good:
        return {"note": "no run to take the process memory from"}
    first = min(good, key=lambda m: m["depth"])
    pred = planner_predictions(at_depth(args, first["depth"]), [variant])[variant]
    overhead = max(first["baseline_mib_per_rank"]) - pred["terms_mib"]["at_setup"]
    best, peaks = 0, {}
    for d in range(1, args.max_depth + 1):
        total = planner_predictions(at_depth(args, d), [variant])[variant]["predicted_total_mib"]
        peaks[d] = round(overhead + total, 1)
        if peaks[d] > budget:
            break
        best = d
    return {"max_depth": best, "overhead_mib": round(overhead, 1), "predicted_peak_mib": peaks,
            "overhead_from_depth": first["depth"]}


def step_times(rows: dict[str, dict[str, Any]], depth: int, key: str = "step_s") -> dict[str, Optional[float]]:
    """Each variant's timed-window step time at ``depth`` (``key="load_avg_1m"``: the load after that run; None
    where not measured there)."""
    out = {}
    for v, row in rows.items():
        ms = [m for m in row["runs"] if m["depth"] == depth and "error" not in m]
        out[v] = ms[0][key] if ms else None
    return out


# ------------------------------------------------------------------ the table
def _f(x: Any, fmt: str = "{:.0f}", none: str = "-") -> str:
    return none if x is None else fmt.format(x)


def markdown(doc: dict[str, Any]) -> str:
    m = doc["machine"]
    mod = m["model"]
    B = doc["budget_mib"]
    td = doc["time_depth"]
    rows = doc["results"]
    timed = any(r.get("time_run") for r in rows.values())
    if timed:  # the time pass: every variant at the time depth, back to back after the search
        st = {v: (r.get("time_run") or {}).get("step_s") for v, r in rows.items()}
        st_load = {v: (r.get("time_run") or {}).get("load_avg_1m") for v, r in rows.items()}
    else:
        st = step_times(rows, td)
        st_load = step_times(rows, td, "load_avg_1m")
    st_search = step_times(rows, td)
    base = st.get("ddp")
    load = doc["load_avg"]
    lines = [
        f"# Largest GPT depth within {B:.0f} MiB per rank (measured whole-process peak)",
        "",
        f"Model: Hugging Face GPT-2 (`{mod.get('kind', 'hf_gpt2')}`), width {mod['n_embd']}, {mod['n_head']} heads, "
        f"vocab {mod['vocab']}, seq {mod['block_size']}, tied embedding, dropout 0; depth (transformer blocks) "
        f"varied. Micro-batch {m['micro_batch_per_rank']} x {mod['block_size']} tokens per rank, AdamW fp32; "
        f"{m['warmup_steps']} warmup + {m['timed_steps']} timed steps per run. {m['ranks']} CPU ranks x "
        f"{m['threads_per_rank']} thread (gloo) on {m['cores']} cores ({m['cpu']}), shared with other workers "
        + (f"(1-min load average {load['start']:.1f} at start, {load['end']:.1f} at end)" if not doc.get("reused_from")
           else "(1-min load average of each invocation beside its command below)") + f"; torch {m['torch']}, "
        f"lightning {m['lightning']}. Every rank started with "
        f"`{' '.join(f'{k}={v}' for k, v in doc['malloc_env'].items())}` (the peak suite's environment).",
        f"Budget: **{B:.0f} MiB per rank** of the measured whole-process peak (VmHWM, max over ranks). "
        f"Command: `{doc['command']}` (wall {doc['wall_s'] / 60:.1f} min)" + reuse_line(doc) + ".",
        "",
        "Each run is one peak-suite run (`bench/driver.py` `run_one`: a fresh process per variant, per-rank results "
        "merged). Search: peak measured at depths " + " and ".join(str(d) for d in doc["fit_depths"]) + ", line "
        "peak(d) = a + b*d fitted, its largest depth within the budget measured next, the line refitted over all "
        "points, until a depth that fits and the depth above it that does not are both measured. **Max depth, its "
        "peak and the first depth over are measured**; a, b are the least-squares line over all of the variant's "
        "runs (the search guide; worst residual beside them); 'guess' = the first line's prediction.",
        "",
        f"| variant | max depth (measured) | planner's max depth | peak MiB/rank at it (r0 / r1) | params (M) at it | "
        f"first depth over: "
        f"peak | b MiB/block | a MiB | worst residual MiB | guess | runs (depth: peak MiB) | step s at depth {td} "
        "(load) | vs ddp |" + (f" search run's step s at depth {td} |" if timed else ""),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if timed else ""),
    ]
    for v, r in rows.items():
        runs = ", ".join(f"{m['depth']}: {m['peak_mib']:.0f}" if "error" not in m else f"{m['depth']}: FAILED"
                         for m in r["runs"])
        best = r["max_depth_fits"]
        flag = "" if r["bracketed"] else " (not bracketed: " + (r["stopped"] or "?") + ")"
        if not r["monotone"]:
            flag += " (peak not monotone in depth)"
        over = (f"{r['first_depth_over']}: {r['peak_mib_first_over']:.0f}" if r["first_depth_over"] is not None
                else "-")
        if r["first_depth_over"] is not None and r["peak_mib_first_over"] - B < BORDERLINE_MIB:
            over += f" (borderline: +{r['peak_mib_first_over'] - B:.1f})"
        per_rank = " / ".join(f"{x:.0f}" for x in r["peak_mib_per_rank_at_max"] or [])
        ratio = st[v] / base if st.get(v) and base else None
        pl = r.get("planner") or {}
        at = pl.get("predicted_peak_mib", {})
        at = at.get(str(best), at.get(best, "?"))  # JSON keys are strings after a reload
        planned = f"{pl['max_depth']} (predicted {at} MiB at {best})" if "max_depth" in pl else pl.get("note", "-")
        lines.append(
            f"| {v} | **{best}**{flag} | {planned} | {_f(r['peak_mib_at_max'])} ({per_rank or '-'}) | "
            f"{_f(r['params_at_max'] and r['params_at_max'] / 1e6, '{:.1f}')} | {over} | "
            f"{_f(r.get('slope_mib_per_block'), '{:.1f}')} | {_f(r.get('intercept_mib'))} | "
            f"{_f(r.get('max_residual_mib'), '{:.1f}')} | {_f(r.get('first_prediction'))} | {runs} | "
            f"{_f(st.get(v), '{:.2f}')} ({_f(st_load.get(v), '{:.1f}')}) | {_f(ratio, '{:.2f}x')} |"
            + (f" {_f(st_search.get(v), '{:.2f}')} |" if timed else ""))
    lines += [
        "",
        "Notes:",
        "",
        "- **Planner's max depth**: the largest depth whose predicted whole-process peak fits the budget, predicted "
        "peak = the process's memory outside the model (the variant's shallowest run: RSS at train start minus the "
        "planner's `at_setup`, measured once) + `planner.memory.peak_bytes` total at that depth; n/a where the planner "
        "has no such row (FSDP2, checkpointing, offload and bf16 variants are not modelled by the bench's planner "
        "column).",
        "- **Offload on a CPU-only machine**: host memory is the only memory here, so `offload_optimizer` / "
        "`offload_params` cannot lower the resident peak (they move tensors between two host buffers, and the "
        "host-side copies may add to it: see the knob line below); the offload rows are reported as measured, "
        "their cost (extra copies) shows in the step time, their saving would show only on an accelerator.",
        "- **Step time** = the timed window's mean step (tokens per step per rank / the window's tokens/s, mean "
        "over ranks) of " + ("a separate time pass after the search (every variant once more at depth "
                              f"{td}, back to back; the search's own run at depth {td} in the last column)"
                              if timed else f"the search's run at depth {td}")
        + f", one run of {m['timed_steps']} timed steps per variant, on a 2-core "
        "machine shared with other workers (load = the 1-min load average read right after that run; 2 = the "
        "two ranks alone): noisy, a factor of 2 or more between runs of one variant under changing load "
        "(compare the step times of the runs at other depths in the JSON); read only large ratios, with "
        "their loads.",
        "- Peak = VmHWM over the whole process (imports, setup and training), max over ranks; it includes the "
        "interpreter, torch, Lightning and transformers (the intercept a), not only tensors. Activation "
        "checkpointing variants recompute each block's forward in backward, so their slope b holds little "
        "activation memory.",
        "- Assumed: peak non-decreasing in depth (a row would say where a measurement contradicts it). One run per "
        f"depth: a first-over peak within {BORDERLINE_MIB:.0f} MiB of the budget is flagged 'borderline' (over as "
        "measured, but a budget that much larger, or a rerun outside the reproducibility below, would move the "
        "row's max depth up by one).",
    ]
    knobs = []
    for v, r in rows.items():
        base_v = split_variant(v)[0]
        if base_v == v or base_v not in rows:
            continue
        pk = {x: [m["peak_mib"] for m in rows[x]["runs"] if m["depth"] == td and "error" not in m] for x in (v, base_v)}
        if pk[v] and pk[base_v]:
            ratio = st[v] / st[base_v] if st.get(v) and st.get(base_v) else None
            gain = r["max_depth_fits"] - rows[base_v]["max_depth_fits"]
            knobs.append(f"{v} {pk[v][0] - pk[base_v][0]:+.0f} MiB, max depth {gain:+d}, step {_f(ratio, '{:.2f}x')}")
    if knobs:
        lines.append(f"- Each knob against its strategy without it (peak at depth {td}, max depth, step time of the "
                     "time pass): " + "; ".join(knobs) + ".")
    reps = [(v, r["time_run"]["peak_mib"] - m["peak_mib"]) for v, r in rows.items()
            for m in r["runs"] if r.get("time_run") and "error" not in r["time_run"] and "error" not in m
            and m["depth"] == td]
    if reps:
        worst = max(reps, key=lambda x: abs(x[1]))
        lines.append(f"- Peak reproducibility: the time pass measured every variant's peak at depth {td} again; "
                     f"it differs from the search's run by at most {abs(worst[1]):.1f} MiB ({worst[0]}; "
                     f"{len(reps)} variants).")
    for v, r in rows.items():
        for m in r["runs"]:
            if "error" in m:
                lines.append(f"- {v} failed at depth {m['depth']}: {m['error']} {m.get('error_line') or ''}")
    retried = [dict(m, variant=v) for v, r in rows.items() for m in r.get("failed_attempts", [])]
    retried += (doc.get("reused_from") or {}).get("failures", [])
    if retried:
        lines.append("- Failed attempts, measured again (not in the table): " + "; ".join(
            f"{m['variant']} at depth {m['depth']}: {m.get('error_line') or m['error']}" for m in retried) + ".")
    exits = [f"{v} at depth {m['depth']} ({m['exit_error']})" for v, r in rows.items() for m in r["runs"]
             if m.get("exit_error")]
    if exits:
        lines.append("- Exited non-zero after every rank had written its result (the driver keeps such a run's "
                     "measurement and reports the exit): " + "; ".join(exits) + ".")
    shas = {m[k] for r in rows.values() for m in r["runs"] for k in ("code_sha256_start", "code_sha256_end")
            if m.get(k)}
    if len(shas) > 1:
        lines.append(f"- The lightning_shard code on disk changed during this run ({len(shas)} versions of "
                     "`lightning_shard/**/*.py` seen; others were working in the repository): runs may have imported "
                     "different code (each run's `code_sha256_start`/`_end` in the JSON).")
    return "\n".join(lines) + "\n"


# what a run's peak depends on besides variant and depth: an earlier invocation's runs are reused only if all match
JOB_KEYS = ("model", "n_embd", "n_head", "vocab", "block_size", "batch_size", "steps", "warmup", "devices", "seed",
            "bucket_mb")


def job_of_machine(m: dict[str, Any], seed: int) -> dict[str, Any]:
    """The job of a budget JSON written without a ``job`` entry, from its machine block (its seed: the default)."""
    mod = m["model"]
    return {"model": mod.get("kind", "hf_gpt2"), "n_embd": mod["n_embd"], "n_head": mod["n_head"],
            "vocab": mod["vocab"], "block_size": mod["block_size"], "batch_size": m["micro_batch_per_rank"],
            "steps": m["timed_steps"], "warmup": m["warmup_steps"], "devices": m["ranks"], "seed": seed,
            "bucket_mb": m["bucket_mb"]}


def load_prior(args: argparse.Namespace, path: str) -> tuple[dict[tuple[str, int], dict[str, Any]], dict[str, Any]]:
    """Good runs of an earlier budget JSON for the same job (any budget: a run's peak does not depend on it)."""
    doc = json.loads(Path(path).read_text())
    job = {k: getattr(args, k) for k in JOB_KEYS}
    theirs = doc.get("job") or job_of_machine(doc["machine"], args.seed)
    if theirs != job:
        raise SystemExit(f"--reuse {path}: another job ({theirs}; this one {job})")
    prior = {}
    for v, row in doc["results"].items():
        for m in row["runs"]:
            if "error" not in m:
                prior[(v, m["depth"])] = m
    failures = [dict(m, variant=v) for v, row in doc["results"].items()
                for m in row["runs"] + row.get("failed_attempts", []) if "error" in m]
    for v, row in doc["results"].items():
        if row.get("time_run") and "error" not in row["time_run"]:
            prior[(v, "time")] = row["time_run"]
    earlier = doc.get("reused_from") or {}
    failures += earlier.get("failures", [])
    invocations = earlier.get("invocations") or ([{k: earlier[k] for k in ("command", "wall_s", "load_avg")}]
                                                 if "command" in earlier else [])
    invocations = invocations + [{"command": doc["command"], "wall_s": doc["wall_s"], "load_avg": doc["load_avg"]}]
    info = {"path": path, "invocations": invocations, "wall_s": sum(x["wall_s"] for x in invocations),
            "failures": failures}
    return prior, info


def reuse_line(doc: dict[str, Any]) -> str:
    r = doc.get("reused_from")
    if not r:
        return ""
    rows = doc["results"].values()
    n = sum(row.get("n_reused", 0) for row in rows) + sum(1 for row in rows if (row.get("time_run") or {}).get(
        "reused"))
    total = sum(row["n_runs"] for row in rows) + sum(1 for row in rows if row.get("time_run"))
    inv = "; ".join(f"`{x['command']}` (wall {x['wall_s'] / 60:.1f} min, load {x['load_avg']['start']:.1f} -> "
                    f"{x['load_avg']['end']:.1f})" for x in r["invocations"])
    return (f"; {n} of its {total} runs reused from earlier invocations (total wall of all "
            f"{len(r['invocations']) + 1}: {(r['wall_s'] + doc['wall_s']) / 60:.1f} min): {inv}"
            + ("; the failed runs among them were measured again" if r.get("failures") else ""))


def run_budget(args: argparse.Namespace) -> dict[str, Any]:
    prior, reused_from = load_prior(args, args.reuse) if getattr(args, "reuse", None) else ({}, None)
    tmp = Path(args.out_dir) / "budget.tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    env = variant_env("peak")
    t0 = time.perf_counter()
    load0 = os.getloadavg()[0]
    print(f"budget {args.budget_mib:.0f} MiB/rank; width {args.n_embd}, {args.n_head} heads, vocab {args.vocab}, "
          f"seq {args.block_size}, micro-batch {args.batch_size}; {args.devices} ranks; fit depths "
          f"{args.fit_depths}; variants {' '.join(args.variants)}", flush=True)
    rows = {}
    for v in args.variants:
        print(f"{v}:", flush=True)
        rows[v] = search(args, v, args.budget_mib, tmp, env, log=lambda s: print(s, flush=True), prior=prior)
        r = rows[v]
        print(f"  -> {v}: max depth {r['max_depth_fits']} (peak {r['peak_mib_at_max']}), b "
              f"{r.get('slope_mib_per_block')} MiB/block, a {r.get('intercept_mib')} MiB, {r['n_runs']} runs "
              f"({r['wall_s']:.0f}s)", flush=True)
    if getattr(args, "time_pass", False):  # every variant once more at the time depth, back to back
        print(f"time pass: every variant at depth {args.time_depth}", flush=True)
        for v in args.variants:
            if (v, "time") in prior:
                m = dict(prior[(v, "time")], reused=True)
            else:
                m = measure(args, v, args.time_depth, tmp, env, tag="t")
            rows[v]["time_run"] = m
            print(f"  {v} d={args.time_depth}: step {m.get('step_s')}s, peak {m.get('peak_mib')} MiB/rank "
                  f"(load {m['load_avg_1m']}){' [reused]' if m.get('reused') else ''}", flush=True)
    for v, r in rows.items():  # the planner's prediction for the same budget, beside the measurement
        r["planner"] = planner_max_depth(args, v, r, args.budget_mib)
    info = machine_info(at_depth(args, args.time_depth))
    doc = {
        "suite": "budget", "job": {k: getattr(args, k) for k in JOB_KEYS}, "budget_mib": args.budget_mib,
        "fit_depths": args.fit_depths,
        "time_depth": args.time_depth, "max_depth": args.max_depth, "max_runs": args.max_runs,
        "malloc_env": PEAK_MALLOC_ENV, "machine": info,
        "load_avg": {"start": load0, "end": os.getloadavg()[0]},
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "wall_s": time.perf_counter() - t0,
        "step_s_at_time_depth": step_times(rows, args.time_depth),
        "step_s_time_pass": {v: (r.get("time_run") or {}).get("step_s") for v, r in rows.items()},
        "results": rows,
    } | ({"reused_from": reused_from} if reused_from else {})
    out = Path(args.out_dir)
    stem = result_stem("budget")  # naming.py: budget_<hardware>_<date>
    (out / f"{stem}.json").write_text(json.dumps(doc, indent=1))
    md = markdown(doc)
    (out / f"{stem}.md").write_text(md)
    print("\n" + md, flush=True)
    print(f"wrote {out / stem}.json, {out / stem}.md")
    return doc
