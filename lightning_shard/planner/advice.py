"""How to run a planned row: the Hydra command line and the Python constructor that reproduce it.

``lightning-shard plan`` prints both under "recommended" (and ``--json`` gives them for every row). They are
built from the row's ``StrategyConfig.kwargs()`` (the strategy classes' own knob names and values) and the job:

* Hydra (``python -m lightning_shard.train``, ``conf/train.yaml``): ``strategy=<registered name>`` plus every knob
  whose value differs from ``conf/strategy/<name>.yaml`` or that ``conf/specialize/<name>_<topology>.yaml``
  would change; ``topology=<preset>`` (with ``topology.nodes`` / ``topology.devices`` when the plan replicated
  or resized what Hydra composes for it, ``conf/machine/<preset>.yaml`` included; ``trainer.devices`` and
  ``CUDA_VISIBLE_DEVICES`` for a subset of one node; a capture file or ``detect``: the trainer's shape); the
  recipe's global and micro batch (accumulation is derived from them, "Design rules" 7) and the precision.
* Python: ``Trainer(strategy=<Class>(<knobs that differ from the class defaults>), devices=..., ...)``.

No Hydra and no Lightning here: the configs are read as YAML, the defaults are the options'
(``lightning_shard/options``), and tests/planner/test_planner_advice.py composes and instantiates every row both
ways. A group's fields are dotted keys here (``tuning.bucket_mb``): ``strategy.tuning.bucket_mb=50`` for Hydra,
``tuning={"bucket_mb": 50}`` for Python.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from lightning_shard.shipped import CONF_DIR

from ..options import REGISTERED
from ..topology import list_presets
from ..topology.presets import read_preset
from .models import SIZES

RECIPE_PLACEHOLDER = "YOUR_RECIPE"
CLASS_OF = {"zero0": "Zero0Strategy", "zero1": "Zero1Strategy", "zero2": "Zero2Strategy",
            "zero3": "Zero3Strategy", "fsdp_shard": "FSDPShardStrategy"}  # lightning_shard.strategies
_MISSING = object()


def flatten(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Options as dotted keys: ``{"tuning": {"bucket_mb": 50}}`` -> ``{"tuning.bucket_mb": 50}``."""
    out: dict[str, Any] = {}
    for k, v in values.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def class_default(strategy: str, key: str) -> Any:
    """The default of option ``key`` (dotted for a group's field) of registered strategy ``strategy``'s class
    (``_MISSING`` if it has none)."""
    value: Any = REGISTERED[strategy][0]()
    for part in key.split("."):
        if not hasattr(value, part):
            return _MISSING
        value = getattr(value, part)
    return value


@dataclass
class Reproduce:
    """The Hydra overrides and the Python code that run one planned row."""

    overrides: list[str]  # python -m lightning_shard.train <overrides>
    env: dict[str, str] = field(default_factory=dict)  # e.g. CUDA_VISIBLE_DEVICES for a subset of a node
    strategy: str = ""  # the Python constructor, e.g. Zero3Strategy(accumulation="keep_unsharded_grads")
    trainer: str = ""  # Trainer(strategy=..., devices=..., ...)
    imports: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def command(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        cmd = " ".join(["python -m lightning_shard.train", *(shlex.quote(o) for o in self.overrides)])
        return f"{env} {cmd}" if env else cmd

    def to_dict(self) -> dict[str, Any]:
        return {"command": self.command, "hydra_overrides": self.overrides, "env": self.env,
                "python": f"{self.imports}\n{self.trainer}", "strategy": self.strategy, "notes": self.notes}


def hydra_value(v: Any) -> str:
    """A value as Hydra's override grammar reads it back (bool true/false, None null, lists [a,b])."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "null"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(hydra_value(x) for x in v) + "]"
    if isinstance(v, str) and not v.replace("_", "").replace("-", "").replace(".", "").replace("/", "").isalnum():
        return "'" + v.replace("'", "\\'") + "'"
    return str(v)


def python_value(v: Any) -> str:
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(k)}: {python_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(python_value(x) for x in v) + "]"
    return repr(v)


def _yaml(path: Path) -> dict[str, Any]:
    """A config file's keys (a group's fields dotted), less Hydra's ``defaults`` list."""
    if not path.is_file():
        return {}
    data = yaml.safe_load(path.read_text()) or {}
    return flatten({k: v for k, v in data.items() if k != "defaults"})


def _same(a: Any, b: Any) -> bool:
    """Equal as a knob value: True is not 1, 25 is 25.0."""
    if a is _MISSING or isinstance(a, bool) != isinstance(b, bool):
        return False
    return a == b


def _preset_spec(spec: Optional[str]) -> Optional[str]:
    return spec if spec is not None and spec in list_presets() else None


def strategy_kwargs(res: Any, row: Any) -> dict[str, Any]:
    """The row's constructor keywords: ``kwargs()``, plus for hybrid rows the topology they were planned on."""
    kw = dict(row.config.kwargs())
    if row.config.shard_size and res.topology_spec:
        kw["topology"] = res.topology_spec
    return kw


def strategy_overrides(res: Any, row: Any) -> list[str]:
    """``strategy=<name>`` and the knobs the composed config would otherwise get wrong."""
    option = row.config.registered
    preset = _preset_spec(res.topology_spec)
    shipped = _yaml(CONF_DIR / "strategy" / f"{option}.yaml")
    special = _yaml(CONF_DIR / "specialize" / f"{option}_{preset}.yaml") if preset else {}
    out = [f"strategy={option}"]
    values = flatten(strategy_kwargs(res, row))  # what differs from the class defaults
    values.update({k: class_default(row.config.strategy, k) for k in special if k not in values})
    for k, v in values.items():
        # what Hydra composes without an override: the machine's specialization, else the YAML (which holds only
        # what differs from the class defaults), else the class default
        have = special.get(k, shipped.get(k, class_default(row.config.strategy, k)))
        if have == "${topology.name}":
            have = preset or "cpu"  # conf/train.yaml's default topology
        if not _same(have, v):
            out.append(f"strategy.{k}={hydra_value(v)}")
    return out


def job_overrides(res: Any, recipe: Optional[str] = None) -> tuple[list[str], dict[str, str], list[str]]:
    """Topology, devices, recipe, batch and precision of the planned job: (overrides, environment, notes)."""
    ctx = res.context
    topo, world = ctx.placement.topology, ctx.job.world
    cpu = topo.devices[0].kind == "cpu"
    over: list[str] = []
    env: dict[str, str] = {}
    notes: list[str] = []
    preset = _preset_spec(res.topology_spec)
    subset = world < len(topo.devices)  # the fastest subset of one node (placement.place)
    if preset is not None:
        # what Hydra composes for topology=<preset>: the preset's keys, then conf/machine/<preset>.yaml's
        p = {**read_preset(preset), **_yaml(CONF_DIR / "machine" / f"{preset}.yaml")}
        over.append(f"topology={preset}")
        if topo.devices_per_node != int(p["devices"]):
            over.append(f"topology.devices={topo.devices_per_node}")
        if topo.num_nodes != int(p.get("nodes", 1)):
            over.append(f"topology.nodes={topo.num_nodes}")
        if subset:
            over.append(f"trainer.devices={world}")
            if topo.num_nodes > 1:
                over.append("trainer.num_nodes=1")
    else:  # a capture file or the live machine: no topology preset; the trainer's shape is given by hand
        over += [f"trainer.accelerator={'cpu' if cpu else 'gpu'}",
                 f"trainer.devices={world if subset else topo.devices_per_node}",
                 f"trainer.num_nodes={1 if subset else topo.num_nodes}"]
        notes.append(f"topology {res.topology_spec or topo.name!r} is not a shipped topology preset: the trainer's "
                     "shape is given by hand (trainer.accelerator/devices/num_nodes)")
    if subset and not cpu:
        local = [str(topo.devices[d].local_index) for d in ctx.placement.devices]
        if local != [str(i) for i in range(world)]:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(local)
            notes.append(f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']}: the planned devices in rank order "
                         "(the fastest subset of the node); set it for the Python code too")
    if recipe and recipe not in SIZES and (CONF_DIR / "recipe" / f"{recipe}.yaml").is_file():
        over.append(f"recipe={recipe}")
    else:
        over.append(f"recipe={RECIPE_PLACEHOLDER}")
        if not recipe:
            what = "the model was given by its shape"
        elif (CONF_DIR / "recipe" / f"{recipe}.yaml").is_file():
            what = (f"{recipe} here is the planning size of planner/models.py; the recipe {recipe} is a "
                    "different model")
        else:
            what = f"{recipe} is a planning size (planner/models.py), not a Hydra recipe"
        notes.append(f"{what}: replace {RECIPE_PLACEHOLDER} with a recipe (recipe=NAME: "
                     "a shipped one or one of your config folder, docs/app.md)")
    job = ctx.job
    over += [f"recipe.global_batch_size={world * job.micro_batch * job.accumulation}",
             f"recipe.micro_batch_size={job.micro_batch}", f"trainer.precision={job.precision}"]
    return over, env, notes


def python_constructor(res: Any, row: Any) -> tuple[str, str]:
    """(import line, ``Class(option=value, group={"field": value}, ...)``) with the options that differ from the
    class defaults."""
    cls = CLASS_OF[row.config.strategy]
    kw: dict[str, Any] = {}
    for k, v in flatten(strategy_kwargs(res, row)).items():
        if not _same(class_default(row.config.strategy, k), v):
            name, _, field_name = k.partition(".")
            if field_name:
                kw.setdefault(name, {})[field_name] = v
            else:
                kw[name] = v
    args = ", ".join(f"{k}={python_value(v)}" for k, v in kw.items())
    return f"from lightning_shard.strategies import {cls}", f"{cls}({args})"


def reproduce(res: Any, row: Any = None, recipe: Optional[str] = None) -> Reproduce:
    """Everything that runs ``row`` (default: the recommendation) as planned."""
    row = row if row is not None else res.best
    ctx = res.context
    job_over, env, notes = job_overrides(res, recipe)
    over = strategy_overrides(res, row) + job_over
    imp, ctor = python_constructor(res, row)
    topo, world, job = ctx.placement.topology, ctx.job.world, ctx.job
    nodes = 1 if world < len(topo.devices) else topo.num_nodes
    accelerator = "cpu" if topo.devices[0].kind == "cpu" else "gpu"
    tk = [f"strategy={ctor}", f"accelerator={python_value(accelerator)}", f"devices={world // nodes}"]
    if nodes > 1:
        tk.append(f"num_nodes={nodes}")
    tk.append(f"precision={python_value(job.precision)}")
    if job.accumulation > 1:
        tk.append(f"accumulate_grad_batches={job.accumulation}")
    return Reproduce(over, env, ctor, f"Trainer({', '.join(tk)})", f"from lightning import Trainer\n{imp}", notes)
