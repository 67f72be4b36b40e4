"""Convergence of compressed communication (issue 14): loss curves of runs of ``python -m lightning_shard.train`` with
and without ``gather_quant`` / ``reduce_quant``, one plot, and a table of final losses and wire bytes per step.

    python bench/plot_quant.py --run zero3=outputs/gpt_tiny/zero3-cpu/<time> --run zero3_q8=... \\
        --out-png docs/compression_loss.png --out-md bench/results/quant_convergence.md

Each run folder is what the train job printed ("run folder: ..."): its Lightning CSV log (train_loss every 10 steps,
val_loss at each validation) and ``summary.json``. The first run named is the reference the others are compared with.
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path


def read_run(folder: Path) -> dict:
    metrics = sorted(folder.rglob("metrics.csv"))
    if not metrics:
        raise SystemExit(f"{folder}: no metrics.csv (a run folder of lightning_shard.train with the csv logger?)")
    train, val, wire = [], [], None
    with open(metrics[0]) as f:
        for row in csv.DictReader(f):
            step = int(row["step"])
            if row.get("train_loss"):
                train.append((step, float(row["train_loss"])))
            if row.get("val_loss"):
                val.append((step, float(row["val_loss"])))
            if row.get("comm/wire_bytes_step"):
                wire = float(row["comm/wire_bytes_step"])
    summary = json.loads((folder / "summary.json").read_text()) if (folder / "summary.json").exists() else {}
    return {"train": train, "val": val, "wire": wire, "summary": summary}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", action="append", required=True, metavar="NAME=FOLDER")
    p.add_argument("--out-png", required=True)
    p.add_argument("--out-md", required=True)
    p.add_argument("--title", default="GPT recipe (gpt_tiny), 2 CPU ranks, 300 steps")
    args = p.parse_args(argv)
    runs = {}
    for spec in args.run:
        name, _, folder = spec.partition("=")
        runs[name] = read_run(Path(folder))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, r in runs.items():
        ax1.plot(*zip(*r["train"]), label=name, lw=1)
        if r["val"]:
            ax2.plot(*zip(*r["val"]), marker="o", ms=3, label=name, lw=1)
    ax1.set(title="train loss (rank 0)", xlabel="optimizer step", ylabel="loss")
    ax2.set(title="validation loss", xlabel="optimizer step", ylabel="loss")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(args.title)
    fig.tight_layout()
    fig.savefig(args.out_png, dpi=110)
    ref_name, ref = next(iter(runs.items()))
    ref_val = ref["val"][-1][1]
    lines = [f"# Convergence with compressed communication: {args.title}", "",
             "Command: `python bench/plot_quant.py " + " ".join(f"--run {s}" for s in args.run) +
             f" --out-png {args.out_png} --out-md {args.out_md}`", "",
             f"| run | final val loss | vs {ref_name} | wire MiB / step / rank | vs {ref_name} |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for name, r in runs.items():
        val = r["val"][-1][1]
        lines.append(f"| {name} | {val:.4f} | {val / ref_val - 1:+.2%} | {r['wire'] / 2**20:.2f} | "
                     f"{r['wire'] / ref['wire']:.3f} |")
    text = "\n".join(lines) + "\n"
    Path(args.out_md).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
