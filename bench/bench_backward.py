"""The backward of one rank at world 1, two checkouts of the library side by side: what a change to the gradient
path costs or saves, without the communication and scheduling noise of a two-rank run.

Hugging Face GPT-2 6 x 384 (vocab 16384, ~17M parameters; the speed suite's world-1 model), micro-batch 8 x 128,
fp32 AdamW, one thread, a plain Fabric loop (``fabric.backward``, ``optimizer.step``, ``optimizer.zero_grad``) with
the strategy of ours named by ``--strategies`` at world 1, and the same loop with Fabric's own single-device
strategy (``plain``). Each run is a fresh process; runs alternate between the checkouts (A B B A ...), and each
figure is the median over runs of the per-run median of the timed steps. Also the minor page faults per step.

    .venv/bin/python bench/bench_backward.py --other /tmp/old --runs 6      # this checkout (new) against /tmp/old

Writes bench/results/backward.{json,md}. No thresholds: this script reports, it does not judge.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"


def child(args: argparse.Namespace) -> None:
    sys.path.insert(0, args.repo)
    import resource

    import lightning as L
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.set_num_threads(1)
    import lightning_shard  # noqa: F401  (registers the strategies with Fabric)

    assert Path(lightning_shard.__file__).resolve().is_relative_to(Path(args.repo).resolve()), lightning_shard.__file__
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy="auto" if args.strategy == "plain" else args.strategy)
    fabric.launch()
    L.seed_everything(0, verbose=False)
    cfg = GPT2Config(n_layer=6, n_embd=384, n_head=6, vocab_size=16384, n_positions=128, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    net = GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    net, opt = fabric.setup(net, opt)
    torch.set_num_threads(1)  # Lightning's distributed strategies set cores / local ranks (2 here) at launch
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 16384, (8, 128), generator=g)
    back, step, faults = [], [], []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        loss = net(input_ids=tokens, labels=tokens).loss
        f0, t1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
        fabric.backward(loss)
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        t3, f1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        if i >= args.warmup:
            back.append(t2 - t1)
            step.append(t3 - t0)
            faults.append(f1 - f0)
    print(json.dumps({"threads": torch.get_num_threads(), "backward_s": statistics.median(back),
                      "step_s": statistics.median(step), "faults_per_step": statistics.mean(faults),
                      "loss": loss.item()}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--other", required=True, help="another checkout of this repository (e.g. a git worktree)")
    p.add_argument("--strategies", nargs="+", default=["plain", "zero1", "zero2"])
    p.add_argument("--runs", type=int, default=6, help="runs per checkout and strategy")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=str(RESULTS / "backward"))
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--repo", help=argparse.SUPPRESS)
    p.add_argument("--strategy", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    repos = {"this": str(HERE), "other": str(Path(args.other).resolve())}
    runs: dict[str, dict[str, list[dict]]] = {s: {k: [] for k in repos} for s in args.strategies}
    t0 = time.perf_counter()
    for r in range(args.runs):
        for s in args.strategies:
            for k in (("this", "other") if r % 2 == 0 else ("other", "this")):
                cmd = [sys.executable, __file__, "--child", "--repo", repos[k], "--strategy", s, "--other", "-",
                       "--steps", str(args.steps), "--warmup", str(args.warmup)]
                out = subprocess.run(cmd, capture_output=True, text=True, cwd="/tmp")
                if out.returncode != 0:
                    raise SystemExit(f"{s} @ {k} failed:\n{out.stderr[-3000:]}")
                res = json.loads(out.stdout.strip().splitlines()[-1])
                runs[s][k].append(res)
                print(f"[{s} @ {k} #{r}] backward {res['backward_s']:.4f} s, step {res['step_s']:.4f} s, "
                      f"{res['faults_per_step']:.0f} faults/step", flush=True)
    doc = {"command": " ".join([Path(sys.executable).name] + sys.argv), "repos": repos, "wall_s":
           time.perf_counter() - t0, "machine": {"cpu": platform.processor() or platform.machine(),
                                                 "python": platform.python_version()}, "runs": runs}
    Path(args.out).with_suffix(".json").write_text(json.dumps(doc, indent=1))
    med = statistics.median
    lines = ["# Backward at world 1: this checkout against another", "",
             f"Command: `{doc['command']}` (wall {doc['wall_s']:.0f} s). HF GPT-2 6 x 384, micro-batch 8 x 128, "
             "one thread, Fabric loop; per run the median of the timed steps, here the median over runs "
             "(alternating A B B A); paired: the median over runs of this / other in the same round.", "",
             "| strategy | backward s: this | other | paired this/other (range) | step s: this | other | "
             "faults/step: this | other |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for s, by in runs.items():
        a, b = by["this"], by["other"]
        ratios = sorted(x["backward_s"] / y["backward_s"] for x, y in zip(a, b))
        lines.append(f"| {s} | {med(x['backward_s'] for x in a):.4f} | {med(x['backward_s'] for x in b):.4f} | "
                     f"{med(ratios):.3f} ({ratios[0]:.3f}-{ratios[-1]:.3f}) | {med(x['step_s'] for x in a):.4f} | "
                     f"{med(x['step_s'] for x in b):.4f} | {med(x['faults_per_step'] for x in a):.0f} | "
                     f"{med(x['faults_per_step'] for x in b):.0f} |")
    md = "\n".join(lines) + "\n"
    Path(args.out).with_suffix(".md").write_text(md)
    print("\n" + md)


if __name__ == "__main__":
    main()
