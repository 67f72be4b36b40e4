"""Hydra entry point: ``python -m lightning_shard.train [overrides]`` (the only module that imports Hydra).

Composes ``conf/train.yaml`` (strategy x topology x recipe x trainer x logger x callbacks), checks it before
any rank is launched (``lightning_shard.app.checks``), derives ``accumulate_grad_batches`` from the recipe's
global and micro batch sizes and the world size the topology gives, fits, prints a summary table on rank 0
and writes ``summary.json`` in the run folder. In ``-m`` sweeps a job whose strategy uses the default
``popen`` launcher runs in a fresh process (Lightning's subprocess launcher re-runs ``sys.argv``, which in a
sweep would start the whole sweep again, in the wrong folder); with ``strategy.start_method=fork`` (or spawn)
the ranks are workers of the sweep process and jobs run in it, which saves a start-up per job. A sweep ends
with ``report.md`` / ``report.png`` in the sweep folder (:class:`SweepReport`).

Errors in the config (unknown group option, unknown key, wrong type, impossible batch) are reported by
:func:`main` in one line naming the key and the fix, with exit status 2, before Hydra or Lightning start.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import hydra
import lightning as L
import torch
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback as HydraCallback
from hydra.types import RunMode
from hydra.utils import instantiate
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from omegaconf import DictConfig, OmegaConf

from lightning_shard.app.checks import ConfigError, check_all, did_you_mean
from lightning_shard.app.launch import topology_fact
from lightning_shard.app.report import write_report, write_summary
from lightning_shard.app.schema import SCHEMAS
from lightning_shard.callbacks import CommSummary

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
REQUIRED_KEYS = (
    "seed", "threads_per_rank", "val_every_n_steps",
    "strategy._target_",
    "recipe.name", "recipe.global_batch_size", "recipe.micro_batch_size",
    "recipe.data._target_", "recipe.model._target_",
    "trainer.accelerator", "trainer.devices", "trainer.num_nodes", "trainer.max_steps",
)
# Trainer kwargs that train.py sets itself; a trainer config that sets them would type things twice.
_OWNED_TRAINER_KEYS = ("strategy", "accumulate_grad_batches", "callbacks", "logger")
_CHECKED_SECTIONS = ("strategy", "recipe", "trainer", "topology")


# ---------------------------------------------------------------------------------------------- registration
def _topo_resolver(fact: str, *, _root_: DictConfig) -> Any:
    node = OmegaConf.to_container(_root_.topology, resolve=True)
    return topology_fact(node, fact)


def register() -> None:
    """Store the schemas in Hydra's ConfigStore and register the ``ls.topo`` resolver (idempotent)."""
    cs = ConfigStore.instance()
    for group, nodes in SCHEMAS.items():
        for name, node in nodes.items():
            cs.store(group=group, name=name, node=node, provider="lightning_shard")
    OmegaConf.register_new_resolver("ls.topo", _topo_resolver, replace=True)


register()


# ---------------------------------------------------------------------------------------------- checks
def check_config(cfg: DictConfig) -> int:
    """Validate ``cfg`` before any process starts; return the derived ``accumulate_grad_batches``."""
    missing = [k for k in REQUIRED_KEYS if OmegaConf.select(cfg, k, default=None) is None]
    if missing:
        raise ConfigError(f"config is missing required keys {missing}; set them in conf/ or on the command "
                          f"line, e.g. {missing[0]}=...")
    owned = [k for k in _OWNED_TRAINER_KEYS if k in cfg.trainer]
    if owned:
        raise ConfigError(owned_key_message(owned[0]))
    accepted = trainer_keywords()
    unknown = [str(k) for k in cfg.trainer if k not in accepted]
    if unknown:
        raise ConfigError(f"trainer.{unknown[0]}: not a keyword of lightning.Trainer"
                          f"{did_you_mean(unknown[0], sorted(accepted))}; nothing was started")
    check_ckpt_path(cfg)
    plain = {k: OmegaConf.to_container(cfg[k], resolve=True) for k in _CHECKED_SECTIONS}
    islands = topology_fact(plain["topology"], "islands_per_node")
    return check_all(plain, islands)


def owned_key_message(key: str) -> str:
    """Why ``trainer.<key>`` may not be set, and what to set instead."""
    if key == "accumulate_grad_batches":
        return ("trainer.accumulate_grad_batches is derived, not set: recipe.global_batch_size / "
                "(recipe.micro_batch_size x world size); change recipe.global_batch_size or "
                "recipe.micro_batch_size instead (the world size comes from the topology)")
    instead = {"strategy": "strategy=<name> (conf/strategy/)", "callbacks": "callbacks=<name> (conf/callbacks/)",
               "logger": "logger=<name> (conf/logger/)"}[key]
    return f"trainer.{key} is set by lightning_shard.train, not by the trainer config; use {instead}"


def trainer_keywords() -> set[str]:
    import inspect

    return set(inspect.signature(L.Trainer.__init__).parameters) - {"self"}


# ---------------------------------------------------------------------------------------------- checkpoints
CKPT_DIR, LAST = "checkpoints", "last.ckpt"


def _run_dir(cfg: DictConfig) -> Optional[Path]:
    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir)
    if OmegaConf.select(cfg, "hydra", default=None) is None:
        return None
    hc = HydraConfig.instance()  # the preflight's composed config: resolve ${hydra:...} in hydra.run.dir
    hc.set_config(cfg)
    try:
        return Path(OmegaConf.select(cfg, "hydra.run.dir"))
    finally:
        hc.cfg = None


def resolve_ckpt_path(cfg: DictConfig) -> Optional[str]:
    """``ckpt_path``: null (start fresh), ``last`` (the newest ``checkpoints/last.ckpt`` among the earlier runs
    of this recipe x strategy x topology, i.e. the sibling folders of this run's folder), a run folder, or a
    checkpoint path. Raises :class:`ConfigError` when there is nothing to resume from."""
    value = cfg.get("ckpt_path")
    if value in (None, ""):
        return None
    value = str(value)
    if value == "last":
        if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
            raise ConfigError("ckpt_path=last is for single runs; in a -m sweep give each job a path")
        here = _run_dir(cfg)
        if here is None:
            raise ConfigError("ckpt_path=last needs a Hydra run folder; give a checkpoint path instead")
        found = sorted((p for p in here.parent.glob(f"*/{CKPT_DIR}/{LAST}") if p.parents[1] != here),
                       key=lambda p: p.parents[1].name)
        if not found:
            raise ConfigError(f"ckpt_path=last: no earlier run of this combination has {CKPT_DIR}/{LAST} under "
                              f"{here.parent}/; run once without ckpt_path (callbacks=default writes it), or "
                              f"give a path: ckpt_path=<run folder or .ckpt>")
        return str(found[-1])
    path = Path(value)
    if path.is_dir() and (path / CKPT_DIR / LAST).exists():  # a run folder
        return str(path / CKPT_DIR / LAST)
    if not path.exists():
        raise ConfigError(f"ckpt_path={value}: no such checkpoint or run folder")
    return str(path)


def check_ckpt_path(cfg: DictConfig) -> None:
    resolve_ckpt_path(cfg)


class FinalCheckpoint(L.Callback):
    """Makes ``checkpoints/last.ckpt`` hold the final step: Lightning's ``ModelCheckpoint`` saves on its own
    schedule (``every_n_train_steps``), so a run whose last step is not on it would resume from an older one.
    Saved in ``on_train_end``, while the strategy still holds its shards (sharded format)."""

    def __init__(self) -> None:
        self.path: Optional[str] = None

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        cb = trainer.checkpoint_callback
        if cb is None or not getattr(cb, "save_last", False) or cb.dirpath is None:
            return
        self.path = os.path.join(cb.dirpath, LAST)
        if getattr(cb, "_last_global_step_saved", None) != trainer.global_step or not os.path.exists(self.path):
            trainer.save_checkpoint(self.path)  # collective: every rank runs this hook


def build_trainer_kwargs(cfg: DictConfig, accumulate: int) -> dict[str, Any]:
    kwargs = {k: v for k, v in OmegaConf.to_container(cfg.trainer, resolve=True).items() if v is not None
              or k in ("val_check_interval", "check_val_every_n_epoch")}
    if kwargs.get("val_check_interval") is None:
        kwargs["val_check_interval"] = int(cfg.val_every_n_steps) * accumulate
    kwargs["accumulate_grad_batches"] = accumulate
    return kwargs


def build_callbacks(cfg: DictConfig, run_dir: Optional[str] = None) -> list[Any]:
    """The ``callbacks`` group's callbacks; a ``ModelCheckpoint`` without ``dirpath`` writes to
    ``<run_dir>/checkpoints``. Callbacks the trainer config switches off (progress bar, checkpointing) are left out."""
    out = []
    for name, node in (cfg.get("callbacks") or {}).items():
        if node is None:
            continue
        cb = instantiate(node, _convert_="all")
        if isinstance(cb, ProgressBar) and not cfg.trainer.enable_progress_bar:
            continue  # Lightning refuses a progress-bar callback with enable_progress_bar=False
        if isinstance(cb, ModelCheckpoint):
            if not cfg.trainer.enable_checkpointing:
                continue  # and a checkpoint callback with enable_checkpointing=False
            if cb.dirpath is None and run_dir is not None:
                cb.dirpath = os.path.join(run_dir, CKPT_DIR)
        out.append(cb)
    return out


def build_loggers(cfg: DictConfig) -> list[Any]:
    return [instantiate(node, _convert_="all") for node in (cfg.get("logger") or {}).values() if node is not None]


# ---------------------------------------------------------------------------------------------- summary
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


# ---------------------------------------------------------------------------------------------- run
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


def fit(cfg: DictConfig, accumulate: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    log_to_run_files()
    threads = int(cfg.threads_per_rank)
    os.environ["OMP_NUM_THREADS"] = str(threads)  # also stops Lightning's launchers from resetting threads
    torch.set_num_threads(threads)
    L.seed_everything(cfg.seed, workers=True)

    strategy = instantiate(cfg.strategy, _convert_="all")
    datamodule = instantiate(cfg.recipe.data, micro_batch_size=cfg.recipe.micro_batch_size, seed=cfg.seed,
                             _convert_="all")
    module = instantiate(cfg.recipe.model, _convert_="all")

    comm = CommSummary()
    loggers = build_loggers(cfg)
    out_dir = HydraConfig.get().runtime.output_dir if HydraConfig.initialized() else os.getcwd()
    ckpt_path = resolve_ckpt_path(cfg)
    final = FinalCheckpoint()
    trainer = L.Trainer(strategy=strategy, callbacks=[comm, *build_callbacks(cfg, out_dir), final],
                        logger=loggers or False, **build_trainer_kwargs(cfg, accumulate))
    if ckpt_path is not None:
        rank_zero_info(f"lightning_shard.train: resuming from {ckpt_path}")
    choices = _choices()
    if isinstance(getattr(trainer.strategy, "launcher", None), _MultiProcessingLauncher):
        # fork/spawn: fit runs in worker processes and this process gets none of the figures back, so
        # rank 0's worker prints the table at the end of fit (no extra final validation in this mode).
        def report(_: dict) -> None:
            s = full_summary(comm, trainer, module, cfg, choices, time.perf_counter() - t0)
            print_summary(s)
            write_summary(out_dir, s)

        comm.on_fit_end_fn = report
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
        return {}
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    last_ckpt = final.path
    last_val_step = comm.val_losses[-1][0] if comm.val_losses else None
    if cfg.final_validation and last_val_step != trainer.global_step:
        trainer.validate(module, datamodule=datamodule, verbose=False)

    summary = full_summary(comm, trainer, module, cfg, choices, time.perf_counter() - t0)
    summary["checkpoint"] = last_ckpt
    summary["resumed_from"] = ckpt_path
    if trainer.is_global_zero:
        print_summary(summary)
        write_summary(out_dir, summary)
        print_next_steps(out_dir, last_ckpt, module)
    return summary


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
        kept = [o for o in task if not o.startswith(("ckpt_path=", "hydra.", "trainer.max_steps="))]
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


def run_isolated() -> dict[str, Any]:
    """One job of a ``-m`` sweep, in a fresh process: the job's own overrides, the job's folder as run dir."""
    hc = HydraConfig.get()
    out = hc.runtime.output_dir
    cmd = [sys.executable, "-m", "lightning_shard.train", *hc.overrides.task, f"hydra.run.dir={out}",
           "hydra.output_subdir=null", "hydra.job.name=run"]
    env = {**os.environ, "LIGHTNING_SHARD_PREFLIGHT": "0"}
    for key in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_PORT"):  # a fresh launch for every job
        env.pop(key, None)
    rc = subprocess.call(cmd, env=env, cwd=hc.runtime.cwd)
    if rc != 0:
        raise RuntimeError(f"sweep job {hc.job.num} ({' '.join(hc.overrides.task)}) failed with exit status {rc}; "
                           f"logs in {out}")
    return {"output_dir": out}


class SweepReport(HydraCallback):
    """Writes ``report.md`` and ``report.png`` in the sweep folder when a ``-m`` run ends."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        paths = write_report(config.hydra.sweep.dir)
        if paths is not None:
            print(f"sweep report: {paths[0]} and {paths[1]}")


@hydra.main(config_path="../conf", config_name="train", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> dict[str, Any]:
    accumulate = check_config(cfg)  # before any rank is launched
    if HydraConfig.get().mode == RunMode.MULTIRUN:
        if OmegaConf.select(cfg, "strategy.start_method", default="popen") == "popen":
            return run_isolated()
        # fork/spawn: ranks are workers of this process, which itself never joins a process group, so the
        # next job starts clean; only the rendezvous port is dropped so that each job picks a fresh one
        try:
            return fit(cfg, accumulate)
        finally:
            os.environ.pop("MASTER_PORT", None)
    return fit(cfg, accumulate)


# ---------------------------------------------------------------------------------------------- preflight
def _compose(overrides: list[str]) -> DictConfig:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return compose(config_name="train", overrides=overrides, return_hydra_config=True)
    finally:
        GlobalHydra.instance().clear()


def _group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def explain(err: BaseException, overrides: Sequence[str]) -> str:
    """One message naming the key and the fix, for an exception raised while composing ``overrides``."""
    from hydra.errors import MissingConfigException
    from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

    if isinstance(err, ConfigError):
        return str(err)
    chain, e = [], err
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    for e in chain:
        if isinstance(e, MissingConfigException):
            missing = (e.missing_cfg_file or "").strip("/")
            group, _, option = missing.rpartition("/")
            options = list(e.options or []) or _group_options(group)
            if group:
                return (f"{group}={option}: no such option in conf/{group}/{did_you_mean(option, options)}; "
                        f"choose one of: {', '.join(options)}")
            return str(e).splitlines()[0]
    for e in chain:
        if isinstance(e, OmegaConfBaseException) and getattr(e, "full_key", None):
            key = e.full_key
            parent, _, leaf = key.rpartition(".")
            base = _compose([o for o in overrides if "=" in o and "." not in o.split("=", 1)[0].lstrip("+~")])
            node = OmegaConf.select(base, parent) if parent else base
            if parent == "trainer" and leaf in _OWNED_TRAINER_KEYS:
                return owned_key_message(leaf)
            if parent == "trainer" and leaf in trainer_keywords():
                return (f"{key}: not in the trainer schema; other lightning.Trainer keywords are added with a "
                        f"'+': +{key}=...")
            if isinstance(e, ConfigKeyError) or "not in" in str(e.msg if hasattr(e, "msg") else e):
                valid = [str(k) for k in node.keys()] if isinstance(node, DictConfig) else []
                valid = [k for k in valid if k != "hydra"]
                return (f"{key}: no such key{did_you_mean(leaf, valid)}; valid keys of "
                        f"{parent or 'the config'}: {', '.join(valid)}")
            if isinstance(e, ValidationError):
                current = OmegaConf.select(base, key, default=None, throw_on_resolution_failure=False)
                first = str(getattr(e, "msg", e)).splitlines()[0]
                example = {True: "true", False: "false", None: "null"}.get(current, current) \
                    if isinstance(current, (bool, type(None))) else current
                return f"{key}: {first}; give a value of the schema's type, e.g. {key}={example}"
            return f"{key}: {str(getattr(e, 'msg', e)).splitlines()[0]}"
    if isinstance(err, ValueError):
        return str(err)
    return f"{type(err).__name__}: {err}"


def sweep_combinations(overrides: list[str], multirun: bool) -> list[list[str]]:
    """Every job's override list, as Hydra's basic sweeper would build them (config sweeper params included)."""
    if not multirun:
        return [list(overrides)]
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    plain = [o.input_line for o in parser.parse_overrides(overrides) if not o.is_sweep_override()]
    base = _compose(plain)
    params = OmegaConf.select(base, "hydra.sweeper.params", default=None) or {}
    from_config = [f"{k}={v}" for k, v in params.items()]
    batches = BasicSweeper.split_arguments(parser.parse_overrides(from_config + list(overrides)), None)
    return [job for batch in batches for job in batch]


def preflight(argv: Sequence[str]) -> Optional[str]:
    """Compose and check every job ``argv`` describes; return an error message, or None when all is well."""
    from hydra._internal.utils import get_args_parser

    args = get_args_parser().parse_args(list(argv))
    if args.help or args.hydra_help or args.cfg or args.info or args.shell_completion or args.config_dir \
            or args.config_name or args.config_path or args.experimental_rerun:
        return None  # Hydra's own modes: let Hydra answer
    try:
        jobs = sweep_combinations(args.overrides, args.multirun)
        for job in jobs:
            check_config(_compose(job))
    except Exception as err:  # noqa: BLE001 - every failure becomes one explained line
        try:
            return explain(err, args.overrides)
        except Exception:  # noqa: BLE001
            return f"{type(err).__name__}: {err}"
    return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m lightning_shard.train`` / ``lightning-shard train``: preflight, then Hydra."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if os.environ.get("LOCAL_RANK") in (None, "0") and os.environ.get("LIGHTNING_SHARD_PREFLIGHT", "1") != "0":
        error = preflight(argv)
        if error is not None:
            print(f"lightning_shard.train: error: {error}", file=sys.stderr)
            return 2
    sys.argv = [sys.argv[0], *argv]
    _hydra_main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
