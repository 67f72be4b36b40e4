"""The local half of the all-to-all reduce-scatter, timed: the sum of N rank pieces (an N x n tensor) into one
piece, as ``torch.sum(pieces, dim=0, out=out)`` against row-order adds (``out = p0 + p1``, ``out += p2`` ...:
``engine/comm/reduce.sum_pieces_into``), one CPU thread, best of ``--repeats`` rounds of ``--iters`` calls after a
warm-up call. Also says whether each result equals the row-order sum bit for bit.

Writes ``bench/results/sum_pieces.{json,md}``::

    .venv/bin/python bench/bench_sum.py
    .venv/bin/python bench/bench_sum.py --rows 2 4 --piece-mib 6 --dtypes float32

No thresholds: this script reports, it does not judge.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any, Callable

RESULTS = Path(__file__).resolve().parent / "results"


def _best(fn: Callable[[], Any], iters: int, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - t0) / iters)
    return best


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    import lightning_shard
    from lightning_shard.engine.comm.reduce import sum_pieces_into

    torch.set_num_threads(1)
    rows_out = []
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        for mib in args.piece_mib:
            for rows in args.rows:
                n = int(mib * 2**20) // torch.tensor([], dtype=dtype).element_size()
                pieces = torch.randn(rows, n, dtype=torch.float32).to(dtype)
                out = torch.empty(n, dtype=dtype)
                ordered = pieces[0].clone()
                for j in range(1, rows):
                    ordered += pieces[j]
                t_sum = _best(lambda p=pieces, o=out: torch.sum(p, dim=0, out=o), args.iters, args.repeats)
                sum_exact = bool(torch.equal(out, ordered))
                t_adds = _best(lambda p=pieces, o=out: sum_pieces_into(p, o), args.iters, args.repeats)
                adds_exact = bool(torch.equal(out, ordered))
                rows_out.append(dict(dtype=dtype_name, piece_mib=mib, rows=rows, torch_sum_ms=t_sum * 1e3,
                                     sum_pieces_into_ms=t_adds * 1e3, speedup=t_sum / t_adds,
                                     torch_sum_is_row_order=sum_exact, sum_pieces_into_is_row_order=adds_exact))
                print(f"{dtype_name} {mib} MiB x {rows}: torch.sum {t_sum * 1e3:.2f} ms, sum_pieces_into "
                      f"{t_adds * 1e3:.2f} ms ({t_sum / t_adds:.2f}x)", flush=True)
    return dict(machine=dict(python=platform.python_version(), torch=torch.__version__,
                             lightning_shard=getattr(lightning_shard, "__version__", "?"), cpu=platform.processor()),
                iters=args.iters, repeats=args.repeats, rows=rows_out)


def markdown(doc: dict[str, Any], command: str) -> str:
    lines = ["# Summing the all-to-all's pieces: torch.sum over rows vs row-order adds", "",
             f"One CPU thread; torch {doc['machine']['torch']}; best of {doc['repeats']} rounds of {doc['iters']} "
             "calls. `sum_pieces_into` is what the engine runs (comm/reduce.py); row-order: equal bit for bit "
             "to p0 + p1 + ... added in row order.", f"Command: `{command}`", "",
             "| dtype | piece MiB | rows | torch.sum ms | sum_pieces_into ms | speed-up | torch.sum row-order | "
             "sum_pieces_into row-order |", "| --- | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for r in doc["rows"]:
        lines.append(f"| {r['dtype']} | {r['piece_mib']:g} | {r['rows']} | {r['torch_sum_ms']:.2f} | "
                     f"{r['sum_pieces_into_ms']:.2f} | {r['speedup']:.2f}x | {r['torch_sum_is_row_order']} | "
                     f"{r['sum_pieces_into_is_row_order']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    import sys

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[2, 3, 4, 8], help="ranks (pieces summed)")
    p.add_argument("--piece-mib", type=float, nargs="+", default=[0.75, 3, 6, 12], help="MiB per piece")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out-dir", default=str(RESULTS))
    args = p.parse_args()
    doc = measure(args)
    command = "python bench/bench_sum.py " + " ".join(sys.argv[1:])
    doc["command"] = command.strip()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sum_pieces.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / "sum_pieces.md").write_text(markdown(doc, command.strip()))
    print(f"wrote {out / 'sum_pieces.md'}")


if __name__ == "__main__":
    main()
