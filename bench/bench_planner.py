"""Planner vs machine: the predicted step time of every strategy, calibrated and nominal, beside the measured one.

    .venv/bin/python bench/bench_planner.py                 # 3 sizes x 2 layouts x world 1, 2, 4
    .venv/bin/python bench/bench_planner.py --worlds 2 --sizes S --quick   # a smoke run

For each case (the recipe GPT, byte-level vocabulary 256, 128 tokens, micro-batch 4 per rank, fp32 AdamW, gloo, 1
thread per rank): a size (S ~0.4M, M ~3.1M, L ~10.6M parameters in the blocks) in two layouts of the same parameter
count, few large tensors (``wide``: 2-6 layers) and many small ones (``deep``: 8-24 layers, half the width), at
world 1, 2 and 4 (4 ranks on this machine's 2 cores):

* calibration (``lightning_shard.planner.calibrate``) of this machine for the world size, through the planner's own
  entry (``plan(..., calibrate=True)``) with a profile cache of this run's own (``LIGHTNING_SHARD_CACHE``): its cost
  in seconds, and whether the cached profile was reused (a world size's first case measures the collectives; later
  ones only the model's compute);
* the predicted seconds per optimizer step of zero0, zero1, zero2, zero3 and fsdp_shard (Lightning DDP planned as
  zero0) by the calibrated model and by the nominal one (datasheet rates; on CPU a nominal 0.1 TFLOP/s);
* the measured step: the driver's (``driver.run_suite``) median over the timed steps of rank 0's step time (batch
  start to batch end), each variant in fresh processes, default knobs (bench/variants.py); with ``--repeats N``, N
  runs of each variant interleaved and the median of their medians;
* ``zero_auto``: ``strategy=auto`` with ``calibrate=True`` on the same profile cache: which row it picked, what it
  predicted and measured, and whether its pick was the measured fastest (within the A/A noise of the machine).

Writes ``bench/results/planner_<hardware>_<date>.{json,md}``. It reports; it does not judge.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from driver import REPO, RESULTS, machine_info, parse_args, run_suite, variant_env  # noqa: E402
from naming import result_stem  # noqa: E402

SIZES = {  # name: (wide: layers, width, heads), (deep: layers, width, heads); equal parameters in the blocks
    "S": ((2, 128, 4), (8, 64, 4)),
    "M": ((4, 256, 4), (16, 128, 4)),
    "L": ((6, 384, 6), (24, 192, 6)),
}
VARIANTS = ("ddp", "zero0", "zero1", "zero2", "zero3", "fsdp_shard")
ROW = {"ddp": "zero0 (defer)", "zero0": "zero0 (defer)", "zero1": "zero1 (defer)", "zero2": "zero2 (defer)",
       "zero3": "zero3 (per_micro_batch)", "fsdp_shard": "fsdp_shard (per_micro_batch)"}
NOISE = 0.06  # paired A/A spread of one program's tokens/s on this machine (+-6%)
VOCAB, SEQ, MICRO = 256, 128, 4


def predict(layers: int, width: int, heads: int, world: int, cache: Path) -> dict[str, Any]:
    """Both models' predictions for the measured rows, the auto pick by the calibrated model, and calibration."""
    from lightning_shard.planner import plan
    from lightning_shard.planner.evaluate import candidates
    from lightning_shard.planner.models import build_gpt
    from lightning_shard.planner.placement import place
    from lightning_shard.topology.resolve import resolve

    os.environ["LIGHTNING_SHARD_CACHE"] = str(cache)
    module = build_gpt(layers, width, heads, SEQ, VOCAB)
    rows = {c.label: c for c in candidates(module, place(resolve("cpu", world), world), 1)}
    configs = [rows[label] for label in dict.fromkeys(ROW[v] for v in VARIANTS)]
    t = time.perf_counter()
    cal = plan(module, "cpu", world, MICRO * world, MICRO, "32-true", calibrate=True)
    cal_s = time.perf_counter() - t
    nominal = plan(module, "cpu", world, MICRO * world, MICRO, "32-true", configs=configs)
    by_cal = {r.label: r.time.total for r in cal.rows}
    return {"params": cal.context.psi, "calibration": cal.calibration, "calibration_wall_s": cal_s,
            "calibrated": {v: by_cal[ROW[v]] for v in VARIANTS},
            "nominal": {v: next(r.time.total for r in nominal.rows if r.label == ROW[v]) for v in VARIANTS},
            "auto_pick": cal.best.label, "auto_predicted": cal.best.time.total}


def auto_log(tmp: Path, tag: str) -> dict[str, Any]:
    """What ``zero_auto`` logged: its pick, calibration and predicted vs measured line."""
    text = "".join(p.read_text(errors="replace") for p in sorted(tmp.glob(f"{tag}zero_auto.r*.log")))
    chose = re.search(r"strategy=auto chose (\S+) \(([^:]+):", text)
    check = re.search(r"predicted ([\d.]+) s/step \((\w+) model\), measured ([\d.]+) s/step", text)
    cal = re.search(r"strategy=auto calibration: (.*)", text)
    return {"registered": chose.group(1) if chose else None, "label": chose.group(2) if chose else None,
            "calibration": cal.group(1) if cal else None,
            "logged_predicted_s": float(check.group(1)) if check else None,
            "logged_measured_s": float(check.group(3)) if check else None}


def run_case(world: int, size: str, layout: int, opts: argparse.Namespace, tmp: Path, cache: Path) -> dict[str, Any]:
    layers, width, heads = SIZES[size][layout]
    name = f"{size}-{'wide' if layout == 0 else 'deep'} {layers}x{width} world {world}"
    print(f"== {name}", flush=True)
    pred = predict(layers, width, heads, world, cache)
    print(f"   calibration: {pred['calibration']} ({pred['calibration_wall_s']:.1f} s)", flush=True)
    variants = list(VARIANTS) + ["zero_auto"]
    args = parse_args(["--suite", "speed", "--model", "gpt", "--n-layer", str(layers), "--n-embd", str(width),
                       "--n-head", str(heads), "--vocab", str(VOCAB), "--block-size", str(SEQ),
                       "--batch-size", str(MICRO), "--devices", str(world), "--steps", str(opts.steps),
                       "--warmup", str(opts.warmup), "--repeats", str(opts.repeats), "--profile-steps", "0",
                       "--variants", *variants])
    env = dict(variant_env("speed"), LIGHTNING_SHARD_CACHE=str(cache))
    tag = f"w{world}.{size}{layout}."
    results = run_suite(args, "speed", variants, tmp, env, {}, tag)
    measured = {v: (results[v].get("median_step_s_per_rank") or [None])[0] for v in variants}
    auto = auto_log(tmp, tag) | {"measured_s": measured.pop("zero_auto")}
    ok = {v: t for v, t in measured.items() if t}
    fastest = min(ok, key=ok.get) if ok else None
    auto["measured_fastest"] = fastest
    auto["pick_within_noise_of_fastest"] = (auto["measured_s"] is not None and fastest is not None and
                                            auto["measured_s"] <= ok[fastest] * (1 + NOISE))
    errors = {v: results[v].get("error_line") for v in variants if "error" in results[v]}
    return {"case": name, "size": size, "layout": "wide" if layout == 0 else "deep", "world": world,
            "layers": layers, "width": width, "heads": heads, **pred, "measured": measured, "auto": auto,
            "errors": errors}


def order_agreement(case: dict[str, Any], model: str) -> tuple[int, int, list[str]]:
    """Pairs of strategies whose measured times differ by more than ``NOISE``: how many the model orders the same."""
    m, p = case["measured"], case[model]
    names = [v for v in VARIANTS if m.get(v)]
    agree = total = 0
    wrong = []
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            if max(m[a], m[b]) / min(m[a], m[b]) - 1 <= NOISE:
                continue
            total += 1
            if (m[a] < m[b]) == (p[a] < p[b]):
                agree += 1
            else:
                wrong.append(f"{a}/{b}")
    return agree, total, wrong


def _err(predicted: float, measured: Any) -> str:
    return f"{predicted / measured - 1:+.1%}" if measured else "-"


def markdown(doc: dict[str, Any]) -> str:
    mi = doc["machine"]
    out = ["# Planner vs machine: predicted and measured step time", "",
           f"{mi['cores']} cores ({mi['cpu']}), CPU ranks x 1 thread, gloo; torch {mi['torch']}, lightning "
           f"{mi['lightning']}. The recipe GPT (vocab {VOCAB}, {SEQ} tokens, micro-batch {MICRO} per rank, accumulation"
           f" 1), fp32 AdamW; measured: rank 0's median step over {doc['steps']} timed steps after {doc['warmup']} "
           f"warmup, each variant in fresh processes ({doc.get('repeats', 1)} runs, interleaved: the median of their "
           "medians), default knobs. Error = predicted / measured - 1. Order: pairs of "
           f"strategies whose measured times differ by more than the A/A noise ({NOISE:.0%}), and how many of them "
           "each model puts in the measured order.",
           f"Command: `{doc['command']}` (wall {doc['wall_s']:.0f} s).", ""]
    out += ["| case | params | strategy | measured s | calibrated s | error | nominal s | error |",
            "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for c in doc["cases"]:
        for v in VARIANTS:
            m = c["measured"].get(v)
            cal, nom = c["calibrated"][v], c["nominal"][v]
            out.append(f"| {c['case']} | {c['params'] / 1e6:.2f}M | {v} | {m or float('nan'):.4f} | {cal:.4f} | "
                       f"{_err(cal, m)} | {nom:.4f} | {_err(nom, m)} |")
    out += ["", "## Summary per case", "",
            "| case | calibrated: max abs error | order (calibrated) | nominal: max abs error | order (nominal) | "
            "calibration | auto picked | auto measured s | measured fastest | auto within noise of it |",
            "| --- | ---: | --- | ---: | --- | --- | --- | ---: | --- | --- |"]
    for c in doc["cases"]:
        def worst(model: str, c: dict[str, Any] = c) -> str:
            errs = [abs(c[model][v] / c["measured"][v] - 1) for v in VARIANTS if c["measured"].get(v)]
            return f"{max(errs):.1%}" if errs else "-"

        def order(model: str, c: dict[str, Any] = c) -> str:
            a, t, wrong = order_agreement(c, model)
            return f"{a}/{t}" + (f" (not: {', '.join(wrong)})" if wrong else "")

        a = c["auto"]
        cal = f"{c['calibration_wall_s']:.1f} s: {c['calibration'].split(';')[0]}"
        out.append(f"| {c['case']} | {worst('calibrated')} | {order('calibrated')} | {worst('nominal')} | "
                   f"{order('nominal')} | {cal} | {a.get('label') or a.get('registered')} | "
                   f"{a['measured_s'] or float('nan'):.4f} | {a['measured_fastest']} | "
                   f"{'yes' if a['pick_within_noise_of_fastest'] else 'no'} |")
    out += ["", "## By world size", "",
            "| world | rows | calibrated within 15% | within 10% | median abs error | nominal within 15% | "
            "median abs error |", "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for world in sorted({c["world"] for c in doc["cases"]}):
        rows = [(c, v) for c in doc["cases"] if c["world"] == world for v in VARIANTS if c["measured"].get(v)]

        def errs(model: str, rows: list = rows) -> list[float]:
            return sorted(abs(c[model][v] / c["measured"][v] - 1) for c, v in rows)

        cal, nom = errs("calibrated"), errs("nominal")
        out.append(f"| {world} | {len(rows)} | {sum(e <= 0.15 for e in cal)} | {sum(e <= 0.10 for e in cal)} | "
                   f"{cal[len(cal) // 2]:.1%} | {sum(e <= 0.15 for e in nom)} | {nom[len(nom) // 2]:.1%} |")
    tot = doc["totals"]
    out += ["", f"Within 15%: calibrated {tot['calibrated_within_15']}/{tot['rows']}, nominal "
            f"{tot['nominal_within_15']}/{tot['rows']}; within 10%: calibrated {tot['calibrated_within_10']}, nominal "
            f"{tot['nominal_within_10']}. Ordered pairs: calibrated {tot['calibrated_order']}, nominal "
            f"{tot['nominal_order']}. Auto's pick within noise of the measured fastest: {tot['auto_ok']}.",
            f"Reuse: planning the first case again with the same cache: {doc['reuse']['calibration']} "
            f"({doc['reuse']['wall_s']:.2f} s)."]
    errs = [f"{c['case']} {v}: {e}" for c in doc["cases"] for v, e in c["errors"].items()]
    if errs:
        out += ["", "Failed runs: " + "; ".join(errs)]
    return "\n".join(out) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    p.add_argument("--layouts", nargs="+", default=["wide", "deep"], choices=["wide", "deep"])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of each variant, interleaved (ABC CBA ...); the measured step is their median")
    p.add_argument("--quick", action="store_true", help="2 timed steps after 1 warmup")
    p.add_argument("--out-dir", default=str(RESULTS))
    p.add_argument("--render", metavar="RESULT.json", help="write the Markdown of an earlier result again (beside it)")
    opts = p.parse_args()
    if opts.render:
        doc = json.loads(Path(opts.render).read_text())
        Path(opts.render).with_suffix(".md").write_text(markdown(doc))
        return
    if opts.quick:
        opts.steps, opts.warmup = 2, 1
    t0 = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="bench_planner."))
    cache, tmp = work / "cache", work / "runs"
    tmp.mkdir(parents=True)
    cases = []
    for world in opts.worlds:
        for size in opts.sizes:
            for layout in opts.layouts:
                cases.append(run_case(world, size, 0 if layout == "wide" else 1, opts, tmp, cache))
    first = cases[0]
    t = time.perf_counter()
    again = predict(first["layers"], first["width"], first["heads"], first["world"], cache)
    rows = [(c, v) for c in cases for v in VARIANTS if c["measured"].get(v)]

    def within(model: str, bound: float) -> int:
        return sum(abs(c[model][v] / c["measured"][v] - 1) <= bound for c, v in rows)

    def orders(model: str) -> str:
        pairs = [order_agreement(c, model) for c in cases]
        return f"{sum(a for a, _, _ in pairs)}/{sum(t for _, t, _ in pairs)}"

    margs = parse_args(["--suite", "speed", "--model", "gpt", "--devices", str(max(opts.worlds))])
    doc = {"suite": "planner", "machine": machine_info(margs), "steps": opts.steps, "warmup": opts.warmup,
           "repeats": opts.repeats,
           "command": " ".join([Path(sys.executable).name] + [os.path.relpath(sys.argv[0], REPO)] + sys.argv[1:]),
           "wall_s": time.perf_counter() - t0, "cases": cases,
           "reuse": {"calibration": again["calibration"], "wall_s": time.perf_counter() - t},
           "totals": {"rows": len(rows), "calibrated_within_15": within("calibrated", 0.15),
                      "calibrated_within_10": within("calibrated", 0.10),
                      "nominal_within_15": within("nominal", 0.15), "nominal_within_10": within("nominal", 0.10),
                      "calibrated_order": orders("calibrated"), "nominal_order": orders("nominal"),
                      "auto_ok": f"{sum(bool(c['auto']['pick_within_noise_of_fastest']) for c in cases)}/"
                                 f"{len(cases)}"}}
    out = Path(opts.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = result_stem("planner")
    (out / f"{stem}.json").write_text(json.dumps(doc, indent=1, default=str))
    md = markdown(doc)
    (out / f"{stem}.md").write_text(md)
    print("\n" + md)
    print(f"wrote {out / stem}.json, .md")


if __name__ == "__main__":
    main()
