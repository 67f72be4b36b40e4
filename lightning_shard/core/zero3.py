"""Parameter sharding (ZeRO-3 / FSDP-style): when each unit's parameters are gathered and freed.

Forward: a unit's pre-forward hook waits for (or issues) its all-gather and prefetches the next
``prefetch_depth`` units in the recorded forward order; its post-forward hook frees the full parameters
(``reshard_after_forward``) and hooks the unit's outputs so that backward gathers the unit again (and
prefetches the units before it) right before its gradients are computed. Once every gradient of a unit
has been accumulated, the unit is freed and its gradient reduction joins the engine's in-order launch.

Policies across an accumulation window (DESIGN.md section 3):
``per_micro_batch``/``keep_unsharded_grads``: gather in forward and backward of every micro-batch;
``keep_params``: gather once per window, keep parameters (and full gradients) until the boundary.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from .bucket import Bucket
from .state import AccumulationPolicy, ParamState
from .units import UnitSpec

if TYPE_CHECKING:
    from .engine import ShardEngine


class Unit:
    def __init__(self, index: int, spec: UnitSpec, buckets: list[Bucket]) -> None:
        self.index, self.name, self.module, self.buckets = index, spec.name, spec.module, buckets
        self.trainable = [b for b in buckets if b.trainable]
        self.backward_prepared = False
        for b in buckets:
            b.unit = self

    @property
    def state(self) -> ParamState:
        return self.buckets[0].param_state

    @property
    def pending(self) -> int:
        return sum(b.pending for b in self.trainable)

    @property
    def full_bytes(self) -> int:
        return sum(b.layout.padded_numel * b.itemsize for b in self.buckets)

    def unshard(self, async_op: bool) -> None:
        for b in self.buckets:
            b.unshard(async_op)

    def wait(self) -> None:
        for b in self.buckets:
            b.wait_unshard()

    def reshard(self) -> None:
        for b in self.buckets:
            b.reshard()


class ParamShardController:
    def __init__(self, engine: "ShardEngine", units: list[Unit], reshard_after_forward: bool,
                 prefetch_depth: int) -> None:
        self.engine, self.units = engine, units
        self.reshard_after_forward, self.prefetch_depth = reshard_after_forward, prefetch_depth
        self.root: Optional[Unit] = next((u for u in units if u.module is None), None)
        self.fwd_order: list[int] = []
        self._pos: dict[int, int] = {}
        self._recording = True
        self.peak_gathered_bytes = 0
        self.events: list[tuple[str, int]] = []  # ("gather"|"wait"|"forward_done"|..., unit index), for tests
        self.record_events = False
        self._handles_paused = False  # inside full_params(): plain forward, no gather/free
        self.released = False  # release_to_module() ran: the module owns full parameters again
        self._handles = []
        for u in units:
            if u.module is not None:
                self._handles.append(u.module.register_forward_pre_hook(self._pre_forward_hook(u)))
                self._handles.append(u.module.register_forward_hook(self._post_forward_hook(u)))

    # ------------------------------------------------------------------ bookkeeping
    def _event(self, what: str, unit: Unit) -> None:
        if self.record_events:
            self.events.append((what, unit.index))

    def gathered_bytes(self) -> int:
        return sum(b.gathered_bytes for u in self.units for b in u.buckets)

    def _track_peak(self) -> None:
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes())

    def _keep_params(self) -> bool:
        """In a training forward under ``keep_params``: parameters stay for the rest of the window."""
        return self.engine.policy is AccumulationPolicy.KEEP_PARAMS and torch.is_grad_enabled()

    def _keep_after_backward(self) -> bool:
        return self.engine.policy is AccumulationPolicy.KEEP_PARAMS and not self.engine._boundary_this_backward

    def _materialize(self, unit: Unit) -> None:
        if unit.state is not ParamState.UNSHARDED:
            if unit.state is ParamState.SHARDED:
                self._event("gather", unit)
            unit.unshard(async_op=False)
            self._track_peak()
            unit.wait()
            self._event("ready", unit)

    def _prefetch(self, indices: list[int]) -> None:
        for i in indices:
            u = self.units[i]
            if u.state is ParamState.SHARDED:
                self._event("prefetch", u)
                u.unshard(async_op=True)
        self._track_peak()

    # ------------------------------------------------------------------ forward
    def _pre_forward_hook(self, unit: Unit):
        def hook(module: nn.Module, args: Any) -> None:
            if self._handles_paused:
                return
            if torch._C._current_graph_task_id() != -1:  # recomputation in backward (activation checkpointing)
                self._materialize(unit)  # gathered again if it was freed, e.g. a nested unit of the block
                return
            if self._recording and torch.is_grad_enabled() and unit.index not in self._pos:
                self._pos[unit.index] = len(self.fwd_order)
                self.fwd_order.append(unit.index)
            self._materialize(unit)
            if not self._recording and unit.index in self._pos and self.prefetch_depth:
                p = self._pos[unit.index]
                self._prefetch(self.fwd_order[p + 1:p + 1 + self.prefetch_depth])
        return hook

    def _post_forward_hook(self, unit: Unit):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self._handles_paused:
                return
            if torch._C._current_graph_task_id() != -1:
                # activation checkpointing recomputes this forward inside backward: the unit is gathered for
                # its backward already and must stay so; its outputs are not a new backward entry point
                return
            self._event("forward_done", unit)
            self._hook_backward(unit, output)
            if not torch.is_grad_enabled() or (self.reshard_after_forward and not self._keep_params()):
                unit.reshard()
        return hook

    def _hook_backward(self, unit: Unit, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, lambda grads: self._pre_backward(unit), mode="any")

    def step_pre_forward(self) -> None:
        """Around the LightningModule's step (the root unit is not inside any module forward we can hook)."""
        if self.root is not None and not self._handles_paused:
            self._materialize(self.root)

    def step_post_forward(self, output: Any) -> None:
        if self.root is None or self._handles_paused:
            return
        self._hook_backward(self.root, output)
        if not torch.is_grad_enabled() or (self.reshard_after_forward and not self._keep_params()):
            self.root.reshard()

    # ------------------------------------------------------------------ backward
    def _pre_backward(self, unit: Unit) -> None:
        if unit.backward_prepared:
            return
        unit.backward_prepared = True
        self._materialize(unit)
        for b in unit.trainable:
            b.attach_grads()
        if unit.index in self._pos and self.prefetch_depth:
            p = self._pos[unit.index]
            self._prefetch(list(reversed(self.fwd_order[max(0, p - self.prefetch_depth):p])))

    def on_grads_ready(self, unit: Unit) -> None:
        """All of ``unit``'s gradients are accumulated for this backward: its full parameters can go."""
        if not self._keep_after_backward():
            unit.reshard()

    def end_backward(self) -> None:
        self._recording = False
        keep = self._keep_after_backward()
        for u in self.units:
            u.backward_prepared = False
            if u.state is ParamState.GATHERING:  # prefetched but never used in this backward
                u.wait()
            if not keep:
                u.reshard()

    def before_step(self) -> None:
        """The optimizer is about to update the shards: no stale full copy may survive."""
        for u in self.units:
            if u.state is ParamState.GATHERING:
                u.wait()
            u.reshard()

    @contextmanager
    def full_params(self) -> Iterator[None]:
        """Every unit gathered for the duration (generation, export); resharded on exit. Collective."""
        for u in self.units:
            u.unshard(async_op=True)
        for u in self.units:
            u.wait()
        self._track_peak()
        paused, self._handles_paused = self._handles_paused, True
        try:
            yield
        finally:
            self._handles_paused = paused
            for u in self.units:
                u.reshard()

    def release_to_module(self) -> None:
        """End of training: gather every unit for good, so the plain module works without the engine."""
        if self.released:
            return
        self.released = True
        self.remove_hooks()
        for u in self.units:
            u.unshard(async_op=True)
        for u in self.units:
            u.wait()
            for b in u.buckets:
                b.detach_full()

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
