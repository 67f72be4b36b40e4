"""`lightning-shard topo`: show the machine's (or a capture's / preset's) topology.

    lightning-shard topo                     # live machine: NVML, nvidia-smi, else cpu
    lightning-shard topo --file topo.txt     # a saved `nvidia-smi topo -m` (or rocm-smi --showtopo)
    lightning-shard topo --file topo.txt --model "H100 NVL"   # generations follow the GPU model
    lightning-shard topo --preset h100_nvl_8 --gpus 4 --json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from lightning_shard.topology.detect import detect
from lightning_shard.topology.groups import best_subset
from lightning_shard.topology.links import PCIE_X16_GBPS, LinkClass, fabric_for_models, generations_for
from lightning_shard.topology.model import Topology
from lightning_shard.topology.presets import from_capture, list_presets, load_preset

_STYLE = {LinkClass.NVSWITCH: "bold green", LinkClass.NVLINK: "green", LinkClass.XGMI: "green", LinkClass.SHM: "green",
          LinkClass.PCIE_SWITCH: "cyan", LinkClass.PCIE_HOSTBRIDGE: "cyan", LinkClass.NUMA_NODE: "yellow",
          LinkClass.CROSS_SOCKET: "red", LinkClass.NETWORK: "magenta", LinkClass.UNKNOWN: "dim", LinkClass.SELF: "dim"}

_PCIE = {LinkClass.PCIE_SWITCH, LinkClass.PCIE_HOSTBRIDGE, LinkClass.NUMA_NODE, LinkClass.CROSS_SOCKET}


def register(sub: Any) -> None:
    p = sub.add_parser("topo", help="show GPU topology: islands, link classes, bandwidths, best device subset",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--file", metavar="CAPTURE", help="a saved `nvidia-smi topo -m` or `rocm-smi --showtopo` output")
    src.add_argument("--preset", metavar="NAME", help=f"a preset of conf/topology: {', '.join(list_presets())}")
    p.add_argument("--partial", action="store_true", help="accept a capture with missing GPU rows (links unknown)")
    p.add_argument("--model", metavar="GPU", help="GPU model of a --file capture (e.g. 'H100 NVL'): the NVLink / "
                   "PCIe generations default to that model's (H100/H200: PCIe Gen5, A100: Gen4, V100: Gen3)")
    p.add_argument("--nvlink-gen", type=int, default=None,
                   help="NVLink generation for --file (1-5; default: the --model's, else 4)")
    p.add_argument("--pcie-gen", type=int, default=None,
                   help="PCIe generation for --file (3-5; default: the --model's, else 4)")
    p.add_argument("--gpus", type=int, metavar="K", help="also pick the K devices with the fastest ring")
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    p.set_defaults(func=run)


def load(args: argparse.Namespace) -> Topology:
    if args.preset:
        return load_preset(args.preset)
    if args.file:
        path = Path(args.file)
        if not path.exists():
            raise ValueError(f"--file {args.file}: no such file")
        if not path.is_file():
            raise ValueError(f"--file {args.file}: not a file (a directory?); give a saved `nvidia-smi topo -m` output")
        model = args.model
        fabric = fabric_for_models([model], args.nvlink_gen, args.pcie_gen)
        topo = from_capture(path, allow_partial=args.partial, fabric=fabric)
        if model:
            topo.devices = [replace(d, model=model) for d in topo.devices]
        if args.pcie_gen is None and generations_for(model)[1] is None and topo.link_classes() & _PCIE:
            why = (f"--model {model!r} is not a GPU whose PCIe generation we know" if model else
                   "a capture does not name its GPUs")
            topo.warnings.append(f"PCIe gen {topo.fabric.pcie_gen} assumed "
                                 f"({PCIE_X16_GBPS[topo.fabric.pcie_gen]:g} GB/s "
                                 f"per direction): {why}; pass --pcie-gen, or --model (e.g. --model 'H100 NVL')")
        return topo
    return detect()


def run(args: argparse.Namespace) -> int:
    topo = load(args)
    report = topo.to_dict()
    if args.gpus is not None:
        sub = best_subset(topo, args.gpus)
        report["best_subset"] = {"k": args.gpus, "devices": list(sub.devices), "ring_gbps": _num(sub.ring_gbps),
                                 "cuda_visible_devices": sub.cuda_visible_devices}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        render(topo, report)
    return 0


def _num(x: float) -> float | None:
    return None if x == float("inf") else x


def _gpus(topo: Topology) -> int:
    return sum(d.kind != "cpu" for d in topo.devices)


def header(topo: Topology) -> str:
    """The first line of the report (plain text): what the machine is, and the link generations it uses."""
    f = topo.fabric
    n = len(topo.devices)
    head = f"{topo.name}  source: {topo.source or '-'}  nodes: {topo.num_nodes}  devices: {n}"
    if _gpus(topo) == 0:  # no GPU: no NVLink or PCIe generation to speak of
        return head + f" CPU process{'es' if n != 1 else ''} (no GPU)"
    classes = topo.link_classes()
    links = ([f"NVLink gen {f.nvlink_gen}"] if classes & {LinkClass.NVLINK, LinkClass.NVSWITCH} else []) + \
        ([f"PCIe gen {f.pcie_gen}"] if classes & _PCIE else []) + \
        ([f"network {f.network}"] if topo.num_nodes > 1 else [])
    models = sorted({d.model for d in topo.devices if d.model})
    return head + (f" x {', '.join(models)}" if models else "") + ("  " + ", ".join(links) if links else "")


def render(topo: Topology, report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(file=sys.stdout)
    console.print(f"[bold]{escape(header(topo))}[/]")
    matrix = Table(title="links (topo -m tokens)", show_lines=False)
    matrix.add_column("")
    for d in topo.devices:
        matrix.add_column(escape(d.name), justify="center")
    matrix.add_column("NUMA")
    for d in topo.devices:
        cells = [f"[{_STYLE[lk.cls]}]{escape(lk.token or lk.cls.value)}[/]" for lk in topo.links[d.index]]
        matrix.add_row(escape(d.name), *cells, "-" if d.numa is None else str(d.numa))
    console.print(matrix)
    n = len(topo.devices)
    seen: dict[tuple[LinkClass, float], int] = {}
    for i in range(n):
        for j in range(i + 1, n):
            key = (topo.links[i][j].cls, topo.links[i][j].gbps)
            seen[key] = seen.get(key, 0) + 1
    if seen:
        classes = Table(title="link classes (per direction)")
        for col in ("class", "pairs", "GB/s", "latency us"):
            classes.add_column(col)
        for (cls, gbps), count in sorted(seen.items(), key=lambda kv: -kv[0][1]):
            classes.add_row(f"[{_STYLE[cls]}]{cls.value}[/]", str(count), f"{gbps:g}", f"{_lat(topo, cls):g}")
        console.print(classes)
    islands = Table(title="islands (components of the NVLink graph)")
    for col in ("#", "node", "devices", "link", "ring GB/s", "ring order"):
        islands.add_column(col)
    for k, isl in enumerate(topo.islands):
        names = [topo.devices[d].name for d in isl.devices]
        ring = "-" if isl.ring_gbps == float("inf") else f"{isl.ring_gbps:g}"
        islands.add_row(str(k), str(isl.node), escape(",".join(names)), isl.link.value, ring,
                        escape("-".join(topo.devices[d].name for d in isl.ring_order)))
    console.print(islands)
    for w in topo.warnings:
        console.print(f"[yellow]warning:[/] {escape(w)}")
    if "best_subset" in report:
        b = report["best_subset"]
        names = escape(", ".join(topo.devices[d].name for d in b["devices"]))
        console.print(f"best {b['k']} devices: {names}  ring "
                      f"{b['ring_gbps'] if b['ring_gbps'] is not None else '-'} GB/s  ->  "
                      f"[bold]CUDA_VISIBLE_DEVICES={escape(str(b['cuda_visible_devices']))}[/]")


def _lat(topo: Topology, cls: LinkClass) -> float:
    n = len(topo.devices)
    return next(topo.links[i][j].latency_us for i in range(n) for j in range(n) if topo.links[i][j].cls is cls)
