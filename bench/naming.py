"""The name of a suite's result: ``<suite>_<hardware>_<YYYY-MM-DD>`` (``.json`` and ``.md``), one per suite and machine.

``hardware`` is what the suite ran on: ``cpu<cores>`` (e.g. ``cpu2``) for the CPU suites, the GPU's model for a run
on CUDA (``h200``, ``a100``, ``rtx4090``); ``BENCH_HARDWARE=<name>`` sets it. The date is the day of the run. A new
run of a suite on the same machine replaces that suite's older file in ``bench/results`` (``git rm`` the old one):
the folder holds the current result of each suite per machine; git history keeps the earlier ones.
"""

from __future__ import annotations

import os
import re
import subprocess
from datetime import date as _date
from typing import Optional

# words of a GPU's marketing name that say nothing of the chip (dropped before the first word with a digit)
_VENDOR_WORDS = {"nvidia", "geforce", "tesla", "quadro", "amd", "radeon", "instinct", "intel", "data", "center"}


def gpu_slug(name: str) -> str:
    """``"NVIDIA H200"`` -> ``"h200"``, ``"NVIDIA A100-SXM4-80GB"`` -> ``"a100"``, ``"NVIDIA GeForce RTX 4090"`` ->
    ``"rtx4090"``, ``"AMD Instinct MI300X"`` -> ``"mi300x"``: the words up to the first one with a digit, vendor
    words left out, lower case, letters and digits only."""
    words = [w for w in re.split(r"[\s\-_/]+", name.lower()) if w and w not in _VENDOR_WORDS]
    picked = []
    for w in words:
        picked.append(w)
        if any(c.isdigit() for c in w):
            break
    slug = re.sub(r"[^a-z0-9]", "", "".join(picked))
    return slug or "gpu"


def gpu_name() -> Optional[str]:
    """The first GPU's name from ``nvidia-smi`` (no CUDA context is made in this process), else ``None``."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [ln.strip() for ln in out.stdout.splitlines() if ln.strip()] if out.returncode == 0 else []
    return lines[0] if lines else None


def hardware(device: str = "cpu", gpu: Optional[str] = None) -> str:
    """The hardware part of a result's name: ``$BENCH_HARDWARE``, else ``cpu<cores>`` (``device="cpu"``), else the
    GPU's model (``gpu``: its name, default ``nvidia-smi``'s)."""
    given = os.environ.get("BENCH_HARDWARE", "").strip()
    if given:
        return re.sub(r"[^A-Za-z0-9.-]", "-", given)
    if device == "cpu":
        return f"cpu{os.cpu_count() or 1}"
    return gpu_slug(gpu or gpu_name() or "gpu")


def result_stem(suite: str, device: str = "cpu", day: Optional[str] = None, gpu: Optional[str] = None) -> str:
    """``<suite>_<hardware>_<YYYY-MM-DD>``: the file name of ``suite``'s result without ``.json`` / ``.md``."""
    return f"{suite}_{hardware(device, gpu)}_{day or _date.today().isoformat()}"
