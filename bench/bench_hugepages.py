"""What a fresh host buffer costs with and without the engine's huge-page advice (engine/comm/hostmem.py;
once the ``huge_pages`` option, now the engine's choice on CPU).

One process, one thread. For each size: ``--iters`` rounds of "allocate a fresh fp32 buffer, write it once, free
it" (the life of a zero2 gradient bucket or an all-to-all's pieces in one step), best of ``--repeats``, with the
minor page faults per round (``getrusage``); the same write into a buffer allocated once is the floor. Sizes above
32 MiB are always a fresh ``mmap`` for glibc; smaller ones may come from its heap (no faults) when the allocation
pattern lets it.

    .venv/bin/python bench/bench_hugepages.py            # writes bench/results/hugepages.{json,md}

No thresholds: this script reports, it does not judge.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lightning_shard.engine.comm import hostmem  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def measure(mib: float, huge: bool, iters: int, repeats: int, write: str) -> dict:
    n = int(mib * 2**20) // 4
    src = torch.randn(n)
    best, faults = float("inf"), 0.0
    for _ in range(repeats):
        f0, t0 = _faults(), time.perf_counter()
        for _ in range(iters):
            x = hostmem.empty(n, torch.float32, torch.device("cpu"), huge)
            x.copy_(src) if write == "copy" else x.zero_()
            del x
        wall = (time.perf_counter() - t0) / iters
        if wall < best:
            best, faults = wall, (_faults() - f0) / iters
    return {"ms": best * 1e3, "faults": faults}


def floor(mib: float, iters: int, repeats: int) -> float:
    n = int(mib * 2**20) // 4
    src, x = torch.randn(n), torch.empty(n)
    x.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            x.copy_(src)
        best = min(best, (time.perf_counter() - t0) / iters)
    return best * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-mib", type=float, nargs="+", default=[8, 25, 40, 88])
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out-dir", default=str(RESULTS))
    args = p.parse_args()
    torch.set_num_threads(1)
    rows = []
    for mib in args.sizes_mib:
        row = {"mib": mib, "preallocated copy ms": floor(mib, args.iters, args.repeats)}
        for write in ("copy", "zero"):
            for huge in (False, True):
                row[f"{write} huge={huge}"] = measure(mib, huge, args.iters, args.repeats, write)
        rows.append(row)
        print(json.dumps(row), flush=True)
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    doc = {"machine": f"{cpu}, torch {torch.__version__}, python {platform.python_version()}, transparent huge pages "
                      f"{hostmem.thp_mode()!r}",
           "command": "python bench/bench_hugepages.py " + " ".join(sys.argv[1:]), "rows": rows,
           "iters": args.iters, "repeats": args.repeats}
    lines = ["# A fresh host buffer, plain pages against huge-page advice", "",
             f"{doc['machine']}; one thread; per round: allocate a fresh fp32 buffer, write it once (a copy from "
             "another buffer, or zeros), free it; ms per round, best of "
             f"{args.repeats} x {args.iters} rounds, with the minor page faults of that round. Floor: the same copy "
             "into a buffer allocated once.",
             f"Command: `{doc['command']}`.", "",
             "| MiB | copy: plain ms (faults) | copy: advised ms (faults) | plain / advised | zeros: plain ms (faults) "
             "| zeros: advised ms (faults) | plain / advised | floor: preallocated copy ms |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        cells = []
        for write in ("copy", "zero"):
            a, b = r[f"{write} huge=False"], r[f"{write} huge=True"]
            cells += [f"{a['ms']:.2f} ({a['faults']:.0f})", f"{b['ms']:.2f} ({b['faults']:.0f})",
                      f"{a['ms'] / b['ms']:.2f}"]
        lines.append(f"| {r['mib']:g} | " + " | ".join(cells) + f" | {r['preallocated copy ms']:.2f} |")
    lines += ["", "Buffers of 32 MiB or less may come from glibc's heap, already mapped (few faults either way); "
              "above, every round is a fresh mapping. The engine's buckets are 25 MiB by default and grow past it by "
              "up to one parameter (bucket_mb), zero3 units are what their modules hold.", ""]
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "hugepages.json").write_text(json.dumps(doc, indent=1))
    (out / "hugepages.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
