"""The backend's collectives timed against each other, for the same tensor: what ``reduce_scatter_via="auto"`` rests
on (engine/comm/collectives.py).

For each world size and tensor size, every rank (one CPU thread each; gloo, or NCCL with ``--backend nccl`` on GPUs)
times, best of ``--repeats`` rounds of ``--iters`` calls after a warm-up, all launched ``async_op=True`` and waited
as the engine does:

* ``reduce_scatter``: the backend's reduce-scatter of the full tensor into this rank's 1/N;
* ``all_reduce+slice``: an in-place all-reduce of the full tensor and a copy of this rank's 1/N out of it (what the
  engine does with ``reduce_scatter_via="all_reduce"``: the copy is zero2/3's shard, freed buffer and all);
* ``all_to_all+sum``: an all-to-all of the full tensor (rank j receives every rank's j-th 1/N) and the sum of the
  N pieces (what the engine does with ``reduce_scatter_via="all_to_all"``: a reduce-scatter built from the
  backend's all-to-all, (N-1)/N of the tensor per rank, as the reduce-scatter);
* ``all_gather``: the backend's all-gather of 1/N per rank into the full tensor;
* ``all_reduce as gather``: zeros outside this rank's 1/N, then an in-place all-reduce (not used by the engine:
  measured to show why not);
* ``broadcasts as gather``: N broadcasts, rank j's from its own 1/N of the full tensor, all launched before any is
  waited (what the engine does with ``all_gather_via="broadcast"``, gloo's default: in place, the all-gather's bytes).

Writes ``bench/results/collectives_<hardware>_<date>.{json,md}`` (``naming.py``; with ``--backend nccl`` the hardware
is the GPU's model)::

    .venv/bin/python bench/bench_collectives.py                      # the suite: gloo, world 2 and 4, 0.25-88 MiB
    .venv/bin/python bench/bench_collectives.py --worlds 2 --sizes-mib 1 25 100

No thresholds: this script reports, it does not judge.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from naming import result_stem

RESULTS = Path(__file__).resolve().parent / "results"
OPS = ("reduce_scatter", "all_reduce+slice", "all_to_all+sum", "all_gather", "all_reduce as gather",
       "broadcasts as gather")


def _time_size(mib: float, rank: int, world: int, device: Any, args: argparse.Namespace) -> dict[str, Any]:
    """ms per call of each of :data:`OPS` for a ``mib`` MiB fp32 tensor, best of ``args.repeats`` rounds."""
    import torch
    import torch.distributed as dist

    numel = int(mib * 2**20) // 4 // world * world
    s = numel // world
    x = torch.randn(numel, device=device)
    mine = torch.empty(s, device=device)

    def rs() -> None:
        dist.reduce_scatter_tensor(mine, x, async_op=True).wait()

    def rs_ar() -> None:
        dist.all_reduce(x, async_op=True).wait()
        mine.copy_(x[rank * s:(rank + 1) * s])

    pieces = torch.empty(numel, device=device)

    def rs_a2a() -> None:
        dist.all_to_all_single(pieces, x, async_op=True).wait()
        torch.sum(pieces.view(world, s), dim=0, out=mine)

    def ag() -> None:
        dist.all_gather_into_tensor(x, mine, async_op=True).wait()

    def ag_ar() -> None:
        x[:rank * s].zero_()
        x[(rank + 1) * s:].zero_()
        dist.all_reduce(x, async_op=True).wait()

    slots = x.view(world, s)

    def ag_bc() -> None:
        works = [dist.broadcast(slots[j], src=j, async_op=True) for j in range(world)]
        for w in works:
            w.wait()

    row: dict[str, Any] = {"mib": mib, "world": world}
    for name, fn in zip(OPS, (rs, rs_ar, rs_a2a, ag, ag_ar, ag_bc)):
        for _ in range(2):
            fn()
        best, best_cpu = float("inf"), 0.0
        for _ in range(args.repeats):
            dist.barrier()
            if device.type == "cuda":
                torch.cuda.synchronize()
            t, cpu = time.perf_counter(), time.process_time()
            for _ in range(args.iters):
                fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            wall = (time.perf_counter() - t) / args.iters
            if wall < best:  # the process's CPU time (every thread: the backend's included) of the best round
                best, best_cpu = wall, (time.process_time() - cpu) / args.iters
        row[name] = best * 1e3
        row[f"{name} cpu"] = best_cpu * 1e3
    return row


def _rank(rank: int, world: int, init: str, args: argparse.Namespace, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(args.backend, init_method=init, rank=rank, world_size=world)
    device = torch.device("cuda", rank) if args.backend == "nccl" else torch.device("cpu")
    rows = [_time_size(mib, rank, world, device, args) for mib in args.sizes_mib]
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def markdown(doc: dict) -> str:
    lines = ["# Collectives against each other, same tensor", "",
             f"{doc['machine']}; backend {doc['backend']}, 1 thread per rank; best of {doc['repeats']} rounds of "
             f"{doc['iters']} async calls + wait, ms per call (rank 0); CPU: rank 0's process (every thread), "
             "ms per call.",
             f"Command: `{doc['command']}` (wall {doc['wall_s']:.0f} s).", "",
             "| world | MiB | reduce_scatter | all_reduce+slice | all_to_all+sum | RS / (AR+slice) | RS / (A2A+sum) "
             "| all_gather | all_reduce as gather | AG / (AR as gather) | broadcasts as gather | AG / broadcasts "
             "| CPU ms: all_gather / broadcasts |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in doc["rows"]:
        rs, a2a = r["reduce_scatter"], r.get("all_to_all+sum")  # absent from rows measured before it existed
        a2a_cells = ("-", "-") if a2a is None else (f"{a2a:.2f}", f"{rs / a2a:.2f}")
        lines.append(f"| {r['world']} | {r['mib']:g} | {rs:.2f} | {r['all_reduce+slice']:.2f} | {a2a_cells[0]} | "
                     f"{rs / r['all_reduce+slice']:.2f} | {a2a_cells[1]} | {r['all_gather']:.2f} | "
                     f"{r['all_reduce as gather']:.2f} | {r['all_gather'] / r['all_reduce as gather']:.2f} | "
                     + ("- | - | - |" if r.get("broadcasts as gather") is None else
                        f"{r['broadcasts as gather']:.2f} | {r['all_gather'] / r['broadcasts as gather']:.2f} | "
                        f"{r['all_gather cpu']:.2f} / {r['broadcasts as gather cpu']:.2f} |"))
    lines += ["", "A ratio above 1: the other form is faster than the backend's own collective. "
              "``reduce_scatter_via='auto'`` picks the gradient reduce-scatter's form per backend "
              "(comm/collectives.py), ``all_gather_via='auto'`` the parameter all-gather's (broadcasts on gloo).", ""]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--sizes-mib", type=float, nargs="+", default=[0.25, 1, 4, 25, 88])
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out-dir", default=str(RESULTS),
                   help="where collectives_<hardware>_<date>.json / .md go (naming.py; default bench/results)")
    args = p.parse_args()
    import torch.multiprocessing as mp

    t0 = time.perf_counter()
    rows = []
    for world in args.worlds:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rows.json")
            mp.spawn(_rank, args=(world, f"file://{tmp}/store", args, out), nprocs=world, join=True)
            rows += json.loads(Path(out).read_text())
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                   if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import torch

    doc = {"backend": args.backend, "iters": args.iters, "repeats": args.repeats, "rows": rows,
           "machine": f"{os.cpu_count()} cores ({cpu}), torch {torch.__version__}",
           "command": " ".join([Path(sys.executable).name] + sys.argv), "wall_s": time.perf_counter() - t0}
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = result_stem("collectives", device="cuda" if args.backend == "nccl" else "cpu")
    (out_dir / f"{stem}.json").write_text(json.dumps(doc, indent=1))
    md = markdown(doc)
    (out_dir / f"{stem}.md").write_text(md)
    print(md)
    print(f"wrote {out_dir / stem}.json, {out_dir / stem}.md")


if __name__ == "__main__":
    main()
