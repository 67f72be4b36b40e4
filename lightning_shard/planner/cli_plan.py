"""`lightning-shard plan`: memory, traffic and step time of every strategy for a model on a topology.

    lightning-shard plan gpt_7b --preset hgx_h100_8 --global-batch 64 --micro-batch 1
    lightning-shard plan --params 7e9 --layers 32 --hidden 4096 --seq 4096 --preset h100_nvl_8 --json
    lightning-shard plan gpt_1b --preset pcie_8 --preset h100_nvl_8 --plot strategies.png

The table lists every candidate by step time; `*` marks the recommendation (of the rows that fit, the leanest
within 2% of the fastest), `2nd` the runner-up. Under "recommended" come the Hydra command and the Python
constructor that run the pick as planned (advice.py); `--json` carries them for every row.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from typing import Any, Optional


def register(sub: Any) -> None:
    from .models import recipe_names

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
    p.add_argument("--global-batch", type=int, help="samples per optimizer step, all ranks (default: the recipe's; "
                   "a planning size or shape: 64)")
    p.add_argument("--micro-batch", type=int, help="samples per rank per forward/backward (default: the recipe's; "
                   "a planning size or shape: 1)")
    p.add_argument("--precision", help="Lightning precision (default: the recipe's trainer, 32-true; a planning size "
                   "or shape: bf16-true)")
    p.add_argument("--optimizer", default="adam", choices=["adam", "sgd", "sgd_plain"])
    p.add_argument("--device-memory-gb", type=float, help="override the device memory figure")
    p.add_argument("--device-tflops", type=float, help="override the device's dense 16-bit TFLOP/s")
    p.add_argument("--calibrate", action="store_true",
                   help="measure this machine first (one process per planned rank: compute, optimizer, collectives "
                        "by size) and plan with the calibrated time model; a cached profile is reused")
    p.add_argument("--profile", metavar="FILE.json",
                   help="with --calibrate: the machine profile to read and write (default: the cache, "
                        "~/.cache/lightning_shard/profiles or $LIGHTNING_SHARD_CACHE)")
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    p.add_argument("--plot", metavar="FILE.png",
                   help="bar charts of step time and memory per strategy and topology, each topology's memory limit")
    p.set_defaults(func=run)


def build_model(args: argparse.Namespace):
    from .models import from_recipe, from_shape

    if args.recipe:
        return from_recipe(args.recipe)
    return from_shape(args.params, args.layers, args.hidden, args.heads, args.seq or 2048, args.vocab)


def run(args: argparse.Namespace) -> int:
    from .hardware import device_spec
    from .models import recipe_job
    from .recommend import plan, resolve_topology

    if args.profile and not args.calibrate:
        raise ValueError("--profile is the calibrated model's machine profile: add --calibrate")
    if args.calibrate and args.preset and len(args.preset) > 1:
        raise ValueError("--calibrate measures this machine: plan one topology (the one this machine has)")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise ValueError("--plot needs matplotlib: pip install 'lightning-shard[plot]'")
    module = build_model(args)
    job, source = recipe_job(args.recipe)
    given = {"global_batch": args.global_batch, "micro_batch": args.micro_batch, "precision": args.precision}
    job.update({k: v for k, v in given.items() if v is not None})
    if not all(v is not None for v in given.values()):
        print(f"planning with global batch {job['global_batch']}, micro-batch {job['micro_batch']}, precision "
              f"{job['precision']}: {source} (--global-batch, --micro-batch, --precision to change)", file=sys.stderr)
    topologies = args.preset or [args.file or "detect"]
    results = []
    for name in topologies:
        device = None
        if args.device_memory_gb or args.device_tflops:
            d = resolve_topology(name, args.gpus or 1).devices[0]
            device = device_spec(d.model, d.kind, args.device_memory_gb, args.device_tflops)
        results.append(plan(module, name, args.gpus, job["global_batch"], job["micro_batch"], job["precision"],
                            seq=args.seq, optimizer=args.optimizer, device=device, calibrate=args.calibrate,
                            profile_path=args.profile))
        if results[-1].calibration:
            print(f"calibration: {results[-1].calibration}", file=sys.stderr)
    if args.json:
        print(json.dumps([r.to_dict(args.recipe) for r in results], indent=2, default=str))
    else:
        for r in results:
            render(r, args.recipe)
    if args.plot:
        plot(results, args.plot)
    return 0


def _gib(x: float) -> str:
    return f"{x / 2**30:.1f}"


def _gb(x: float) -> str:
    return f"{x / 1e9:.1f}" if x else "-"


def legend() -> str:
    from .recommend import TIE

    return (f"rows by step time. * = recommended: the leanest row that fits within {TIE:.0%} of the fastest; "
            f"2nd = runner-up: the fastest other row that fits; dim = does not fit")


def render(res: Any, recipe: Optional[str] = None) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from .advice import reproduce

    ctx = res.context
    # a calibrated plan's rates are this machine's: name its device as the profile does, not the preset's nominal one
    device = (f"{ctx.rates.profile.machine.get('device') or ctx.device.name} (calibrated)" if ctx.calibrated
              else ctx.device.name)
    title = (f"{ctx.placement.topology.name}: {ctx.job.world} x {device}, {ctx.psi / 1e9:.2f}B params, "
             f"{ctx.job.precision}, micro-batch {ctx.job.micro_batch} x {ctx.job.seq} tokens, "
             f"accumulation {ctx.job.accumulation}")
    t = Table(title=escape(title))  # names come from presets and capture files: never rich markup
    for col in ("strategy", "GiB/rank", "fits", "GB intra-island", "GB inter-island", "GB inter-node",
                "step s", "exposed comm s", "tokens/s"):
        t.add_column(col, justify="left" if col == "strategy" else "right", no_wrap=col == "strategy")
    for row in sorted(res.rows, key=lambda r: r.time.total):
        star = " *" if row is res.best else (" 2nd" if row is res.runner_up else "")
        style = "bold green" if row is res.best else (None if row.fits else "dim")
        t.add_row(escape(row.label + star), _gib(row.memory["total"]), "yes" if row.fits else "NO",
                  _gb(row.traffic["intra-island"]), _gb(row.traffic["inter-island"]), _gb(row.traffic["inter-node"]),
                  f"{row.time.total:.3f}", f"{row.time.exposed_comm:.3f}", f"{row.tokens_per_s:,.0f}", style=style)
    console = Console(width=160)
    console.print(t)
    console.print(f"[dim]{escape(legend())}[/dim]")
    console.print(f"recommended: {escape(res.reason)}")
    how = reproduce(res, recipe=recipe)
    plain = dict(soft_wrap=True, markup=False, highlight=False)  # one line each: copy and paste
    console.print(f"  hydra:  {how.command}", **plain)
    console.print(f"  python: {how.imports.replace(chr(10), '; ')}", **plain)
    console.print(f"          {how.trainer}", **plain)
    for note in how.notes:
        console.print(f"  note:   {note}", **plain)
    if ctx.calibrated:
        prof = ctx.rates.profile
        compute = "measured" if ctx.rates.compute else "at the measured matmul FLOP/s"
        timing = (f"calibrated on this machine ({prof.machine.get('device')}, {prof.machine.get('backend')}, "
                  f"{prof.machine.get('world')} ranks): compute {compute}, collectives by path and size, the "
                  f"optimizer step, {ctx.rates.overlap:.0%} of hideable communication overlapped")
    else:
        timing = (f"nominal: 6Ψ+attention FLOPs at {ctx.efficiency:.0%} of peak, rings at {ctx.bus_efficiency:.0%} "
                  "of their slowest link (--calibrate: measured on this machine)")
    console.print(f"[dim]memory: peak per rank incl. activations ({_gib(ctx.activations)} GiB, Korthikanti et al. "
                  f"2022, fused attention); usable = 90% of {_gib(ctx.device.memory_bytes)} GiB. Bytes: wire bytes "
                  f"per rank per optimizer step by the slowest hop of each ring. Time: {escape(timing)}.[/dim]")


def plot(results: list, path: str) -> Any:
    """Step time and peak memory per rank, one bar per strategy and topology (hybrid rows included: a label any
    topology has gets a row), each topology's usable memory as a labelled dashed line. Returns the figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(r.label for res in results for r in sorted(res.rows, key=lambda r: r.time.total)))
    fig, axes = plt.subplots(1, 2, figsize=(14, 0.35 * len(labels) * max(1, len(results)) / 2 + 2.5))
    height = 0.8 / len(results)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, res in enumerate(results):
        by = {r.label: r for r in res.rows}
        ys = [i + k * height for i in range(len(labels))]
        name = res.context.placement.topology.name
        color = colors[k % len(colors)]
        axes[0].barh(ys, [by[lb].time.total if lb in by else 0 for lb in labels], height, label=name, color=color)
        axes[1].barh(ys, [by[lb].memory["total"] / 2**30 if lb in by else 0 for lb in labels], height, label=name,
                     color=color)
        usable = 0.9 * res.context.device.memory_bytes / 2**30  # memory.fits: 90% of the device
        axes[1].axvline(usable, color=color, ls="--", lw=1.2,
                        label=f"{name} limit: {usable:.1f} GiB usable ({res.context.device.name})")
    for ax, xl in zip(axes, ("predicted step time (s)", "peak memory per rank (GiB)")):
        ax.set_yticks([i + 0.4 - height / 2 for i in range(len(labels))], labels)
        ax.set_xlabel(xl)
        ax.set_ylim(len(labels), -0.2)  # first label on top
        ax.legend(fontsize="small")
    axes[1].set_yticklabels([])
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return fig
