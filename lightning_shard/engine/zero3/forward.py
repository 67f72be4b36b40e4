"""Forward hooks of the parameter-sharding controller: gather a unit (and prefetch the next) when its forward
starts, free it when its forward ends, and hook its outputs so that backward gathers it again."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from ..states import autograd_running
from .unit import ControllerState, Unit, _enclosing


class ForwardHooks:
    """Part of :class:`~.param_shard.ParamShardController` (its state and gather/free methods)."""

    def _pre_forward_hook(self, unit: Unit):
        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            if self.state is not ControllerState.TRAINING:
                return
            with self._quiet():
                if autograd_running():  # a checkpointed block's forward recomputed inside backward
                    self._recompute(unit)  # in the backward schedule; not a forward of the pass
                    return
                self._stack.append(unit)
                p = self._pass
                if p is None:  # a forward outside the step's pass (no schedule): gather on demand
                    # (manual optimization: a forward after a backward of the same step; a backward may follow)
                    unit.ran = unit.ran or torch.is_grad_enabled()
                    self._materialize(unit)
                elif unit.index not in self._fpos:  # gathered with its host, used on its own here
                    self._unplanned(unit, "its module ran outside the unit it is gathered with")
                else:
                    if unit.resident:
                        p.extra.append(unit)
                    if p.grad:
                        unit.ran = True
                        if self._recording and unit.index not in self._seen:
                            self._seen.append(unit.index)
                    p.waiting.pop(unit, None)
                    pos = self._fpos[unit.index]
                    if pos >= p.cursor:
                        for k in range(p.cursor, pos):  # scheduled before this unit: gathered even if skipped here
                            self._issue(self.units[self.fwd_order[k]], "catch_up")
                            p.waiting[self.units[self.fwd_order[k]]] = None
                        self._issue(unit, "gather")
                        p.cursor = pos + 1
                        self._prefetch_forward(pos)
                        self._materialize(unit)
                    else:  # prefetched (or, if it was freed, run again / out of order: refused once agreed)
                        self._prefetch_forward(pos)
                        self._unplanned(unit, "its module ran again after its forward had ended in this step, or "
                                              "out of the order recorded in the first step")
                    for w, at in p.waiting.items():  # passed over by this unit: freed when their enclosure ends
                        if at is None and self._fpos[w.index] < pos:
                            p.waiting[w] = _enclosing(w.name, unit.name)
                if p is not None and p.grad and self._has_frozen(unit):
                    self._watch_inputs(unit, args, kwargs)
        return hook

    def _prefetch_forward(self, pos: int) -> None:
        """Keep ``prefetch_depth`` scheduled units issued ahead of schedule position ``pos`` (the unit whose forward
        starts; -1: the pass starts). Every unit's start moves the window, the prefetched ones' too, so that each unit
        after the first is gathered behind the compute of the ones before it. Issues follow the schedule's order, so
        every rank issues the same gathers in the same order whatever it runs."""
        p = self._pass
        for k in range(p.cursor, min(len(self.fwd_order), pos + 1 + self.prefetch_depth)):
            self._issue(self.units[self.fwd_order[k]])
            p.waiting[self.units[self.fwd_order[k]]] = None
            p.cursor = k + 1

    @staticmethod
    def _has_frozen(unit: Unit) -> bool:
        """A unit with trainable parameters only is done in backward when its last gradient is accumulated (every
        node that used one of its weights has run); frozen weights are used by nodes that accumulate nothing."""
        owner = unit.host or unit
        return any(not b.trainable for u in owner.group for b in u.buckets)

    def _watch_inputs(self, unit: Unit, args: Any, kwargs: Any) -> None:
        """Backward frees the unit only after the gradients of these inputs exist: computing them needs the
        unit's frozen weights too, after its trainable gradients are already in."""
        owner = unit.host or unit
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if not tensors:
            return
        owner.input_waits += 1

        def done(_: Any) -> None:
            owner.input_waits -= 1
            self._maybe_free_after_backward(owner)

        torch.autograd.graph.register_multi_grad_hook(tensors, done, mode="all")

    def _post_forward_hook(self, unit: Unit):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self.state is not ControllerState.TRAINING:
                return
            if autograd_running():
                # activation checkpointing recomputes this forward inside backward: the unit is gathered for
                # its backward already and must stay so; its outputs are not a new backward entry point
                return
            with self._quiet():
                if self._stack and self._stack[-1] is unit:
                    self._stack.pop()
                self._event("forward_done", unit)
                self._hook_backward(unit, output)
                p = self._pass
                grad = torch.is_grad_enabled() if p is None else p.grad
                if self._keeps_after_forward(grad) or unit in self._stack or unit.host is not None \
                        or unit in self.step_units or unit.resident:  # freed with their host, the step, the pass
                    return
                self._free(unit)
                self._end_of(unit.name)
        return hook

    def _end_of(self, name: str) -> None:
        """The forward of module ``name`` ended: units skipped inside it will not run in it any more."""
        p = self._pass
        if p is None or self.state is not ControllerState.TRAINING or self._keeps_after_forward(p.grad) or \
                autograd_running():
            return
        with self._quiet():
            for w in [w for w, at in p.waiting.items() if at == name]:
                del p.waiting[w]
                self._free(w)

    def _hook_backward(self, unit: Unit, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, lambda grads: self._pre_backward(unit), mode="any")
