"""A machine profile: what calibration (``calibrate.py``) measured on this machine, kept as a small JSON and reused.

The calibrated time model (``time.py``, :class:`~.time.Calibrated`) reads its rates from here instead of datasheet
figures:

* ``collectives``: seconds per call of each collective the engine issues, at a ladder of sizes (4 KiB x 4^k up to the
  largest the plan issues), per group: ``"<op>/<ranks>/<link class>"``. ``op`` is the engine's path, not the backend's
  name: ``reduce`` (a gradient bucket's reduction to shards: on gloo an all-to-all and the sum of the pieces, on two
  ranks the pair exchange; elsewhere the backend's reduce-scatter), ``gather`` (a parameter all-gather by its
  per-size form: N broadcasts on gloo from 1 MiB), ``all_reduce``, ``all_to_all`` (quantized reductions) and
  ``broadcast`` (buffers). A size between two rungs is interpolated linearly; above the top rung the last rung's
  bandwidth continues; below the first, its time (the per-call fixed cost).
* ``compute``: forward and backward seconds of one micro-batch of a model, by its signature (block shape, layers,
  micro-batch, sequence, dtype), measured on one of its blocks and its input and output layers.
* ``matmul_flops``: achieved FLOP/s of a matmul of the model's MLP shape (for a model without a measured entry).
* ``optimizer_s_per_element``: an Adam(W) step per fp32 parameter element.
* ``overlap``: the fraction of a collective that runs hidden behind compute when the schedule allows it (1: fully,
  as on a GPU with its own copy engines; on CPU ranks the backend's threads share the cores with compute).
* ``engine_s_per_call`` / ``engine_s_per_byte`` / ``engine_s_per_tensor``: the engine's own work (hooks, copies,
  bookkeeping) per bucket operation (a unit's gather, a bucket's reduction or post-step gather, with or without a
  collective), per byte of those operations, and per parameter tensor per step, measured on a probe model of small
  layers through the engine itself (``calibrate.measure_engine_overhead``; per byte and per tensor with each rank's
  engine on a group of that rank alone, so that no collective is left in the difference).
* ``unit_ops``: per model signature, the engine's seconds per stage-3 bucket operation on that model's own blocks
  at its micro-batch, beyond the collective's bytes (``calibrate.measure_unit_ops``); the stage-3 rows of that model
  use it instead of the probe's per-operation and per-byte figures (null: the model is not a stack of blocks).

A profile is for one machine, backend, world size and threads per rank (the file name says which:
:func:`profile_path`); it is **stale** when the library versions or the hardware description differ from the ones it
was measured with (:meth:`MachineProfile.stale_reason`), and then measured again.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from bisect import bisect_left
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

PROFILE_VERSION = 4  # 2: the engine's per-byte and per-tensor costs measured without collectives; 4: 9 compute passes
CACHE_ENV = "LIGHTNING_SHARD_CACHE"  # where profiles are kept (default ~/.cache/lightning_shard)
OPS = ("reduce", "gather", "all_reduce", "all_to_all", "broadcast")


@dataclass
class Curve:
    """Seconds per call against bytes per call (the full tensor's bytes, as the ledger counts them)."""

    sizes: list[int]
    seconds: list[float]

    def __call__(self, nbytes: float) -> float:
        s, t = self.sizes, self.seconds
        if nbytes <= s[0] or len(s) == 1:  # below the first rung: the per-call fixed cost
            return t[0]
        i = min(bisect_left(s, nbytes), len(s) - 1)
        lo, hi = i - 1, i
        slope = (t[hi] - t[lo]) / (s[hi] - s[lo])
        if nbytes > s[-1]:  # the top rung's bandwidth continues
            slope = max(slope, 0.0)
            return t[-1] + (nbytes - s[-1]) * slope
        return t[lo] + (nbytes - s[lo]) * slope

    @property
    def latency_s(self) -> float:
        return self.seconds[0]

    @property
    def bandwidth(self) -> float:
        """Bytes per second between the top two rungs."""
        if len(self.sizes) < 2:
            return float("inf")
        dt = self.seconds[-1] - self.seconds[-2]
        return (self.sizes[-1] - self.sizes[-2]) / dt if dt > 0 else float("inf")


def collective_key(op: str, ranks: int, link_class: str) -> str:
    return f"{op}/{ranks}/{link_class}"


@dataclass
class MachineProfile:
    machine: dict[str, Any]  # device model, count, backend, world, threads, topology: what the file name encodes
    versions: dict[str, str]  # torch, lightning_shard, python: a difference makes the profile stale
    collectives: dict[str, Curve] = field(default_factory=dict)
    compute: dict[str, list[float]] = field(default_factory=dict)  # signature -> [forward s, backward s]
    # signature -> the engine's seconds per stage-3 bucket operation on that model's blocks (None: not a block stack)
    unit_ops: dict[str, Optional[float]] = field(default_factory=dict)
    matmul_flops: float = 0.0
    optimizer_s_per_element: float = 0.0
    overlap: Optional[float] = None  # None: not measured (a world of one rank has nothing to overlap)
    engine_s_per_call: Optional[float] = None  # the engine's own work per bucket operation (None: not measured)
    engine_s_per_tensor: float = 0.0  # the engine's own work per parameter tensor per step
    engine_s_per_byte: float = 0.0  # the engine's own work per byte of a bucket operation (copies)
    calibration_s: float = 0.0  # what measuring took, in total (the entries added later included)
    created: str = ""

    def collective(self, op: str, ranks: int, link_class: str) -> Optional[Curve]:
        return self.collectives.get(collective_key(op, ranks, link_class))

    def stale_reason(self, versions: Optional[dict[str, str]] = None) -> Optional[str]:
        """Why this profile no longer describes the machine (None: it does)."""
        now = versions or library_versions()
        diff = [f"{k} {self.versions.get(k)} -> {now[k]}" for k in now if self.versions.get(k) != now[k]]
        return ", ".join(diff) or None

    def to_json(self) -> str:
        doc = asdict(self)
        doc["version"] = PROFILE_VERSION
        return json.dumps(doc, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "MachineProfile":
        doc = json.loads(text)
        if doc.pop("version", None) != PROFILE_VERSION:
            raise ValueError(f"machine profile of another format (version != {PROFILE_VERSION})")
        doc["collectives"] = {k: Curve(**v) for k, v in doc.get("collectives", {}).items()}
        return cls(**doc)

    def save(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(self.to_json())
        tmp.replace(path)  # never a half-written profile
        return path


def library_versions() -> dict[str, str]:
    import torch

    from ..version import __version__

    return {"torch": torch.__version__, "lightning_shard": __version__, "python": platform.python_version()}


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "lightning_shard") / "profiles"


def profile_path(machine: dict[str, Any], directory: Optional[Path] = None) -> Path:
    """``<cache>/profiles/<backend>-<world>x<device>-<digest>.json``: one file per machine description."""
    digest = hashlib.sha256(json.dumps(machine, sort_keys=True).encode()).hexdigest()[:12]
    device = "".join(c if c.isalnum() else "_" for c in str(machine.get("device", "device")))[:40].strip("_")
    return (directory or cache_dir()) / f"{machine.get('backend')}-{machine.get('world')}x{device}-{digest}.json"


def load_profile(path: Path) -> tuple[Optional[MachineProfile], str]:
    """The profile at ``path`` and why it is usable or not: ``(profile, "")``, ``(None, reason)``."""
    if not path.is_file():
        return None, "no profile yet"
    try:
        prof = MachineProfile.from_json(path.read_text())
    except (ValueError, TypeError, KeyError) as err:
        return None, f"unreadable profile {path} ({err})"
    stale = prof.stale_reason()
    if stale:
        return None, f"stale profile ({stale})"
    return prof, ""
