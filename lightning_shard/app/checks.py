"""Checks that run before any rank is launched: every error names the config key and the fix ("Design rules" 10).

Works on the plain, resolved config (``OmegaConf.to_container(cfg, resolve=True)``), so no Hydra here.

- ``_target_`` importable, and every other key a keyword of the target (close matches suggested);
- value types against the target's defaults (``bool`` stays bool, numbers stay numbers);
- value choices read from the options dataclasses (``lightning_shard/options``) so they never drift;
- hybrid sharding needs more than one shard group on the chosen topology;
- local recipe paths (``recipe.model.name_or_path``) must exist;
- the batch arithmetic (:func:`lightning_shard.batching.derive_accumulation`).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
from pathlib import Path
from typing import Any, Mapping, Optional

from lightning_shard.batching import derive_accumulation
from lightning_shard.options import Launch

# keys of a target node that are Hydra's, not the target's
_HYDRA_KEYS = {"_target_", "_convert_", "_recursive_", "_partial_", "_args_"}


class ConfigError(ValueError):
    """A user error in the composed config; the message names the key and the fix."""


def did_you_mean(key: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(key, valid, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def import_target(path: Any, key: str) -> Any:
    if not isinstance(path, str) or "." not in path:
        raise ConfigError(f"{key}={path!r} is not an importable 'package.module.Name' path")
    module_name, _, attr = path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        raise ConfigError(f"{key}={path!r}: module {module_name!r} not found ({err.name} is missing). Fix: "
                          f"correct the path, or install the extra that provides it (e.g. pip install "
                          f"'lightning-shard[hf]' for transformers)") from None
    if not hasattr(module, attr):
        names = [n for n in dir(module) if not n.startswith("_")]
        raise ConfigError(f"{key}={path!r}: {module_name} has no {attr!r}{did_you_mean(attr, names)}")
    return getattr(module, attr)


def _accepted(target: Any) -> tuple[Optional[list[str]], dict[str, Any]]:
    """(keyword names or None when ``**kwargs`` takes anything, defaults)."""
    options = getattr(target, "OPTIONS", None)  # a lightning_shard strategy: its options and Lightning's arguments
    fn = target.__init__ if inspect.isclass(target) else target
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None, {}
    defaults = {n: p.default for n, p in params.items() if p.default is not inspect.Parameter.empty}
    if options is not None:
        return list(options.names() + target.LIGHTNING_ARGS), options.defaults()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None, defaults
    return [n for n in params if n != "self"], defaults


def check_target_node(node: Mapping[str, Any], key: str, provided: tuple[str, ...] = ()) -> Any:
    """Import ``node['_target_']`` and check the other keys are its keywords, with sane types."""
    if not isinstance(node, Mapping) or "_target_" not in node:
        raise ConfigError(f"{key} needs a _target_ (the class to build), e.g. "
                          f"{key}._target_=lightning_shard.recipes.gpt.GPTLightningModule")
    target = import_target(node["_target_"], f"{key}._target_")
    valid, defaults = _accepted(target)
    for name, value in node.items():
        if name in _HYDRA_KEYS or name in provided:
            continue
        if valid is not None and name not in valid:
            raise ConfigError(f"{key}.{name} is not a keyword of {node['_target_']}{did_you_mean(name, valid)}; valid "
                              f"keys: {', '.join(v for v in valid if v not in provided)}")
        default = defaults.get(name)
        if dataclasses.is_dataclass(default):  # an option group: its fields, each like its default
            if not isinstance(value, Mapping):
                raise ConfigError(f"{key}.{name}={value!r} must be a group of keys ({', '.join(default.names())})")
            group_defaults = default.defaults()
            for field_name, field_value in value.items():
                if field_name not in group_defaults:
                    raise ConfigError(f"{key}.{name}.{field_name} is not a field of {type(default).__name__}"
                                      f"{did_you_mean(field_name, list(group_defaults))}; valid keys: "
                                      f"{', '.join(group_defaults)}")
                _check_value(f"{key}.{name}.{field_name}", field_value, group_defaults[field_name])
            continue
        _check_value(f"{key}.{name}", value, default)
    return target


def _check_value(key: str, value: Any, default: Any) -> None:
    """``value`` has the type of ``default`` (bool stays bool, numbers stay numbers)."""
    if value is None or default is None:
        return
    if isinstance(default, bool) and not isinstance(value, bool):
        raise ConfigError(f"{key}={value!r} must be true or false")
    if isinstance(default, (int, float)) and not isinstance(default, bool) and (
            isinstance(value, bool) or not isinstance(value, (int, float))):
        raise ConfigError(f"{key}={value!r} must be a number like its default {default!r}")
    if (isinstance(default, int) and not isinstance(default, bool) and isinstance(value, float)
            and not value.is_integer()):
        raise ConfigError(f"{key}={value!r} must be an integer (default {default!r})")
    if isinstance(default, str) and not isinstance(value, str):
        raise ConfigError(f"{key}={value!r} must be a string (default {default!r})")


def check_strategy(node: Mapping[str, Any], islands_per_node: int, num_nodes: int, world_size: int,
                   key: str = "strategy") -> None:
    cls = check_target_node(node, key)
    # the options of a lightning_shard strategy (lightning_shard/options), a group's fields included; another
    # target (Lightning's DDP) has its start_method checked against ours
    options = getattr(cls, "OPTIONS", None)
    stage = node.get("stage") if node.get("stage") is not None else getattr(cls, "DEFAULT_STAGE", None)
    checks: list[tuple[str, Any, Optional[tuple]]] = []
    if options is None:
        checks.append((f"{key}.start_method", node.get("start_method"), Launch.choices("start_method")))
    else:
        for f in dataclasses.fields(options):
            if "group" in f.metadata and isinstance(node.get(f.name), Mapping):
                checks += [(f"{key}.{f.name}.{n}", node[f.name].get(n), f.metadata["group"].choices(n))
                           for n in f.metadata["group"].names() if n in node[f.name]]
            elif f.name in node:
                checks.append((f"{key}.{f.name}", node[f.name], options.choices(f.name, stage)))
    for name, value, valid in checks:
        if value is not None and valid is not None and value not in valid:
            raise ConfigError(f"{name}={value!r} is not valid for {cls.__name__}; choose one of "
                              f"{', '.join(map(str, valid))}{did_you_mean(str(value), [str(v) for v in valid])}")
    shard = node.get("shard_size")
    if shard is None:
        return
    if shard == "auto":
        if not node.get("topology"):
            raise ConfigError(f"{key}.shard_size=auto takes the island size from {key}.topology, which is unset; "
                              f"set {key}.topology=<preset> or an integer {key}.shard_size")
        if islands_per_node * num_nodes <= 1:
            raise ConfigError(
                f"{key}.shard_size=auto on topology {node.get('topology')!r}: one island for the whole job, so "
                f"hybrid sharding would be plain sharding. Fix: pick a topology with several islands (e.g. "
                f"topology=cpu_2x2 for 4 CPU ranks in two islands), set an integer {key}.shard_size that divides "
                f"the world size {world_size}, or use the non-hybrid strategy (e.g. strategy=zero2)")
        return
    if isinstance(shard, bool) or not isinstance(shard, int) or shard < 1:
        raise ConfigError(f"{key}.shard_size={shard!r} must be null, 'auto' or a positive integer")
    if world_size % shard or shard == world_size:
        ok = [d for d in range(1, world_size) if world_size % d == 0]
        raise ConfigError(f"{key}.shard_size={shard} must divide the world size {world_size} into more than one "
                          f"group ({world_size} % {shard} = {world_size % shard}); use one of {ok} or drop shard_size")


def check_recipe(recipe: Mapping[str, Any]) -> None:
    for part, provided in (("model", ()), ("data", ("micro_batch_size", "seed"))):
        node = recipe.get(part)
        check_target_node(node, f"recipe.{part}", provided)
    for part in ("model", "data"):
        for name in ("name_or_path", "tokenizer", "path", "root"):
            value = recipe[part].get(name)
            if isinstance(value, str) and value.startswith(("/", "./", "../", "~")) \
                    and not Path(value).expanduser().exists():
                raise ConfigError(
                    f"recipe.{part}.{name}={value!r}: no such file or directory (looked in {Path.cwd()} for a "
                    f"relative path). Fix: give an existing local directory (absolute paths are safest under "
                    f"Hydra), or a Hugging Face hub id such as 'gpt2' without a leading './' or '/'")


def world_size_of(trainer: Mapping[str, Any]) -> int:
    devices, num_nodes = trainer.get("devices"), trainer.get("num_nodes")
    if isinstance(devices, bool) or not isinstance(devices, int) or isinstance(num_nodes, bool) \
            or not isinstance(num_nodes, int):
        raise ConfigError(f"trainer.devices and trainer.num_nodes must be integers to derive the world size, got "
                          f"devices={devices!r}, num_nodes={num_nodes!r}; they come from the topology "
                          f"(topology.devices=2) or can be set, e.g. trainer.devices=2 trainer.num_nodes=1")
    return devices * num_nodes


def check_all(cfg: Mapping[str, Any], islands_per_node: int) -> int:
    """Run every check on the resolved config; return ``accumulate_grad_batches``."""
    trainer = cfg["trainer"]
    world = world_size_of(trainer)
    try:
        accumulate = derive_accumulation(cfg["recipe"]["global_batch_size"], cfg["recipe"]["micro_batch_size"], world)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    check_strategy(cfg["strategy"], islands_per_node, trainer["num_nodes"], world)
    check_recipe(cfg["recipe"])
    return accumulate
