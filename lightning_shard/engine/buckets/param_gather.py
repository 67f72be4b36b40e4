"""Stages 1/2: the all-gather of updated parameters after each step. With ``overlap_param_gather`` it runs in
the background and each module waits for its own buckets in a forward pre-hook, so the gather overlaps the
next forward; anything that reads or writes parameters outside a forward calls :meth:`PostStepGathers.wait_all`.

A parameter read before its module's forward (by the step's own code: a LightningModule's own ``nn.Parameter``, a
weight used in a loss computed before the forward) would be read while its gather is in flight, and a rank that
does not own it would compute with the previous value. The root module's own parameters are known up front: their
buckets are waited at the end of the step. Other such reads are found in the first step with a gather in flight
(:meth:`PostStepGathers.watch`, the stage-3 guard of :mod:`.guard`): the read waits for its bucket right there, and
that bucket is waited at the end of every step from then on.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch
from torch import nn

from ..comm import collectives as C
from ..states import eager
from ..zero3.guard import ShardedUseGuard
from ..zero3.plan import compiled_modules
from .bucket import Bucket


class PostStepGathers:
    def __init__(self, module: nn.Module, buckets: list[Bucket], overlap: bool) -> None:
        self.overlap = overlap and any(b.spec.gathers_after_step for b in buckets)
        self._gloo = bool(buckets) and C.backend(buckets[0].group) == "gloo"  # the groups' backend does not change
        self._pending: list[Bucket] = []
        self._bucket_of = {id(p): b for b in buckets for p in b.params}
        self.handles: list[Any] = self._register_waits(module, buckets) if self.overlap else []
        # buckets holding a parameter of the root module itself (a LightningModule's own nn.Parameter, read by its
        # training_step): no forward of it is sure to run before the read, so nothing could wait there; they are
        # waited at the end of the step instead of overlapping the next forward (read in flight, a rank that owns
        # none of it computed with the previous value: a silent difference)
        root = {id(p) for p in module.parameters(recurse=False)}
        self._unhooked = {b.index for b in buckets if any(id(p) in root for p in b.params)}
        self._watched = False

    def _register_waits(self, module: nn.Module, buckets: list[Bucket]) -> list[Any]:
        """A wait hook on each module holding parameters directly; inside a ``torch.compile``'d module, one on the
        compiled module for everything below it (the hooks run eagerly, before the compiled graph: no graph break)."""
        compiled = [c for c in compiled_modules(module) if c]  # the root's forward may never run
        waits_of: dict[str, set[int]] = {}
        named = dict(module.named_modules())
        for name, m in named.items():
            if m is module:  # the root: waited at the step's end (``_unhooked``)
                continue
            mine = {self._bucket_of[id(p)].index for p in m.parameters(recurse=False) if id(p) in self._bucket_of}
            if mine:
                at = next((c for c in compiled if name == c or name.startswith(c + ".")), name)
                waits_of.setdefault(at, set()).update(mine)
        handles = []
        for at, indices in waits_of.items():
            waits = [buckets[i] for i in sorted(indices)]
            handles.append(named[at].register_forward_pre_hook(eager(lambda mod, args, waits=waits: _wait(waits))))
        return handles

    def launch(self, buckets: list[Bucket]) -> None:
        """After the optimizer updated these buckets' shards: write them back and all-gather (stage 3: copy
        masters into the shard only; its units gather on use).

        While ``torch.profiler`` records on gloo none is left in flight past the step: a gloo async work carries
        the profiler's record function to its completion, and a profiler stopped (its schedule stepping at the
        batch end) before the work completed crashed the process in ``work.wait()`` (a segfault in about 1 run in
        10 of the speed benchmark's profiled window, torch 2.13 CPU)."""
        for b in reversed(buckets):  # forward order: the first layers' parameters arrive first
            b.gather.launch_after_step(async_op=True)
        if self.overlap and not (self._gloo and torch.autograd._profiler_enabled()):
            self._pending += [b for b in buckets if b.spec.gathers_after_step and b.index not in self._unhooked]
            _wait([b for b in buckets if b.index in self._unhooked])
        else:
            _wait(buckets)

    @contextmanager
    def watch(self) -> Iterator[None]:
        """Around a training step's code: the first one that starts with gathers in flight runs under the guard,
        which makes a read of a parameter whose gather is in flight wait for it and keeps its bucket out of the
        overlap from then on (see the module docstring). No cost after that step."""
        if self._watched or not self._pending:
            yield
            return
        self._watched = True
        with ShardedUseGuard(self._in_flight, self._read_in_flight):
            yield

    def _in_flight(self, t: torch.Tensor) -> Optional[Bucket]:
        b = self._bucket_of.get(id(t))
        return b if b is not None and b.gather.gathering else None

    def _read_in_flight(self, bucket: Bucket, t: torch.Tensor, func: Any) -> None:
        self._unhooked.add(bucket.index)
        bucket.gather.wait_after_step()

    def wait_all(self) -> None:
        pending, self._pending = self._pending, []
        _wait(pending)


def _wait(buckets: list[Bucket]) -> None:
    for b in buckets:
        b.gather.wait_after_step()
