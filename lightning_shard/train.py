"""Hydra entry point: ``python -m lightning_shard.train [overrides]`` (the only module that imports Hydra).

Composes ``conf/train.yaml`` (strategy x recipe x trainer), derives ``accumulate_grad_batches`` from the
recipe's global and micro batch sizes and the launch shape, fits, and prints a summary table on rank 0.
"""

from __future__ import annotations

import os
from typing import Any

import hydra
import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher

from lightning_shard.batching import derive_accumulation
from lightning_shard.callbacks import CommSummary

REQUIRED_KEYS = (
    "seed", "threads_per_rank", "val_every_n_steps",
    "strategy._target_",
    "recipe.name", "recipe.global_batch_size", "recipe.micro_batch_size",
    "recipe.data._target_", "recipe.model._target_",
    "trainer.accelerator", "trainer.devices", "trainer.num_nodes", "trainer.max_steps",
)
# Trainer kwargs that train.py sets itself; a trainer config that sets them would type things twice.
_OWNED_TRAINER_KEYS = ("strategy", "accumulate_grad_batches", "callbacks", "logger")


def check_config(cfg: DictConfig) -> int:
    """Validate ``cfg`` before any process starts; return the derived ``accumulate_grad_batches``."""
    missing = [k for k in REQUIRED_KEYS if OmegaConf.select(cfg, k, default=None) is None]
    if missing:
        raise ValueError(f"config is missing required keys {missing}; set them in conf/ or on the command "
                         f"line, e.g. {missing[0]}=...")
    owned = [k for k in _OWNED_TRAINER_KEYS if k in cfg.trainer]
    if owned:
        raise ValueError(f"trainer.{owned[0]} is set by lightning_shard.train, not by the trainer config; "
                         f"remove {['trainer.' + k for k in owned]} (accumulation is derived from "
                         f"recipe.global_batch_size / (recipe.micro_batch_size * world_size))")
    devices, num_nodes = cfg.trainer.devices, cfg.trainer.num_nodes
    if not isinstance(devices, int) or not isinstance(num_nodes, int):
        raise ValueError(f"trainer.devices and trainer.num_nodes must be integers to derive the world size, got "
                         f"devices={devices!r}, num_nodes={num_nodes!r}; e.g. trainer.devices=2 trainer.num_nodes=1")
    return derive_accumulation(cfg.recipe.global_batch_size, cfg.recipe.micro_batch_size, devices * num_nodes)


def build_trainer_kwargs(cfg: DictConfig, accumulate: int) -> dict[str, Any]:
    kwargs = OmegaConf.to_container(cfg.trainer, resolve=True)
    if kwargs.get("val_check_interval") is None:
        kwargs["val_check_interval"] = int(cfg.val_every_n_steps) * accumulate
    kwargs["accumulate_grad_batches"] = accumulate
    return kwargs


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
    rows += [
        ("train time (excl. validation)", f"{s['train_time_s']:.1f} s"),
        ("tokens / s (all ranks)", f"{s['tokens_per_s']:,.0f}"),
        ("first train loss (rank 0)", f"{s['first_train_loss']:.4f}"),
        ("last train loss (rank 0)", f"{s['last_train_loss']:.4f}"),
        (f"final val loss (step {s['final_val_step']})", f"{s['final_val_loss']:.4f}"),
    ]
    for name, value in rows:
        table.add_row(escape(name), escape(value))  # "op[group]" is not rich markup
    Console().print(table)


@hydra.main(config_path="../conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> dict[str, Any]:
    accumulate = check_config(cfg)  # before any rank is launched
    threads = int(cfg.threads_per_rank)
    os.environ["OMP_NUM_THREADS"] = str(threads)  # also stops Lightning's launchers from resetting threads
    torch.set_num_threads(threads)
    L.seed_everything(cfg.seed, workers=True)

    strategy = instantiate(cfg.strategy)
    datamodule = instantiate(cfg.recipe.data, micro_batch_size=cfg.recipe.micro_batch_size, seed=cfg.seed,
                             _convert_="all")
    module = instantiate(cfg.recipe.model, _convert_="all")

    comm = CommSummary()
    loggers: Any = False
    if cfg.logger.csv:
        from lightning.pytorch.loggers import CSVLogger
        loggers = CSVLogger(save_dir=HydraConfig.get().runtime.output_dir, name=cfg.logger.name)
    trainer = L.Trainer(strategy=strategy, callbacks=[comm], logger=loggers,
                        **build_trainer_kwargs(cfg, accumulate))
    if isinstance(getattr(trainer.strategy, "launcher", None), _MultiProcessingLauncher):
        # fork/spawn: fit runs in worker processes and this process gets none of the figures back, so
        # rank 0's worker prints the table at the end of fit (no extra final validation in this mode).
        comm.on_fit_end_fn = print_summary
        trainer.fit(module, datamodule=datamodule)
        return {}
    trainer.fit(module, datamodule=datamodule)
    last_val_step = comm.val_losses[-1][0] if comm.val_losses else None
    if cfg.final_validation and last_val_step != trainer.global_step:
        trainer.validate(module, datamodule=datamodule, verbose=False)

    summary = comm.summary(trainer)
    if trainer.is_global_zero:
        print_summary(summary)
    return summary


if __name__ == "__main__":
    main()
