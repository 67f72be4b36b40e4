"""Stages 1/2: the all-gather of updated parameters after each step. With ``overlap_param_gather`` it runs in
the background and each module waits for its own buckets in a forward pre-hook, so the gather overlaps the
next forward; anything that reads or writes parameters outside a forward calls :meth:`PostStepGathers.wait_all`."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from . import collectives as C
from .bucket import Bucket


class PostStepGathers:
    def __init__(self, module: nn.Module, buckets: list[Bucket], overlap: bool) -> None:
        self.overlap = overlap and any(b.spec.gathers_after_step for b in buckets)
        self._gloo = bool(buckets) and C.backend(buckets[0].group) == "gloo"  # the groups' backend does not change
        self._pending: list[Bucket] = []
        self.handles: list[Any] = self._register_waits(module, buckets) if self.overlap else []

    @staticmethod
    def _register_waits(module: nn.Module, buckets: list[Bucket]) -> list[Any]:
        owners: dict[int, set[int]] = {}
        for b in buckets:
            for p in b.params:
                owners.setdefault(id(p), set()).add(b.index)
        handles = []
        for m in module.modules():
            mine = sorted({i for p in m.parameters(recurse=False) for i in owners.get(id(p), ())})
            if mine:
                waits = [buckets[i] for i in mine]
                handles.append(m.register_forward_pre_hook(lambda mod, args, waits=waits: _wait(waits)))
        return handles

    def launch(self, buckets: list[Bucket]) -> None:
        """After the optimizer updated these buckets' shards: write them back and all-gather (stage 3: copy
        masters into the shard only; its units gather on use).

        While ``torch.profiler`` records on gloo none is left in flight past the step: a gloo async work carries
        the profiler's record function to its completion, and a profiler stopped (its schedule stepping at the
        batch end) before the work completed crashed the process in ``work.wait()`` (a segfault in about 1 run in
        10 of bench/'s profiled window, torch 2.13 CPU)."""
        for b in reversed(buckets):  # forward order: the first layers' parameters arrive first
            b.launch_gather(async_op=True)
        if self.overlap and not (self._gloo and torch.autograd._profiler_enabled()):
            self._pending += [b for b in buckets if b.spec.gathers_after_step]
        else:
            _wait(buckets)

    def wait_all(self) -> None:
        pending, self._pending = self._pending, []
        _wait(pending)


def _wait(buckets: list[Bucket]) -> None:
    for b in buckets:
        b.wait_param_gather()
