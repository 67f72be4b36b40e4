"""The preflight of ``python -m lightning_shard.train``: compose every job an argv describes and check it
before Hydra or Lightning start; every failure becomes one line naming the key and the fix."""

from __future__ import annotations

from typing import Optional, Sequence

from omegaconf import DictConfig, OmegaConf

from lightning_shard.shipped import CONF_DIR

from .checks import ConfigError, did_you_mean
from .config import (
    _OWNED_TRAINER_KEYS,
    check_config,
    grouped_key_hint,
    owned_key_message,
    trainer_keywords,
)


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


def _value_of(key: str, overrides: Sequence[str]) -> Optional[str]:
    """The value ``overrides`` give ``key`` (``key=value``, ``+key=value``), or None."""
    for o in overrides:
        name, eq, value = o.partition("=")
        if eq and name.lstrip("+~") == key:
            return value
    return None


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
    for e in chain:  # ours, raised inside Hydra (the ls.topo resolver): it names the key already
        if isinstance(e, ConfigError):
            return str(e)
    for e in chain:
        if isinstance(e, MissingConfigException):
            missing = (e.missing_cfg_file or "").strip("/")
            group, _, option = missing.rpartition("/")
            options = list(e.options or []) or _group_options(group)
            if group:
                return (f"{group}={option}: no such option in the {group} group{did_you_mean(option, options)}; "
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
                hint = did_you_mean(leaf, valid)
                moved = grouped_key_hint(node, parent, leaf, _value_of(key, overrides), close=not hint)
                if moved:  # a group's field given flat (strategy.bucket_mb: strategy.tuning.bucket_mb)
                    return f"{key}: no such key; {moved}"
                return (f"{key}: no such key{hint}; valid keys of "
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
