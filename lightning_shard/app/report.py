"""Run summaries (``summary.json`` in each run folder) and the sweep comparison report.

Every run of ``lightning_shard.train`` writes ``summary.json`` next to its logs. At the end of a ``-m`` sweep
``write_report(sweep_dir)`` reads every ``*/summary.json`` below the sweep folder and writes
``report.md`` (a Markdown table) and ``report.png`` (matplotlib bars: throughput, model-state memory per
rank, wire bytes per optimizer step), one row / bar per run, labelled strategy/topology/recipe.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from typing import Any, Iterable, Optional

SUMMARY_FILE = "summary.json"
REPORT_MD = "report.md"
REPORT_PNG = "report.png"
NO_PLOT = "no report.png: matplotlib is not installed (pip install 'lightning-shard[plot]')"


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # tensors / numpy scalars
        return value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_summary(run_dir: str | Path, summary: dict[str, Any]) -> Path:
    path = Path(run_dir) / SUMMARY_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(_plain(summary), indent=2, sort_keys=True))
    tmp.replace(path)  # atomic: a report never reads half a file
    return path


def read_summaries(sweep_dir: str | Path) -> list[dict[str, Any]]:
    rows = []
    for path in sorted(Path(sweep_dir).glob(f"*/{SUMMARY_FILE}")):
        data = json.loads(path.read_text())
        data["run_dir"] = path.parent.name
        rows.append(data)
    return rows


def label(row: dict[str, Any]) -> str:
    return "/".join(str(row.get(k, "?")) for k in ("strategy", "topology", "recipe"))


def _mib(n: Any) -> str:
    return "-" if n is None else f"{n / 2**20:.3f}"


def _num(n: Any, fmt: str) -> str:
    return "-" if n is None else format(n, fmt)


def markdown_table(rows: Iterable[dict[str, Any]]) -> str:
    head = ("| run | strategy | topology | recipe | accumulation | world | tokens/s | model-state MiB/rank "
            "| gathered MiB | wire MiB/step | collectives/step | final val loss |")
    lines = [head, "|" + "|".join(["---"] * (head.count("|") - 1)) + "|"]
    for r in rows:
        mem = r.get("memory") or {}
        lines.append("| " + " | ".join([
            r.get("run_dir", "-"), str(r.get("strategy")), str(r.get("topology")), str(r.get("recipe")),
            str(r.get("accumulation_policy")), str(r.get("world_size")), _num(r.get("tokens_per_s"), ",.0f"),
            _mib(mem.get("total")), _mib(mem.get("gathered_params")), _mib(r.get("wire_bytes_per_step")),
            _num(r.get("collectives_per_step"), ".1f"), _num(r.get("final_val_loss"), ".4f")]) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # no display on a training node
    import matplotlib.pyplot as plt

    labels = [label(r) for r in rows]
    panels = [("throughput (tokens/s, all ranks)", [r.get("tokens_per_s") or 0.0 for r in rows]),
              ("model-state memory per rank (MiB)",
               [((r.get("memory") or {}).get("total") or 0) / 2**20 for r in rows]),
              ("wire bytes per optimizer step per rank (MiB)",
               [(r.get("wire_bytes_per_step") or 0) / 2**20 for r in rows])]
    fig, axes = plt.subplots(1, 3, figsize=(max(9, 1.4 * len(rows) * 3), 4.2))
    for ax, (title, values) in zip(axes, panels):
        bars = ax.bar(range(len(values)), values, color="#4c72b0")
        ax.set_title(title, fontsize=9)
        ax.set_xticks(range(len(values)))
        ax.set_xticklabels(labels, rotation=35, ha="right", fontsize=7)
        for b, v in zip(bars, values):
            ax.annotate(f"{v:,.3g}", (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom",
                        fontsize=7)
    fig.suptitle("lightning_shard sweep: strategy / topology / recipe", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def write_report(sweep_dir: str | Path) -> tuple[Path, Optional[Path]] | None:
    """Write ``report.md`` and ``report.png`` in ``sweep_dir``; None when no run left a summary. Without matplotlib
    (the ``plot`` extra) the report has no picture: the path of the png is None and report.md says why."""
    sweep_dir = Path(sweep_dir)
    can_plot = importlib.util.find_spec("matplotlib") is not None
    rows = read_summaries(sweep_dir)
    if not rows:
        return None
    md = sweep_dir / REPORT_MD
    failed = sorted(p.name for p in sweep_dir.iterdir() if p.is_dir() and not (p / SUMMARY_FILE).exists()
                    and not p.name.startswith("."))
    text = ["# Sweep report", "", f"{len(rows)} run(s) in `{sweep_dir}`; figures are rank 0's "
            "(memory: `engine.memory_report()`, wire bytes: the collective ledger per optimizer step).", "",
            markdown_table(rows),
            f"![sweep]({REPORT_PNG})" if can_plot else NO_PLOT, ""]
    if failed:
        text += [f"Runs without a summary (failed or still running): {', '.join(failed)}", ""]
    md.write_text("\n".join(text))
    return md, plot(rows, sweep_dir / REPORT_PNG) if can_plot else None
