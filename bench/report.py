"""The Markdown tables of a suite's JSON document (``bench/results/<suite>.md``)."""

from __future__ import annotations

from typing import Any

from peak import markdown_peak
from variants import program_of


def _header(doc: dict[str, Any], title: str) -> list[str]:
    m = doc["machine"]
    return [
        f"# {title}",
        "",
        f"{m['ranks']} CPU ranks x {m['threads_per_rank']} thread (gloo) on {m['cores']} cores ({m['cpu']}); "
        f"torch {m['torch']}, lightning {m['lightning']}, python {m['python']}.",
        f"Model: GPT {m['model']['n_layer']} layers x {m['model']['n_embd']} wide, {m['model']['n_head']} heads, "
        f"vocab {m['model']['vocab']}, seq {m['model']['block_size']}, tied embedding: "
        f"{m['params'] / 1e6:.2f}M params ({m['param_mib_fp32']:.1f} MiB fp32). AdamW, fp32. "
        f"Micro-batch {m['micro_batch_per_rank']} x {m['model']['block_size']} = {m['tokens_per_step_per_rank']} "
        f"tokens/step/rank; {m['warmup_steps']} warmup + {m['timed_steps']} timed steps per run, {m['repeats']} "
        f"run(s) per variant (order reversed every other round; tokens/s = mean of runs); bucket_mb={m['bucket_mb']}. "
        f"Engine phase times: torch.profiler labels over {m.get('profile_steps', '?')} profiled step(s) run after the "
        "timed ones (lightning_shard variants; the timed steps are not profiled).",
        f"Command: `{doc['command']}` (wall of this table {doc['wall_s']:.0f} s).",
        "",
    ]


def _phase_rows(doc: dict[str, Any]) -> list[str]:
    lines = [
        "| variant | forward | backward+sync | optimizer+sync | engine post_backward | engine finish_step "
        "| median step | final loss |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for v, r in doc["results"].items():
        if "error" in r:
            continue
        p, e = r["phase_s_per_step_rank0"], r["engine_s_per_step_rank0"]
        eng = " | ".join(f"{e[k]:.3f}" if k in e else "-" for k in ("post_backward", "finish_step"))
        lines.append(f"| {v} | {p['forward']:.3f} | {p['backward_and_grad_sync']:.3f} | "
                     f"{p['optimizer_and_param_sync']:.3f} | {eng} | {r['median_step_s_per_rank'][0]:.3f} | "
                     f"{r['final_loss_rank0']:.4f} |")
    return lines


def markdown_zero12(doc: dict[str, Any]) -> str:
    lines = _header(doc, "zero0/zero1/zero2 vs Lightning DDP vs ZeroRedundancyOptimizer") + [
        "| variant | tokens/s (rank mean) | vs DDP | opt-state MiB/rank | peak RSS MiB (max rank) | "
        "wire MiB/step/rank | note |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for v, r in doc["results"].items():
        if "error" in r:
            lines.append(f"| {v} | failed | | | | | {r['error']} |")
            continue
        ratio = f"{r['ratio_vs_ddp']:.3f}" if r.get("ratio_vs_ddp") else "n/a"
        opt = " / ".join(f"{x:.1f}" for x in r["optimizer_state_mib_per_rank"])
        reps = "/".join(f"{x['tokens_per_s_mean']:.0f}" for x in r.get("repeats", []))
        note = (f"{r['note']}; tok/s per repeat {reps}; wire {r['wire_source']} "
                f"(formula {r['wire_formula_mib_per_step']:.1f})")
        lines.append(f"| {v} | {r['tokens_per_s_mean']:.0f} | {ratio} | {opt} | {r['peak_rss_mib_max']:.0f} | "
                     f"{r['wire_mib_per_step_per_rank']:.1f} | {note} |")
    lines += [
        "",
        "Opt-state is listed per rank (rank0 / rank1), from the tensors each rank holds. Wire bytes per rank use",
        "ring conventions: all-reduce 2(N-1)/N x bytes, reduce-scatter / all-gather (N-1)/N x bytes, broadcast =",
        "bytes this rank receives. Formula column: DDP / ZeRO-1/2 2(N-1)/N x Psi bytes; ZeroRedundancyOptimizer adds",
        "(N-1)/N x Psi bytes of broadcasts (docs/architecture.md, 'Design rules' 3). Timed loop has no barriers; "
        "tokens/s is per rank.",
        "",
        "Per-step phases, rank 0 (s): forward | backward incl. gradient sync wait | optimizer step incl. param sync",
        "",
        "Engine columns (zero* only): time inside ShardEngine.post_backward (waiting for the last gradient",
        "reductions) and ShardEngine.finish_step (parameter all-gather), from the torch.profiler labels",
        "lightning_shard.post_backward / lightning_shard.finish_step, mean per step of the profiled window.",
        "",
    ] + _phase_rows(doc)
    return "\n".join(lines) + "\n"


def markdown_zero3(doc: dict[str, Any]) -> str:
    res = doc["results"]
    lines = _header(doc, "zero3 / fsdp_shard vs torch FSDP2 (fully_shard via Lightning ModelParallelStrategy)") + [
        "| variant | tokens/s (rank mean) | vs FSDP2 | vs DDP | model state MiB/rank | of which opt state | "
        "peak RSS MiB/rank | wire MiB/step/rank | wire source | note |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for v, r in res.items():
        if "error" in r:
            lines.append(f"| {v} | failed | | | | | | | | {r['note']}; {r['error']} "
                         f"(see {doc['suite']}.json log_tail) |")
            continue
        fmt = lambda xs, d=1: " / ".join(f"{x:.{d}f}" for x in xs)  # noqa: E731
        ratio = lambda k, r=r: f"{r[k]:.3f}" if r.get(k) else "n/a"  # noqa: E731
        reps = "/".join(f"{x['tokens_per_s_mean']:.0f}" for x in r.get("repeats", []))
        note = f"{r['note']}; tok/s per repeat {reps}; final loss {r['final_loss_rank0']:.4f}"
        if r.get("reused_from_suite"):
            note += f"; measured in the {r['reused_from_suite']} table of this run (not interleaved with these)"
        src = r["wire_source"]
        counted = r["wire_detail_rank0"].get("counted_wire_bytes_per_step")
        if counted is not None:
            src += f"; cross-check, counted FSDP2 collectives: {counted / 2**20:.1f}"
        three_pass = program_of(v) in ("zero3", "fsdp_shard", "fsdp2")
        src += f"; {'ideal 3-pass ' if three_pass else ''}formula {r['wire_formula_mib_per_step']:.1f}"
        lines.append(f"| {v} | {r['tokens_per_s_mean']:.0f} | {ratio('ratio_vs_fsdp2')} | {ratio('ratio_vs_ddp')} | "
                     f"{fmt(r['model_state_mib_per_rank'])} | {fmt(r['optimizer_state_mib_per_rank'])} | "
                     f"{fmt(r['peak_rss_mib_per_rank'], 0)} | {r['wire_mib_per_step_per_rank']:.1f} | {src} | {note} |")
    lines += ["", "Model state breakdown, rank 0 (MiB): " + "; ".join(
        f"{v}: " + ", ".join(f"{k} {b / 2**20:.1f}" for k, b in r["model_state_rank0"].items()
                             if k not in ("total", "padding_elements") and (b or k in ("params", "grads")))
        for v, r in res.items() if "error" not in r and r.get("model_state_rank0"))]
    lines += [
        "",
        "Per-rank columns are rank0 / rank1. Model state = parameters + gradients + optimizer state (+ fp32",
        "master / accumulators) the rank holds in the last timed step just before the optimizer update",
        "(gradients reduced; snapshot time excluded from timing), unique storages (padding included):",
        "lightning_shard from `engine.memory_report()` minus `gathered_params`; FSDP2 from the local shards",
        "(`DTensor.to_local()`) of parameters, gradients and AdamW state; DDP from its parameter, `.grad` and",
        "AdamW tensors (its reducer buckets not counted). Peak RSS is each rank's VmHWM (whole process).",
        "",
        "Wire bytes per rank per optimizer step, ring conventions ((N-1)/N x full bytes for all-gather and",
        "reduce-scatter, 2(N-1)/N for all-reduce). lightning_shard: measured by the LEDGER. FSDP2: computed, not",
        "measured, from its units after lazy init (per unit padded flat size S: all-gather in forward, again in",
        "backward when the unit is resharded after forward - FSDP2 does not reshard the root - and a",
        "reduce-scatter); the bytes of the all-gathers / reduce-scatters FSDP2 actually issued are counted",
        "as a cross-check. Ideal 3-pass formula: 3(N-1)/N x Psi bytes (every unit resharded after forward).",
        "",
        "Per-step phases, rank 0 (s): forward | backward incl. gradient sync wait | optimizer step incl. param sync",
        "(engine columns: lightning_shard only, torch.profiler labels, mean per step of the profiled window).",
        "",
    ] + _phase_rows(doc)
    for v, r in res.items():
        units = r.get("wire_detail_rank0", {}).get("units") if "error" not in r else None
        if units:
            lines += ["", f"FSDP2 units ({v}, rank 0): " + ", ".join(
                f"{u['module']} {u['padded_bytes'] / 2**20:.2f} MiB"
                f"{'' if u['reshard_after_forward'] else ' (not resharded)'}"
                for u in units)]
    return "\n".join(lines) + "\n"


def markdown_unused(doc: dict[str, Any]) -> str:
    res = doc["results"]
    lines = _header(doc, "The cost of leaving parameters without gradients out of the step "
                         "(find_unused_parameters)") + [
        "| variant | find_unused_parameters | tokens/s (rank mean) | median step s | used-mask all-reduces/step | "
        "used-mask bytes/step | time in the used-mask step, ms/step | wire MiB/step/rank | tok/s vs True |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for v, r in res.items():
        if "error" in r:
            lines.append(f"| {v} | | failed | | | | | {r['error']} |")
            continue
        base = res.get(v.replace("_nomask", ""), {})
        ratio = r["tokens_per_s_mean"] / base["tokens_per_s_mean"] if base.get("tokens_per_s_mean") else None
        d = r["wire_detail_rank0"]
        reps = "/".join(f"{x['tokens_per_s_mean']:.0f}" for x in r.get("repeats", []))
        mask_ms = 1000 * r["engine_s_per_step_rank0"].get("_leave_out_unused", 0.0)
        lines.append(f"| {v} | {'False' if v.endswith('_nomask') else 'True (default)'} | "
                     f"{r['tokens_per_s_mean']:.0f} ({reps}) | {r['median_step_s_per_rank'][0]:.3f} | "
                     f"{d.get('used_mask_calls_per_step', 0):.0f} | {d.get('used_mask_bytes_per_step', 0):.0f} | "
                     f"{mask_ms:.2f} | {r['wire_mib_per_step_per_rank']:.3f} | {f'{ratio:.3f}' if ratio else '-'} |")
    lines += ["", "Used-mask bytes: one uint8 per parameter tensor, all-reduced (max) once per optimizer step. "
                  "The time",
              "column is the profiler label lightning_shard.leave_out_unused (building the mask, the all-reduce, "
              "marking",
              "the left-out pieces), rank 0, mean per step of the profiled window; with False it only checks locally",
              "which parameters got no gradient. Tokens/s differences within the run-to-run spread (per-repeat figures",
              "in brackets) are noise.", ""]
    return "\n".join(lines) + "\n"


MARKDOWN = {"zero12": markdown_zero12, "zero3": markdown_zero3, "unused": markdown_unused, "peak": markdown_peak}
