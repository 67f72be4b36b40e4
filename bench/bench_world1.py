"""The world-1 suite: the engine's overhead at world 1, measured step by step against a plain torch loop in the same
process.

Separate runs of each strategy cannot resolve a few percent on a shared machine: the same plain loop, unchanged,
ran 12% slower in one process than in the next. Here one process at world 1 (gloo, one thread) holds a plain model
and one model per strategy, all the same Hugging Face GPT-2 (6 x 384, vocab 16384, ~17M parameters, the speed
suite's model) with fp32 AdamW, and trains them in turns, one optimizer step each per round, the order rotated every
round. Each strategy's step is compared with the plain step of the same round (seconds apart), so a slow spell of the
machine moves both.

The strategies are ``ShardEngine`` driven as the Lightning/Fabric adapters drive it (``pre_backward``/
``post_backward`` around ``backward``, ``prepare_step``/``finish_step`` around ``optimizer.step``, the stage-3
controller's forward hooks), default knobs, zero3's units and fsdp_shard's ``wrap_classes="auto"``; what is measured
is the engine (hooks, flat buffers, copies, chunked optimizer), not Lightning's strategy layer around it.

    .venv/bin/python bench/bench_world1.py      # 30 rounds -> bench/results/world1_<hardware>_<date>.{json,md}
    .venv/bin/python bench/bench_world1.py --rounds 30 --profile-steps 3   # and each model's costliest ops

``--profile-steps n`` then runs n more steps of each model in turn under torch.profiler and lists each one's
costliest ops (self CPU ms per step): where a difference between the models comes from, or that it comes from an op
all of them run alike.

No thresholds: this script reports, it does not judge.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

from naming import result_stem

HERE = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"
STAGES = {"zero0": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp_shard": 3}


# the speed suite's HF GPT-2 (bench/variants.py builds it for every suite)
MODEL = argparse.Namespace(model="hf_gpt2", n_layer=6, n_embd=384, n_head=6, vocab=16384, block_size=128)


def build(variant: str, seed: int):
    import torch
    from variants import build_model

    from lightning_shard.engine.engine import ShardEngine
    from lightning_shard.options import options_for

    torch.manual_seed(seed)
    net = build_model(MODEL)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    if variant == "plain":
        return net, opt, None
    # the registered strategy's default options (zero3: per-module units; fsdp_shard: wrap_classes="auto"), deferring
    # as the engine did by default (stage 3 calls it keep_unsharded_grads)
    options = options_for(variant, accumulation="keep_unsharded_grads" if STAGES[variant] == 3 else "defer")
    engine = ShardEngine(net, [opt], options)
    if engine.controller is not None:  # each forward is one pass of the schedule, as the adapters do it
        ctl = engine.controller
        net.register_forward_pre_hook(lambda m, a: ctl.step_pre_forward())
        net.register_forward_hook(lambda m, a, out: ctl.step_post_forward(out))
    return net, opt, engine


FIELDS = ("step", "cpu", "forward", "backward", "optimizer")  # what one_step returns, in this order


def one_step(net, opt, engine, tokens) -> tuple[float, float, float, float, float]:
    """(wall s, main-thread CPU s, forward, backward, optimizer) of one optimizer step."""
    t0, c0 = time.perf_counter(), time.thread_time()
    loss = net(input_ids=tokens, labels=tokens).loss
    t1 = time.perf_counter()
    if engine is not None:
        engine.pre_backward()
    loss.backward()
    if engine is not None:
        engine.post_backward()
    t2 = time.perf_counter()
    if engine is not None:
        engine.prepare_step(opt)
    opt.step()
    if engine is not None:
        engine.finish_step(opt)
    opt.zero_grad()
    t3, c3 = time.perf_counter(), time.thread_time()
    return t3 - t0, c3 - c0, t1 - t0, t2 - t1, t3 - t2


def profile_ops(model, tokens, steps: int) -> list[tuple[str, float]]:
    """``steps`` steps of one model under torch.profiler: (op, self CPU ms per step), costliest first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            one_step(*model, tokens)
    ops = [(e.key, e.self_cpu_time_total / 1e3 / steps) for e in prof.key_averages()]
    return sorted(ops, key=lambda o: -o[1])[:12]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", nargs="+", default=["zero1", "zero2", "zero3", "fsdp_shard"],
                   choices=sorted(STAGES))
    p.add_argument("--rounds", type=int, default=30, help="timed rounds (one step of every model each)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="then, model by model, this many steps under torch.profiler: each one's costliest ops")
    p.add_argument("--out-dir", default=str(RESULTS),
                   help="where world1_<hardware>_<date>.json / .md go (naming.py; default bench/results)")
    args = p.parse_args()

    sys.path.insert(0, str(HERE))
    import torch
    from gpu_probes import free_port

    torch.set_num_threads(1)
    from lightning_shard.engine.comm import collectives as C

    C.init_process_group("gloo", 0, 1, f"tcp://127.0.0.1:{free_port()}", timedelta(seconds=60))
    names = ["plain"] + list(args.variants)
    models = {n: build(n, seed=0) for n in names}
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, MODEL.vocab, (8, MODEL.block_size), generator=g) for _ in range(4)]
    rows: dict[str, list[tuple[float, ...]]] = {n: [] for n in names}
    for r in range(args.warmup + args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            out = one_step(*models[n], batches[r % len(batches)])
            if r >= args.warmup:
                rows[n].append(out)
        if r >= args.warmup:
            print(f"round {r - args.warmup}: " + ", ".join(f"{n} {rows[n][-1][0]:.3f}" for n in names), flush=True)
    profiles = {n: profile_ops(models[n], batches[0], args.profile_steps) for n in names} if args.profile_steps else {}
    losses = {}
    for n in names:  # the same model, data and optimizer: every model must still compute the same loss
        net = models[n][0]
        with torch.no_grad():
            losses[n] = net(input_ids=batches[0], labels=batches[0]).loss.item()
    C.destroy_process_group()

    def quart(xs):  # quartiles (one round: the value itself)
        return statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3

    result = {"command": "python bench/bench_world1.py " + " ".join(sys.argv[1:]), "torch": torch.__version__,
              "python": platform.python_version(), "rounds": args.rounds, "warmup": args.warmup,
              "final_loss": losses, "profile_steps": args.profile_steps, "profiles": profiles, "variants": {}}
    base = rows["plain"]
    for n in names:
        rs = rows[n]
        wall_ratio = [a[0] / b[0] for a, b in zip(rs, base)]
        cpu_ratio = [a[1] / b[1] for a, b in zip(rs, base)]
        result["variants"][n] = {
            "step_s": [x[0] for x in rs], "cpu_s": [x[1] for x in rs],
            **{f"median_{k}_s": statistics.median(x[i] for x in rs) for i, k in enumerate(FIELDS)},
            "paired_wall_ratio_median": statistics.median(wall_ratio), "paired_wall_ratio_q": quart(wall_ratio),
            "paired_cpu_ratio_median": statistics.median(cpu_ratio), "paired_cpu_ratio_q": quart(cpu_ratio)}
    lines = ["# World 1: the engine's overhead, interleaved with a plain loop in one process", "",
             f"HF GPT-2 6 x 384 (vocab 16384), micro-batch 8 x 128, fp32 AdamW, 1 thread, gloo world 1; torch "
             f"{torch.__version__}; {args.rounds} timed rounds after {args.warmup}, each one optimizer step of every "
             f"model, order rotated per round. Ratios: per round, the strategy's step over the plain step of the same "
             f"round; median and quartiles over rounds. Command: `{result['command']}`.", "",
             "| variant | step s (median) | forward | backward | optimizer | main-thread CPU s | wall vs plain, "
             "paired: median (quartiles) | CPU vs plain, paired | loss after |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for n in names:
        v = result["variants"][n]
        q, qc = v["paired_wall_ratio_q"], v["paired_cpu_ratio_q"]
        lines.append(f"| {n} | {v['median_step_s']:.3f} | {v['median_forward_s']:.3f} | {v['median_backward_s']:.3f} "
                     f"| {v['median_optimizer_s']:.3f} | {v['median_cpu_s']:.3f} | {v['paired_wall_ratio_median']:.3f} "
                     f"({q[0]:.3f}-{q[2]:.3f}) | {v['paired_cpu_ratio_median']:.3f} ({qc[0]:.3f}-{qc[2]:.3f}) | "
                     f"{losses[n]:.4f} |")
    if profiles:
        lines += ["", f"The costliest ops by self CPU time, ms per step over {args.profile_steps} profiled steps of "
                  "each model in turn (after the timed rounds):", ""]
        for n in names:
            lines.append(f"- {n}: " + ", ".join(f"{op} {ms:.1f}" for op, ms in profiles[n][:8]))
    out = Path(args.out_dir) / result_stem("world1")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {out}.json, {out}.md")


if __name__ == "__main__":
    main()
