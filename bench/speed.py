"""The speed suite (``bench_speed.py``): tokens/s of ours and the peers side by side, and where the step time goes.

Three tables, each a set of row sets run by the same driver as the peak suite (``driver.run_suite``: every variant
in fresh processes, N CPU ranks x 1 thread, gloo; repeats in alternating order ABC CBA ABC), every strategy with its
default knobs, the DDP baseline without the counting comm hook (nothing patched into any peer):

* ``main`` (the suite's result) -> ``bench/results/speed_<hardware>_<date>.{json,md}``: Hugging Face GPT-2 6 x 384
  (vocab 16384, ~17M parameters, micro-batch 8 x 128 per rank) and the recipe GPT 6 x 512 (vocab 8192, 23M,
  micro-batch 4 x 128), world 2: Lightning DDP, ZeroRedundancyOptimizer, zero1, zero2, FSDP2, zero3, fsdp_shard (and
  DeepSpeed ZeRO-1/2/3 where installed); tokens/s is the **best** of the repeats, ratios against Lightning DDP and
  torch FSDP2, plain and paired (per round).
* ``scaling`` (``--tables scaling``) -> ``speed_scaling_<hardware>_<date>``: world 1, 2 and 4 on the same per-rank
  batch; efficiency = tokens/s(N) / (N x tokens/s(1)) per variant. On a 2-core machine world 4 runs 4 ranks on 2
  cores: its efficiency is at most 0.5.
* ``sizes`` (``--tables sizes``) -> ``speed_sizes_<hardware>_<date>``: step time against parameter count (recipe GPT
  4 x 256, 6 x 512, 8 x 768) and, at about the same count, against the number of parameter tensors (24 x 256: 4x the
  tensors of 6 x 512).

The engine's overhead at world 1 is its own suite (``bench_world1.py``: paired steps in one process).

Per variant, rank 0, seconds per step: the wall time of forward / backward (incl. gradient sync) / optimizer (incl.
parameter sync) / between steps (a step's batch end to the next one's start) over the timed steps, and of each the
part the main thread was off the CPU (wall - its CPU time:
blocked in a collective's wait, or preempted), measured the same way for every variant; then the profiler labels
of a window of extra steps after the timed ones: ours (``lightning_shard.*``: engine phases, each collective's launch
and wait), FSDP2's ``FSDP::*``, DDP's forward, the optimizer step.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from naming import result_stem
from variants import DEEPSPEED, model_param_count

TABLES = ("main", "scaling", "sizes")
GPT2 = dict(model="hf_gpt2", n_layer=6, n_embd=384, n_head=6, vocab=16384, batch_size=8)
RECIPE = dict(model="gpt", n_layer=6, n_embd=512, n_head=8, vocab=8192, batch_size=4)
SIZES = [dict(RECIPE, n_layer=4, n_embd=256), dict(RECIPE), dict(RECIPE, n_layer=8, n_embd=768),
         dict(RECIPE, n_layer=24, n_embd=256)]
VARIANTS = {
    "scaling": ("ddp", "zero1", "zero2", "zero3", "fsdp_shard", "fsdp2"),
    "sizes": ("ddp", "zero2", "zero3", "fsdp_shard", "fsdp2"),
}
# the labels of the phase table, in order (``measure.LABEL_PREFIXES`` families; a label a variant lacks is "-")
OUR_LABELS = ("post_backward", "reduce_launch", "reduce_wait", "param_gather_launch", "param_gather_wait",
              "gather_launch", "gather_wait", "prepare_step", "finish_step")
FSDP_LABELS = ("FSDP::pre_forward", "FSDP::all_gather", "FSDP::all_gather_copy_out", "FSDP::post_backward_reduce",
               "FSDP::post_backward_rs_wait")


def row_sets(args: argparse.Namespace, table: str) -> list[tuple[str, argparse.Namespace]]:
    """``(title, args)`` per row set of ``table``: the driver's arguments with the model, batch and world set."""
    # the smoke run (``--quick``): every row set at a tiny size, the same code paths
    tiny = {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab": 512, "batch_size": 2} if args.quick else {}

    def at(tag: str, spec: dict[str, Any], **extra: Any) -> tuple[str, argparse.Namespace]:
        a = argparse.Namespace(**vars(args))
        for k, v in {**spec, **tiny, **extra}.items():
            setattr(a, k, v)
        return tag, a

    model = GPT2 if args.model in (None, "hf_gpt2") else RECIPE
    if table == "main":
        both = [at("hf_gpt2", GPT2), at("gpt", RECIPE)]
        return [s for s in both if s[1].model == args.model] if getattr(args, "model_given", False) else both
    if table == "scaling":
        return [at(f"world {n}", model, devices=n) for n in (1, 2, 4)]
    if args.sizes:  # ``--sizes``: these row sets instead of the four
        return [at("gpt", dict(RECIPE, n_layer=n, n_embd=e, n_head=h)) for n, e, h in args.sizes]
    return [at("gpt", s) for s in SIZES]


def table_variants(args: argparse.Namespace, table: str, default: tuple[str, ...]) -> list[str]:
    chosen = args.variants if args.variants_given else list(VARIANTS.get(table, default))
    if table in ("scaling", "sizes"):  # DeepSpeed only in the main table
        chosen = [v for v in chosen if v not in DEEPSPEED]
    return chosen


def run_speed(args: argparse.Namespace, run_suite: Any, env: dict[str, str], machine: dict[str, Any],
              default: tuple[str, ...]) -> list[str]:
    """Every table named by ``--tables``; the files written."""
    written = []
    for table in args.tables:
        t0 = time.perf_counter()
        variants = table_variants(args, table, default)
        sets = []
        for title, a in row_sets(args, table):
            tmp = Path(args.out_dir) / f"speed_{table}.tmp"
            tmp.mkdir(parents=True, exist_ok=True)
            n = model_param_count(a)
            print(f"[{table}] {title}: {n / 1e6:.1f}M params, world {a.devices}, micro-batch {a.batch_size} x "
                  f"{a.block_size}; variants {' '.join(variants)}", flush=True)
            t_set = time.perf_counter()
            title = f"{title} {a.n_layer}x{a.n_embd}"
            tag = f"{title.replace(' ', '_')}."
            results = run_suite(a, "speed", [v for v in variants if not (a.devices == 1 and v == "zero_r")], tmp,
                                env, {}, tag)
            sets.append({"title": title, "world": a.devices, "params": n, "tensors": tensor_count(a),
                         "model": {k: getattr(a, k) for k in ("model", "n_layer", "n_embd", "n_head", "vocab",
                                                               "block_size", "batch_size")},
                         "results": results, "wall_s": time.perf_counter() - t_set})
        doc = {"suite": "speed", "table": table, "machine": machine, "wall_s": time.perf_counter() - t0,
               "command": " ".join([Path(sys.executable).name] + sys.argv), "row_sets": sets}
        stem = result_stem("speed" if table == "main" else f"speed_{table}")  # naming.py
        out_json, out_md = Path(args.out_dir) / f"{stem}.json", Path(args.out_dir) / f"{stem}.md"
        # ``--out-json`` / ``--out-md`` name the table's files (with several tables the driver refuses them)
        out_json = Path(args.out_json) if args.out_json else out_json
        out_md = Path(args.out_md) if args.out_md else out_md
        out_json.parent.mkdir(parents=True, exist_ok=True)
        out_json.write_text(json.dumps(doc, indent=1))
        md = markdown_speed(doc)
        out_md.write_text(md)
        print("\n" + md, flush=True)
        written += [str(out_json), str(out_md)]
    return written


def tensor_count(args: argparse.Namespace) -> int:
    import torch
    from variants import build_model

    with torch.device("meta"):
        return len(list(build_model(args).parameters()))


# ============================================================================================ Markdown
def _f(x: Any, d: int = 3) -> str:
    return "-" if x is None else f"{x:.{d}f}"


def best(r: dict[str, Any]) -> float:
    return r.get("tokens_per_s_best", r.get("tokens_per_s_mean", 0.0))


def _ratio(r: dict[str, Any], base: dict[str, Any] | None) -> str:
    if not base or "error" in base or "error" in r or not best(base):
        return "-"
    return f"{best(r) / best(base):.3f}"


def paired(r: dict[str, Any], base: dict[str, Any] | None) -> list[float]:
    """Round by round, this variant's tokens/s over the baseline's in the same round (the runs of one round are
    run back to back, so a slow spell of the machine slows both): the per-round ratios, in round order."""
    if not base or "error" in base or "error" in r:
        return []
    return [a["tokens_per_s_mean"] / b["tokens_per_s_mean"]
            for a, b in zip(r.get("repeats", []), base.get("repeats", []))]


def _paired(r: dict[str, Any], base: dict[str, Any] | None) -> str:
    ratios = sorted(paired(r, base))
    if len(ratios) < 2:
        return "-"
    mid = len(ratios) // 2
    median = ratios[mid] if len(ratios) % 2 else (ratios[mid - 1] + ratios[mid]) / 2
    return f"{median:.3f} ({ratios[0]:.2f}-{ratios[-1]:.2f})"


def speed_rows(s: dict[str, Any], table: str, world1: dict[str, Any] | None = None) -> list[str]:
    res = s["results"]
    ddp, fsdp2 = res.get("ddp"), res.get("fsdp2")
    head = ("| variant | tokens/s (best) | runs | vs DDP | vs FSDP2 | vs DDP, paired: median (range) | "
            "vs FSDP2, paired |")
    sep = "| --- | ---: | --- | ---: | ---: | ---: | ---: |"
    if table == "scaling" and world1 is not None:
        head, sep = head + " efficiency |", sep + " ---: |"
    if table == "sizes":
        head, sep = head + " median step s |", sep + " ---: |"
    lines = [head, sep]
    for v, r in res.items():
        if "error" in r:
            lines.append(f"| {v} | failed: {r.get('error_line') or r['error']} | | | | | |")
            continue
        runs = "/".join(f"{x['tokens_per_s_mean']:.0f}" for x in r.get("repeats", []))
        row = (f"| {v} | {best(r):.0f} | {runs} | {_ratio(r, ddp)} | {_ratio(r, fsdp2)} | {_paired(r, ddp)} | "
               f"{_paired(r, fsdp2)} |")
        if table == "scaling" and world1 is not None:
            one = world1["results"].get(v)
            # tokens/s here is per rank: efficiency = total(N) / (N x total(1)) = per-rank(N) / per-rank(1)
            eff = best(r) / best(one) if one and "error" not in one and best(one) else None
            row += f" {_f(eff, 2)} |"
        if table == "sizes":
            row += f" {_f(sorted(r['median_step_s_per_rank'])[0])} |"
        lines.append(row)
    return lines


def phase_rows(s: dict[str, Any]) -> list[str]:
    lines = ["| variant | forward | (off-CPU) | backward+sync | (off-CPU) | optimizer+sync | (off-CPU) | "
             "between steps | (off-CPU) | step | CPU: main thread | CPU: other threads | CPU: all ranks | "
             "page faults / step, rank 0 / 1 / ... (mean of runs) | profiled labels (s/step) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for v, r in s["results"].items():
        if "error" in r:
            continue
        p, off = r["phase_s_per_step_rank0"], r.get("off_cpu_s_per_step_rank0") or {}
        cells = []
        for k in ("forward", "backward_and_grad_sync", "optimizer_and_param_sync", "between_steps"):
            cells += [_f(p.get(k)), _f(off.get(k))]
        lab = r.get("labels_s_per_step_rank0") or {}
        named = [(k, lab.get(f"lightning_shard.{k}")) for k in OUR_LABELS] + [(k, lab.get(k)) for k in FSDP_LABELS]
        named += [(k, x) for k, x in lab.items() if k.startswith("DistributedDataParallel.")]
        text = ", ".join(f"{k.replace('FSDP::', 'FSDP ')} {x:.3f}" for k, x in named if x)
        each = r.get("minor_faults_per_step_per_rank")
        faults = " / ".join(_f(x, 0) for x in each) if each else _f(r.get("minor_faults_per_step_rank0"), 0)
        cpu = r.get("cpu_s_per_step_rank0") or {}
        other = cpu["process"] - cpu["main"] if cpu else None
        cpu_cells = f"{_f(cpu.get('main'))} | {_f(other)} | {_f(r.get('process_cpu_s_per_step_all_ranks'))}"
        lines.append(f"| {v} | {' | '.join(cells)} | {sum(p.values()):.3f} | {cpu_cells} | {faults} | "
                     f"{text or '-'} |")
    return lines


def markdown_speed(doc: dict[str, Any]) -> str:
    m = doc["machine"]
    title = {"main": "Speed: ours and the peers side by side", "scaling": "Speed: scaling over world 1, 2, 4",
             "sizes": "Speed: step time against model size and against the number of parameter tensors"}[doc["table"]]
    lines = [f"# {title}", "",
             f"{m['cores']} cores ({m['cpu']}), CPU ranks x 1 thread, gloo; torch {m['torch']}, lightning "
             f"{m['lightning']}, python {m['python']}. fp32 AdamW, seq {m['model']['block_size']}; "
             f"{m['warmup_steps']} warmup + {m['timed_steps']} timed steps per run, {m['repeats']} runs per variant in "
             "alternating order (ABC CBA ...); tokens/s per rank between the first and the last timed step, the "
             "best run's; paired: the median (and range) over rounds of the ratio of runs in the same round, which "
             "a slow spell of the machine affects less; every strategy with default knobs; "
             f"bucket_mb={m['bucket_mb']}; profiler window "
             f"{m.get('profile_steps')} steps after the timed ones.",
             f"Command: `{doc['command']}` (wall {doc['wall_s']:.0f} s).", ""]
    world1 = doc["row_sets"][0] if doc["table"] == "scaling" else None
    for s in doc["row_sets"]:
        mm = s["model"]
        lines += [f"## {s['title']}: {s['params'] / 1e6:.2f}M parameters in {s['tensors']} tensors, world "
                  f"{s['world']}, micro-batch {mm['batch_size']} x {mm['block_size']} per rank", ""]
        lines += speed_rows(s, doc["table"], world1 if s is not world1 else None)
        lines += ["", "Where the step goes (rank 0, s per step; between steps: from a step's batch end to the "
                  "next one's batch start, the loop, the next batch and what the step left running (zero1/2's "
                  "post-step all-gather), so that the phases add up to 1 / throughput; off-CPU = wall - main-thread "
                  "CPU: waits and preemption; CPU over the timed steps: rank 0's main thread, its other threads "
                  "(gloo's, the profiler's, the data loader's), and every thread of every rank together, which on a "
                  "machine with one core per rank bounds the step from below):", ""]
        lines += phase_rows(s) + [""]
    return "\n".join(lines) + "\n"
