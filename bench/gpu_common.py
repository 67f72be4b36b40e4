"""What every phase of the GPU check shares: the result document, the checks and how a wrong one fails.

One JSON document (``gpu_check_<hardware>_<date>.json``, ``args.stem``: ``naming.py``) and its Markdown twin are
rewritten after every check, by the phase worker that runs it, so a run killed at any moment leaves what it had
measured. A check compares a number with a bound against something independent of the engine (a plain Lightning or
plain torch run, a formula); the first one that fails prints a banner naming it with its numbers and, unless
``--keep-going``, ends the phase (and the orchestrator stops there) with a non-zero exit code.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[1]
PHASES = ("parity", "world2", "perf", "tests")
EXIT_PASS, EXIT_FAIL, EXIT_INCOMPLETE = 0, 1, 3


class CheckFailed(Exception):
    """A check found a wrong result (stops the phase unless ``--keep-going``)."""


class OutOfTime(Exception):
    """The phase's deadline came before its next step."""


def out_paths(args: argparse.Namespace) -> tuple[Path, Path]:
    """``<out-dir>/<stem>.json`` and ``.md``: the stem is the run's (``gpu_check.parse``), the same in every worker."""
    return Path(args.out_dir) / f"{args.stem}.json", Path(args.out_dir) / f"{args.stem}.md"


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def load_doc(args: argparse.Namespace) -> dict[str, Any]:
    path = out_paths(args)[0]
    if path.exists():
        return json.loads(path.read_text())
    return {"suite": "gpu_check", "mode": "cpu" if args.cpu else "cuda", "status": "running", "machine": {},
            "phases": {}, "first_failure": None}


def save_doc(args: argparse.Namespace, doc: dict[str, Any]) -> None:
    from gpu_report import markdown

    out_json, out_md = out_paths(args)
    _atomic_write(out_json, json.dumps(doc, indent=1, default=str))
    _atomic_write(out_md, markdown(doc))


def machine_info(device: str) -> dict[str, Any]:
    import lightning
    import torch

    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                            "lightning": lightning.__version__, "cores": os.cpu_count(), "device": device}
    if device == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_count=torch.cuda.device_count(), gpu_mem_gib=props.total_memory / 2**30,
                    capability=f"{props.major}.{props.minor}", cuda=torch.version.cuda)
        try:
            import torch.cuda.nccl as nccl

            v = nccl.version()
            info["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception as err:  # noqa: BLE001 - informative only
            info["nccl"] = f"unknown ({short(err, 80)})"
    return info


def short(err: BaseException, limit: int = 300) -> str:
    text = f"{type(err).__name__}: {err}".replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Recorder:
    """One phase's section of the document: its checks, notes and measurements, saved after every change."""

    def __init__(self, args: argparse.Namespace, phase: str) -> None:
        self.args, self.phase = args, phase
        self.deadline = float(args.deadline) if args.deadline else time.time() + 3600
        self.t0 = time.time()
        self.section: dict[str, Any] = {"status": "running", "checks": [], "notes": []}
        self.failed = 0
        self.save()

    # ------------------------------------------------------------------ time
    def time_left(self) -> float:
        return self.deadline - time.time()

    def need(self, seconds: float, what: str) -> None:
        """Raise OutOfTime when less than ``seconds`` remain before the deadline (``what`` is not started)."""
        if self.time_left() < seconds:
            self.note(f"stopped before {what}: {self.time_left():.0f} s left of the phase's budget")
            raise OutOfTime(what)

    # ------------------------------------------------------------------ records
    def save(self) -> None:
        doc = load_doc(self.args)
        self.section["wall_s"] = time.time() - self.t0
        doc["phases"][self.phase] = self.section
        save_doc(self.args, doc)

    def note(self, text: str) -> None:
        print(f"[{self.phase}] {text}", flush=True)
        self.section["notes"].append(text)
        self.save()

    def put(self, key: str, value: Any) -> None:
        self.section[key] = value
        self.save()

    def check(self, name: str, value: Optional[float], bound: float, *, what: str, reference: str,
              op: str = "<=", **detail: Any) -> bool:
        """Record ``value op bound``; a failure is loud and, without ``--keep-going``, raises CheckFailed."""
        ok = value is not None and value == value and (value <= bound if op == "<=" else value >= bound)
        row = {"name": name, "passed": bool(ok), "value": value, "op": op, "bound": bound, "what": what,
               "reference": reference, **detail}
        self.section["checks"].append(row)
        print(f"[{self.phase}] {'ok  ' if ok else 'FAIL'} {name}: {_num(value)} {op} {_num(bound)}", flush=True)
        if not ok:
            self._fail(row)
        self.save()
        if not ok and not self.args.keep_going:
            raise CheckFailed(name)
        return bool(ok)

    def error(self, name: str, err: BaseException, what: str) -> None:
        """A step that raised where it should have produced a result: a failed check with the error."""
        tb = traceback.format_exc(limit=-6)
        row = {"name": name, "passed": False, "value": None, "op": "", "bound": None, "what": what,
               "reference": "", "error": short(err, 1000), "traceback": tb[-3000:]}
        self.section["checks"].append(row)
        self._fail(row)
        self.save()
        if not self.args.keep_going:
            raise CheckFailed(name) from err

    def _fail(self, row: dict[str, Any]) -> None:
        self.failed += 1
        doc = load_doc(self.args)
        if doc.get("first_failure") is None:
            doc["first_failure"] = {"phase": self.phase, **row}
            save_doc(self.args, doc)
        text = row.get("error") or f"{row['what']} = {_num(row['value'])}, must be {row['op']} {_num(row['bound'])}"
        bar = "!" * 100
        print(f"\n{bar}\nGPU CHECK FAILED: {row['name']}: {text}\n  reference: {row.get('reference') or '-'}\n"
              f"{bar}\n", file=sys.stderr, flush=True)

    def finish(self, status: str) -> None:
        self.section["status"] = status
        self.section["passed"] = sum(c["passed"] for c in self.section["checks"])
        self.section["failed"] = self.failed
        self.save()


def _num(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.3g}"
    return str(x)


# ============================================================================================ the test hook
def perturbation(args: argparse.Namespace, run_id: str) -> float:
    """``--perturb PATTERN=DELTA`` (test hook, used only by tests/bench/test_gpu_check.py): the DELTA to add to one
    weight of the strategy run whose id matches PATTERN (fnmatch); 0.0 for every other run."""
    for item in args.perturb or ():
        pattern, _, delta = item.partition("=")
        if fnmatch.fnmatchcase(run_id, pattern):
            return float(delta or "1e-3")
    return 0.0


def perturb(args: argparse.Namespace, run_id: str, state: dict[str, Any]) -> Optional[str]:
    """Apply :func:`perturbation` to the first element of the first weight of ``state`` (sorted names); the name
    perturbed, or None."""
    delta = perturbation(args, run_id)
    if not delta:
        return None
    name = sorted(state)[0]
    state[name].view(-1)[0] += delta
    print(f"test hook: {run_id}: {name}[0] += {delta}", flush=True)
    return name


def quiet_lightning() -> None:
    """One thread per process on CPU (2 cores), Lightning's info and warnings off (the document says what ran)."""
    import logging
    import warnings

    import lightning.pytorch  # noqa: F401  imported first: it sets its loggers' levels, which are lowered below

    import lightning_shard  # noqa: F401  registers the strategy names when Lightning is imported (next line)

    warnings.filterwarnings("ignore")
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_shard", "pytorch_lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
