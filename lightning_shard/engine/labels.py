"""The ``torch.profiler`` labels of the engine's phases and of each collective's launch and wait (what the
benchmarks time)."""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch


def phase(fn):
    """Label an engine phase for ``torch.profiler`` as ``lightning_shard.<method>`` (what the benchmarks time)."""
    label = f"lightning_shard.{fn.__name__.lstrip('_')}"

    @functools.wraps(fn)
    def labelled(*args, **kwargs):
        with torch.profiler.record_function(label):
            return fn(*args, **kwargs)
    return labelled


def label(name: str) -> Any:
    """A ``torch.profiler`` range ``lightning_shard.<name>`` while a profiler records, else nothing (so the hot
    path pays one flag check): the launch and the wait of each bucket's collectives (``reduce_launch``,
    ``reduce_wait``, ``gather_launch``, ``gather_wait``, ``param_gather_launch``, ``param_gather_wait``). A wait's
    range is time the rank's main thread was blocked on communication (exposed, not overlapped)."""
    if torch.autograd._profiler_enabled():
        return torch.profiler.record_function(f"lightning_shard.{name}")
    return contextlib.nullcontext()
