"""What a run tells the user: the summary table, ``summary.json``'s figures, the run folder and next steps
printed at the end, and Lightning's messages in the run folder's log files."""

from __future__ import annotations

import logging
import os
import shlex
import sys
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from lightning_shard.callbacks import CommSummary


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def print_summary(s: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="lightning_shard run summary", show_header=True)
    table.add_column("figure")
    table.add_column("value", justify="right")
    ledger_note = "" if s["ledger_available"] else " (no ledger)"
    rows = [
        ("strategy", s["strategy"]),
        ("topology / recipe", f"{s.get('topology', '-')} / {s.get('recipe', '-')}"),
        ("accumulation policy", s["accumulation_policy"]),
        ("world size", str(s["world_size"])),
        ("accumulate_grad_batches", str(s["accumulate_grad_batches"])),
        ("optimizer steps", str(s["optimizer_steps"])),
        ("wire bytes / optimizer step / rank" + ledger_note, _fmt_bytes(s["wire_bytes_per_step"])),
    ]
    rows += [(f"  {op}", _fmt_bytes(b)) for op, b in sorted(s["wire_bytes_per_step_by_op"].items())]
    rows += [("collectives / optimizer step", f"{s['collectives_per_step']:.1f}")]
    mem = s["memory"]
    rows.append((f"model-state memory / rank ({s['memory_source']})", _fmt_bytes(mem.get("total", 0))))
    # keys ending in "_elements" are counts (e.g. padding_elements), the others bytes
    rows += [(f"  {k}", f"{v:,}" if k.endswith("_elements") else _fmt_bytes(v))
             for k, v in mem.items() if k != "total"]
    unit = s.get("throughput_unit", "tokens")
    rows += [
        ("train time (excl. validation)", f"{s['train_time_s']:.1f} s"),
        (f"{unit} / s (all ranks)", f"{s['tokens_per_s']:,.0f}"),
        ("first train loss (rank 0)", f"{s['first_train_loss']:.4f}"),
        ("last train loss (rank 0)", f"{s['last_train_loss']:.4f}"),
        (f"final val loss (step {s['final_val_step']})", f"{s['final_val_loss']:.4f}"),
    ]
    rows += [(f"final {k}", f"{v:.4f}") for k, v in sorted(s.get("val_metrics", {}).items()) if k != "val_loss"]
    for name, value in rows:
        table.add_row(escape(name), escape(str(value)))  # "op[group]" is not rich markup
    Console().print(table)


def _choices() -> dict[str, str]:
    if not HydraConfig.initialized():
        return {}
    return {k: str(v) for k, v in HydraConfig.get().runtime.choices.items() if v is not None}


def full_summary(comm: CommSummary, trainer: L.Trainer, module: Any, cfg: DictConfig,
                 choices: dict[str, str], wall_s: float) -> dict[str, Any]:
    s = comm.summary(trainer)
    s.update({
        "strategy_config": choices.get("strategy", s["strategy"]),
        "topology": choices.get("topology", OmegaConf.select(cfg, "topology.name", default="-")),
        "recipe": cfg.recipe.name,
        "seed": int(cfg.seed),
        "throughput_unit": getattr(module, "throughput_unit", "tokens"),
        "step_losses": list(comm.step_losses),
        "val_losses": [list(v) for v in comm.val_losses],
        "val_metrics": {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val_")},
        "placement_warning": getattr(trainer.strategy, "placement_warning", None),
        "wall_time_s": wall_s,
    })
    return s


def log_to_run_files() -> None:
    """Send Lightning's log messages to Hydra's job log too (``train.log`` in rank 0's run folder,
    ``train_ddp_process_<rank>.log`` for the other ranks). Lightning's loggers do not propagate to the root
    logger that Hydra gives the file handler, so without this those files stay empty."""
    files = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    for name in ("lightning.pytorch", "lightning.fabric"):
        target = logging.getLogger(name)
        for h in files:
            if h not in target.handlers:
                target.addHandler(h)


def _short(path: str) -> str:
    """``path`` relative to the working directory when it lies below it (``.venv/bin/python``)."""
    rel = os.path.relpath(path)
    return rel if not rel.startswith("..") else path


def print_next_steps(out_dir: str, last_ckpt: Optional[str], module: Any) -> None:
    """The run folder and what to do with what it holds (printed by rank 0 at the end of a run)."""
    lines = [f"run folder: {out_dir}  (summary.json, train.log; per-rank logs train_ddp_process_<rank>.log)"]
    if last_ckpt is not None:
        # recipes hold the bare network as ``self.model``: its keys are the module's minus "model."
        prefix = "model." if isinstance(getattr(module, "model", None), torch.nn.Module) else ""
        python = _short(sys.executable)
        tool = Path(sys.executable).with_name("lightning-shard")
        tool_cmd = _short(str(tool)) if tool.exists() else "lightning-shard"
        task = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
        # a config folder of one's own (hydra.searchpath) is needed again to compose the same job
        searchpath = [o for o in (HydraConfig.get().overrides.hydra if HydraConfig.initialized() else [])
                      if o.startswith("hydra.searchpath=")]
        kept = [shlex.quote(o) for o in task + searchpath
                if not o.startswith(("ckpt_path=", "trainer.max_steps=")) and (not o.startswith("hydra.")
                                                                                 or o in searchpath)]
        # "last" searches the sibling folders of the default run folder; a run folder of one's own: its path
        own_dir = HydraConfig.initialized() and any(o.startswith("hydra.run.dir=")
                                                    for o in HydraConfig.get().overrides.hydra)
        resume_from = last_ckpt if own_dir else "last"
        kind = "sharded: one folder, every rank's part" if os.path.isdir(last_ckpt) else "one file"
        lines += [f"checkpoint: {last_ckpt}  ({kind})",
                  f"  resume:      {' '.join([python, '-m', 'lightning_shard.train', *kept])} ckpt_path={resume_from} "
                  "trainer.max_steps=<more>",
                  f"  consolidate: {tool_cmd} consolidate {last_ckpt} model.pt"
                  + (f" --strip-prefix {prefix}" if prefix else "")]
    print("\n".join(lines))
