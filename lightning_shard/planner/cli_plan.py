"""`lightning-shard plan`: memory, traffic and step time of every strategy for a model on a topology.

    lightning-shard plan gpt_7b --preset hgx_h100_8 --global-batch 64 --micro-batch 1
    lightning-shard plan --params 7e9 --layers 32 --hidden 4096 --seq 4096 --preset h100_nvl_8 --json
    lightning-shard plan gpt_1b --preset pcie_8 --preset h100_nvl_8 --plot strategies.png
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from .models import recipe_names


def register(sub: Any) -> None:
    p = sub.add_parser("plan", help="predict memory, bytes per link class and step time per strategy; recommend one",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe", nargs="?", help=f"a recipe or planning size: {', '.join(recipe_names())}")
    p.add_argument("--params", type=float, help="parameter count (picks a standard shape), e.g. 7e9")
    p.add_argument("--layers", type=int)
    p.add_argument("--hidden", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--seq", type=int, default=None, help="tokens per sample (default: the model's context)")
    p.add_argument("--vocab", type=int, default=32000)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", action="append", metavar="NAME", help="topology preset (repeat to compare)")
    src.add_argument("--file", metavar="CAPTURE", help="a saved `nvidia-smi topo -m`")
    p.add_argument("--gpus", type=int, help="ranks (default: every device of the topology)")
    p.add_argument("--global-batch", type=int, default=64, help="samples per optimizer step, all ranks")
    p.add_argument("--micro-batch", type=int, default=1, help="samples per rank per forward/backward")
    p.add_argument("--precision", default="bf16-true")
    p.add_argument("--optimizer", default="adam", choices=["adam", "sgd", "sgd_plain"])
    p.add_argument("--device-memory-gb", type=float, help="override the device memory figure")
    p.add_argument("--device-tflops", type=float, help="override the device's dense 16-bit TFLOP/s")
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    p.add_argument("--plot", metavar="FILE.png", help="bar chart of step time and memory per strategy and topology")
    p.set_defaults(func=run)


def build_model(args: argparse.Namespace):
    from .models import from_recipe, from_shape

    if args.recipe:
        return from_recipe(args.recipe)
    return from_shape(args.params, args.layers, args.hidden, args.heads, args.seq or 2048, args.vocab)


def run(args: argparse.Namespace) -> int:
    from .hardware import device_spec
    from .recommend import plan, resolve_topology

    module = build_model(args)
    topologies = args.preset or [args.file or "detect"]
    results = []
    for name in topologies:
        topo = resolve_topology(name, args.gpus or 1)
        device = None
        if args.device_memory_gb or args.device_tflops:
            d = topo.devices[0]
            device = device_spec(d.model, d.kind, args.device_memory_gb, args.device_tflops)
        results.append(plan(module, topo, args.gpus, args.global_batch, args.micro_batch, args.precision,
                            seq=args.seq, optimizer=args.optimizer, device=device))
    if args.json:
        print(json.dumps([r.to_dict() for r in results], indent=2, default=str))
    else:
        for r in results:
            render(r)
    if args.plot:
        plot(results, args.plot)
    return 0


def _gib(x: float) -> str:
    return f"{x / 2**30:.1f}"


def _gb(x: float) -> str:
    return f"{x / 1e9:.1f}" if x else "-"


def render(res: Any) -> None:
    from rich.console import Console
    from rich.table import Table

    ctx = res.context
    title = (f"{ctx.placement.topology.name}: {ctx.job.world} x {ctx.device.name}, {ctx.psi / 1e9:.2f}B params, "
             f"{ctx.job.precision}, micro-batch {ctx.job.micro_batch} x {ctx.job.seq} tokens, "
             f"accumulation {ctx.job.accumulation}")
    t = Table(title=title)
    for col in ("strategy", "GiB/rank", "fits", "GB intra-island", "GB inter-island", "GB inter-node",
                "step s", "exposed comm s", "tokens/s"):
        t.add_column(col, justify="left" if col == "strategy" else "right")
    for row in sorted(res.rows, key=lambda r: r.time.total):
        star = " *" if row is res.best else (" 2nd" if row is res.runner_up else "")
        style = "bold green" if row is res.best else (None if row.fits else "dim")
        t.add_row(row.label + star, _gib(row.memory["total"]), "yes" if row.fits else "NO",
                  _gb(row.traffic["intra-island"]), _gb(row.traffic["inter-island"]), _gb(row.traffic["inter-node"]),
                  f"{row.time.total:.3f}", f"{row.time.exposed_comm:.3f}", f"{row.tokens_per_s:,.0f}", style=style)
    console = Console(width=150)
    console.print(t)
    console.print(f"recommended: {res.reason}")
    console.print(f"[dim]memory: peak per rank incl. activations ({_gib(ctx.activations)} GiB, Korthikanti et al. "
                  f"2022, fused attention); usable = 90% of {_gib(ctx.device.memory_bytes)} GiB. Bytes: wire bytes "
                  f"per rank per optimizer step by the slowest hop of each ring. Time: 6Ψ+attention FLOPs at "
                  f"{ctx.efficiency:.0%} of peak, rings at {ctx.bus_efficiency:.0%} of their slowest link.[/dim]")


def plot(results: list, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r.label for r in results[0].rows]
    fig, axes = plt.subplots(1, 2, figsize=(14, 0.35 * len(labels) + 2))
    height = 0.8 / len(results)
    for k, res in enumerate(results):
        by = {r.label: r for r in res.rows}
        ys = [i + k * height for i in range(len(labels))]
        name = res.context.placement.topology.name
        axes[0].barh(ys, [by[lb].time.total if lb in by else 0 for lb in labels], height, label=name)
        axes[1].barh(ys, [by[lb].memory["total"] / 2**30 if lb in by else 0 for lb in labels], height, label=name)
    for ax, xl in zip(axes, ("predicted step time (s)", "peak memory per rank (GiB)")):
        ax.set_yticks([i + 0.4 - height / 2 for i in range(len(labels))], labels)
        ax.set_xlabel(xl)
        ax.invert_yaxis()
        ax.legend()
    axes[1].axvline(0.9 * results[0].context.device.memory_bytes / 2**30, color="red", ls="--", lw=1)
    axes[1].set_yticklabels([])
    fig.tight_layout()
    fig.savefig(path, dpi=100)
