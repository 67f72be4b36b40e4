"""torch.compile on CPU (inductor) under our strategies and Lightning Fabric's DDP, side by side: tokens/s with the
recipe GPT's blocks compiled in place against eager, the time of the first (compiling) step and dynamo's graph
breaks. Every job is a fresh pair of processes (Fabric's launcher), 1 thread each, gloo; jobs alternate their
order (ABC CBA); tokens/s is the best of the repeats.

    .venv/bin/python bench/bench_compile.py            # -> bench/results/compile_<hardware>_<date>.{json,md}
    .venv/bin/python bench/bench_compile.py --repeats 1 --steps 4 --variants zero2

The peer of zero3 / fsdp_shard is torch FSDP2 (``fully_shard`` on each block, then the model) through Lightning
Fabric's ``ModelParallelStrategy``; blocks are compiled before sharding, as torch's FSDP2 documentation does.
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

from naming import result_stem

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("ddp", "zero1", "zero2", "zero3", "fsdp_shard", "fsdp2")
PEERS = {"ddp": "Lightning Fabric DDP", "fsdp2": "torch FSDP2 (Fabric ModelParallelStrategy)"}
MODES = ("eager", "inductor")


def job(args: argparse.Namespace) -> None:
    """One training run (re-run per rank by Fabric's launcher); rank 0 writes its figures to ``--out``."""
    import torch
    import torch.nn.functional as F
    from lightning.fabric import Fabric
    from torch.utils.data import DataLoader

    import lightning_shard  # noqa: F401  registers the strategy names in Fabric's registry
    from lightning_shard.recipes.gpt import GPT
    from lightning_shard.recipes.synthetic import SyntheticTokens

    torch.set_num_threads(1)
    strategy = args.variant
    if strategy == "fsdp2":
        from lightning.fabric.strategies import ModelParallelStrategy
        from torch.distributed.fsdp import fully_shard

        def parallelize(module, mesh):
            for block in module.blocks:
                fully_shard(block, mesh=mesh)
            return fully_shard(module, mesh=mesh)

        strategy = ModelParallelStrategy(parallelize, data_parallel_size=args.devices, tensor_parallel_size=1,
                                         process_group_backend="gloo")
    fabric = Fabric(accelerator="cpu", devices=args.devices, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(0)
    model = GPT(vocab_size=args.vocab, block_size=args.block, n_layer=args.layers, n_head=args.width // 64,
                n_embd=args.width, dropout=0.0)
    if args.mode == "inductor":
        import torch._dynamo

        for block in model.blocks:
            block.compile()  # inductor, in place: parameter names unchanged
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    model, optimizer = fabric.setup(model, optimizer)
    total = args.warmup + args.steps
    data = SyntheticTokens(total * args.devices * args.batch, args.block, args.vocab)
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=args.batch, shuffle=False))
    marks = []
    for x, y in loader:
        t = time.perf_counter()
        loss = F.cross_entropy(model(x).reshape(-1, args.vocab), y.reshape(-1))
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        fabric.barrier()
        marks.append((t, time.perf_counter()))
    timed = marks[args.warmup:]
    wall = timed[-1][1] - timed[0][0]
    out = {"variant": args.variant, "mode": args.mode, "tokens_per_s": args.steps * args.batch * args.block / wall,
           "first_step_s": marks[0][1] - marks[0][0], "final_loss": float(loss),
           "slowest_warmup_s": max(e - b for b, e in marks[:args.warmup])}
    if args.mode == "inductor":
        out["graph_breaks"] = sum(torch._dynamo.utils.counters["graph_break"].values())
        out["graphs"] = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    if fabric.global_rank == 0:
        Path(args.out).write_text(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8, help="timed optimizer steps")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps (the first compiles)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"),
                    help="where compile_<hardware>_<date>.json / .md go (naming.py; default bench/results)")
    ap.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.job:
        return job(args)
    t0 = time.perf_counter()
    pairs = [(v, m) for v in args.variants for m in MODES]
    results: dict[str, list[dict]] = {}
    tmp = Path(args.out_dir) / "compile.tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    for r in range(args.repeats):
        for v, m in (pairs if r % 2 == 0 else pairs[::-1]):
            out = tmp / f"{v}.{m}.{r}.json"
            cmd = [sys.executable, __file__, "--job", "--variant", v, "--mode", m, "--out", str(out)]
            cmd += [f"--{k}={getattr(args, k)}" for k in ("steps", "warmup", "layers", "width", "vocab", "block",
                                                          "batch", "devices")]
            env = dict(os.environ, OMP_NUM_THREADS="1")
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
            if proc.returncode != 0 or not out.exists():
                raise SystemExit(f"{v} {m} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
            res = json.loads(out.read_text())
            results.setdefault(f"{v}/{m}", []).append(res)
            print(f"[{v} {m} #{r}] {res['tokens_per_s']:.0f} tok/s/rank, slowest warmup step {_compile_s(res):.1f} s",
                  flush=True)
    doc = {"command": " ".join(["python", *sys.argv]), "wall_s": time.perf_counter() - t0, "args": vars(args),
           "machine": {"cpus": os.cpu_count(), "python": platform.python_version()}, "results": results}
    stem = result_stem("compile")  # naming.py
    Path(args.out_dir, f"{stem}.json").write_text(json.dumps(doc, indent=1))
    Path(args.out_dir, f"{stem}.md").write_text(report(doc))
    print(f"wrote {Path(args.out_dir) / stem}.json, {Path(args.out_dir) / stem}.md")


def _compile_s(run: dict) -> float:
    return run.get("slowest_warmup_s", run["first_step_s"])


def report(doc: dict) -> str:
    import torch

    a = doc["args"]
    lines = ["# torch.compile (inductor, CPU) under the strategies", "",
             f"{doc['machine']['cpus']} cores, {a['devices']} CPU ranks x 1 thread, gloo; torch {torch.__version__}; "
             f"recipe GPT {a['layers']}x{a['width']} (vocab {a['vocab']}), micro-batch {a['batch']} x {a['block']} per "
             f"rank, AdamW; every block compiled in place (`block.compile()`, inductor) or eager; {a['warmup']} warmup "
             f"+ {a['steps']} timed steps, {a['repeats']} runs per row in alternating order, best run's tokens/s. The "
             "slowest warmup step is the one that compiles (the first, or the second under zero3 / fsdp_shard, "
             "whose first step runs eagerly while the engine discovers its plan; inductor's kernel cache in "
             "/tmp persists across runs, so later jobs compile faster); graph breaks and graphs are dynamo's "
             "counters on rank 0.",
             f"Command: `{doc['command']}` (wall {doc['wall_s']:.0f} s).", "",
             "| strategy | eager tok/s | inductor tok/s | inductor / eager | "
             "slowest warmup step eager / inductor (s) | final loss eager / inductor | graph breaks | graphs |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for v in a["variants"]:
        e, i = doc["results"].get(f"{v}/eager", []), doc["results"].get(f"{v}/inductor", [])
        if not e or not i:
            continue
        be, bi = max(r["tokens_per_s"] for r in e), max(r["tokens_per_s"] for r in i)
        name = PEERS.get(v, v)
        lines.append(f"| {name} | {be:.0f} | {bi:.0f} | {bi / be:.2f} | {min(_compile_s(r) for r in e):.1f} / "
                     f"{min(_compile_s(r) for r in i):.1f} | {e[0]['final_loss']:.5f} / {i[0]['final_loss']:.5f} | "
                     f"{i[0].get('graph_breaks', '-')} | {i[0].get('graphs', '-')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
