"""The GPU check's Markdown: one section per phase, written from the JSON document after every check (so a partial
run reads as one), every number with the bound or the reference it was held against."""

from __future__ import annotations

from typing import Any

TITLES = {"parity": "1. Correctness at world 1", "world2": "2. Two ranks on one device",
          "perf": "3-4. Memory and speed", "tests": "5. The suite's GPU-only tests"}


def _f(x: Any, fmt: str = ".3g") -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, (int, float)):
        return format(x, fmt)
    return str(x)


def markdown(doc: dict[str, Any]) -> str:
    m = doc.get("machine") or {}
    cpu = doc.get("mode") == "cpu"
    where = ("CPU smoke run (`--cpu`): tiny sizes, gloo, the same phases and checks; memory is a CPU stand-in"
             if cpu else f"{m.get('gpu', 'GPU')} ({_f(m.get('gpu_mem_gib'), '.0f')} GiB), CUDA {m.get('cuda')}, "
             f"NCCL {m.get('nccl')}")
    lines = [f"# GPU check{' (CPU smoke)' if cpu else ''}: every strategy on {'CPU' if cpu else 'CUDA + NCCL'}", "",
             f"{where}; torch {m.get('torch')}, lightning {m.get('lightning')}, python {m.get('python')}, "
             f"{m.get('cores')} cores." if m else "Machine: not recorded (no phase started).",
             f"Command: `{doc.get('command', '')}`; started {doc.get('started', '-')}; status **{doc.get('status')}**; "
             f"wall {_f(doc.get('wall_s'), '.0f')} s of a {_f(doc.get('budget_s'), '.0f')} s budget.", ""]
    first = doc.get("first_failure")
    if first:
        lines += [f"**First failure**: `{first['name']}`: "
                  + (first.get("error") or f"{first['what']} = {_f(first['value'])}, must be {first['op']} "
                     f"{_f(first['bound'])} (reference: {first.get('reference')})"), ""]
    lines += ["| phase | status | checks passed | failed | wall s |", "| --- | --- | ---: | ---: | ---: |"]
    for name, sec in doc.get("phases", {}).items():
        checks = sec.get("checks", [])
        lines.append(f"| {name} | {sec.get('status')} | {sum(c['passed'] for c in checks)}/{len(checks)} | "
                     f"{sum(not c['passed'] for c in checks)} | {_f(sec.get('wall_s'), '.0f')} |")
    lines.append("")
    for name, sec in doc.get("phases", {}).items():
        lines += [f"## {TITLES.get(name, name)}", ""]
        lines += {"parity": parity_md, "world2": world2_md, "perf": perf_md, "tests": tests_md}.get(
            name, lambda s, c: [])(sec, cpu)
        failed = [c for c in sec.get("checks", []) if not c["passed"]]
        if failed:
            lines += ["Failed checks:", ""]
            lines += [f"- `{c['name']}`: " + (c.get("error") or f"{c['what']} = {_f(c['value'])}, must be "
                                                                 f"{c['op']} {_f(c['bound'])}") for c in failed]
            lines.append("")
        lines += [f"- {n}" for n in sec.get("notes", [])] + ([""] if sec.get("notes") else [])
    return "\n".join(lines) + "\n"


def parity_md(sec: dict[str, Any], cpu: bool) -> list[str]:
    lines = ["Weights after 5 optimizer steps x 2 micro-batches (`module.state_dict()` after `fit`) against plain "
             "single-device Lightning on the same data, max |difference| (bound, with GAP = plain Lightning's own "
             "distance from its fp32 run: fp32 1e-5; bf16-mixed GAP / 2, as an fp32 run posing as bf16 sits GAP away; "
             "bf16-true 2.25 GAP + 1e-3, the triangle through the fp32 run, as plain keeps no fp32 masters); bf16 also "
             "against the plain fp32 run (bound: 1.25 GAP + 1e-3; and at least GAP / 4 with plain's dtypes: the run "
             "computed in bf16, not fp32). Resume: "
             "checkpoint at step 3, a new Trainer to step 5 (vs plain: parity bound; vs the uninterrupted run: fp32 "
             "1e-6, bf16 1e-4). Consolidate: `lightning-shard consolidate` of the step-3 checkpoint, loaded strictly "
             "into the bare model, vs plain Lightning at step 3.", "",
             "| model | precision | strategy | vs plain (bound) | vs plain fp32 (plain's own) | resumed vs plain | "
             "resumed vs uninterrupted | bitwise | consolidated vs plain | fit s |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: |"]
    for r in sec.get("rows", []):
        if r["strategy"] == "plain":
            continue
        acc = f"{_f(r.get('vs_fp32'))} ({_f(r.get('plain_vs_fp32'))})" if "vs_fp32" in r else "-"
        lines.append(f"| {r['model']} | {r['precision']} | {r['strategy']} | {_f(r.get('parity'))} "
                     f"({_f(r.get('bound'))}) | {acc} | "
                     f"{_f(r.get('resume_vs_plain'))} | {_f(r.get('resume_vs_uninterrupted'))} | "
                     f"{_f(r.get('resume_bitwise'))} | {_f(r.get('consolidate_vs_plain'))} | "
                     f"{_f(r.get('fit_s'), '.2f')} |")
    return lines + [""]


def world2_md(sec: dict[str, Any], cpu: bool) -> list[str]:
    dev = "CPU" if cpu else "cuda:0"
    lines = [f"Two processes (torch.multiprocessing spawn), gloo, both on {dev}. Each collective the engine uses "
             "(`engine/comm/collectives.py`), on tensors of that device, async as the engine issues them:", "",
             "| torch.distributed call | used by | runs | correct | error |", "| --- | --- | --- | --- | --- |"]
    for p in sec.get("probes", []):
        lines.append(f"| `{p['op']}` | {p.get('used_by', '')} | {_f(p.get('ok'))} | {_f(p.get('correct'))} | "
                     f"{p.get('error', '')} |")
    nccl = sec.get("nccl_same_device")
    if nccl:
        lines += ["", f"NCCL, two ranks on cuda:0: **{nccl.get('outcome')}** {nccl.get('detail', '')}".rstrip()]
    lines += ["", "The engine (`ShardEngine` driven directly, as tests/engine/test_engine_dist.py does) at world "
              "2 (then zero2 and zero3 on each other `reduce_scatter_via` path), 4 optimizer steps x 2 micro-batches, "
              "SGD momentum, against one process on the same device training on the global batch (bound 1e-5):", "",
              "| case | result | max diff | collectives issued (rank 0) |", "| --- | --- | ---: | --- |"]
    for c in sec.get("cases", []):
        ops = ", ".join(f"{k} x{v}" for k, v in (c.get("ops") or {}).items())
        lines.append(f"| {c['case']} | {c.get('result')} | {_f(c.get('diff'))} | {ops or c.get('error', '')} |")
    return lines + [""]


def perf_md(sec: dict[str, Any], cpu: bool) -> list[str]:
    cfg = sec.get("config") or {}
    if not cfg:
        return []
    unit, scale = ("MiB", 2**20) if cpu else ("GiB", 2**30)
    mem = "peak RSS (VmHWM, reset per run; a CPU stand-in for device memory)" if cpu else \
        "`torch.cuda.max_memory_allocated` / `max_memory_reserved`"
    lines = [f"Recipe GPT {cfg.get('n_layer')} x {cfg.get('n_embd')} (vocab {cfg.get('vocab')}, seq "
             f"{cfg.get('block_size')}): {_f(cfg.get('params'), ',')} parameters (Psi); micro-batch "
             f"{cfg.get('batch_size')} x {cfg.get('block_size')}, bf16-mixed, AdamW, world 1; {cfg.get('warmup')} "
             f"warmup + {cfg.get('steps')} timed steps per run, {cfg.get('rounds')} round(s) in alternating order; "
             f"every strategy with default knobs. Memory: {mem}.", "",
             f"| variant | peak {'RSS' if cpu else 'allocated'} {unit} | peak reserved {unit} | before the model "
             f"{unit} | peak - before {unit} | peak vs plain | peak vs FSDP2 |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    res = sec.get("results") or {}
    base, f2 = (res.get("plain") or {}).get("peak_bytes"), (res.get("fsdp2") or {}).get("peak_bytes")

    def size(x: Any) -> str:
        return _f(x / scale if x is not None else None, ".2f")

    for v, r in res.items():
        if "error" in r:
            lines.append(f"| {v} | failed: {r['error'][:120]} | | | | | |")
            continue
        pk, before = r.get("peak_bytes"), r.get("before_bytes")
        lines.append(f"| {v} | {size(pk)} | {size(r.get('reserved_bytes'))} | {size(before)} | "
                     f"{size(pk - before if pk is not None and before is not None else None)} | "
                     f"{_f(pk / base if pk and base else None, '.3f')} | {_f(pk / f2 if pk and f2 else None, '.3f')} |")
    lines += ["", "Speed (tokens/s: the best round's; MFU = 6 Psi tokens/s over 989 TFLOP/s, the H100/H200 SXM dense "
              "bf16 peak; host time per step of the profiler labels over the profiled steps):", "",
              "| variant | tokens/s | rounds | MFU | vs plain | vs FSDP2 | median step s | profiler labels (s/step) |",
              "| --- | ---: | --- | ---: | ---: | ---: | ---: | --- |"]
    tp = {v: r.get("tokens_per_s") for v, r in res.items() if "error" not in r}
    for v, r in res.items():
        if "error" in r:
            continue
        labels = ", ".join(f"{k.replace('lightning_shard.', '')} {x:.4f}" for k, x in
                           sorted((r.get("labels") or {}).items(), key=lambda kv: -kv[1])[:8])
        lines.append(f"| {v} | {_f(tp[v], ',.0f')} | {'/'.join(_f(x, '.0f') for x in r.get('rounds', []))} | "
                     f"{_f(r.get('mfu'), '.3f')} | {_f(tp[v] / tp['plain'] if tp.get('plain') else None, '.3f')} | "
                     f"{_f(tp[v] / tp['fsdp2'] if tp.get('fsdp2') else None, '.3f')} | "
                     f"{_f(r.get('median_step_s'), '.4f')} | {labels or '-'} |")
    goals = sec.get("goals") or []
    if goals:
        lines += ["", "Goals (reported, not asserted):", ""]
        lines += [f"- {g['variant']}: {g['what']} = {_f(g['value'], '.3f')} (goal {g['goal']}): "
                  f"**{'met' if g['met'] else 'not met'}**" for g in goals]
    return lines + [""]


def tests_md(sec: dict[str, Any], cpu: bool) -> list[str]:
    lines = [f"`{sec.get('command', '')}`", "", "| test | outcome | reason |", "| --- | --- | --- |"]
    for t in sec.get("tests", []):
        lines.append(f"| `{t['nodeid']}` | {t['outcome']} | {t.get('reason', '')} |")
    return lines + [""]
