"""Before and after: the speed suite's runs of two code versions, alternated, in one table.

Run ``bench_speed.py`` several times, alternating an older checkout (a ``git worktree``) and this one, each into a
directory of its own (``--out-dir``), then::

    python bench/ab.py --side old /tmp/ab/old_1 /tmp/ab/old_2 --side new /tmp/ab/new_1 /tmp/ab/new_2 \\
        --base fsdp2 --out bench/results/some_ab.md --title "..."

For every model (row set) and variant: each round's tokens/s (the mean over the ranks, ``repeats[i]`` of the runs'
``speed.json``) and, per side, the paired ratio against ``--base`` (the baseline's run of the same round),
median and range over all the side's rounds. The baseline's code is the same on both sides when it is a peer.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from speed import paired  # noqa: E402


def _median_range(values: list[float]) -> str:
    v = sorted(values)
    if not v:
        return "-"
    mid = len(v) // 2
    median = v[mid] if len(v) % 2 else (v[mid - 1] + v[mid]) / 2
    return f"{median:.3f} ({v[0]:.2f}-{v[-1]:.2f})"


def load(dirs: list[str]) -> list[dict[str, Any]]:
    out = []
    for d in dirs:
        path = Path(d) / "speed.json"
        if not path.exists():
            raise SystemExit(f"ab.py: {path} does not exist (a bench_speed.py run with --out-dir {d}?)")
        out.append(json.loads(path.read_text()))
    return out


def table(sides: dict[str, list[dict[str, Any]]], base: str) -> list[str]:
    lines: list[str] = []
    first = next(iter(sides.values()))[0]
    for k, row_set in enumerate(first["row_sets"]):
        lines += ["", f"## {row_set['title']}", ""]
        variants = list(row_set["results"])
        head = "| variant |" + "".join(f" {s}: runs | {s}: paired vs {base} |" for s in sides)
        lines += [head, "| --- |" + " --- | ---: |" * len(sides)]
        for v in variants:
            cells = []
            for runs in sides.values():
                rates, ratios = [], []
                for run in runs:
                    res = run["row_sets"][k]["results"]
                    r = res.get(v, {})
                    rates += [f"{x['tokens_per_s_mean']:.0f}" for x in r.get("repeats", [])]
                    ratios += paired(r, res.get(base))
                cells += ["/".join(rates) or "-", _median_range(ratios)]
            lines.append(f"| {v} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--side", nargs="+", action="append", required=True, metavar=("NAME", "DIR"),
                   help="a side's name, then its runs' --out-dir directories in the order they ran")
    p.add_argument("--base", default="ddp", help="the variant the paired ratios divide by (default ddp)")
    p.add_argument("--title", default="Before and after, alternating runs")
    p.add_argument("--note", default="", help="a paragraph under the title: the commands, the order, the commits")
    p.add_argument("--out", help="write the table here (markdown) as well as to stdout")
    args = p.parse_args(argv)
    sides = {}
    for name, *dirs in args.side:
        if not dirs:
            p.error(f"--side {name}: give the directories of its runs")
        sides[name] = load(dirs)
    lines = [f"# {args.title}", *([""] + [args.note] if args.note else []), *table(sides, args.base)]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
