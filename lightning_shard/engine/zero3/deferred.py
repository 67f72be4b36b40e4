"""Deferred initialization: a model built on the meta device is materialized one module at a time.

Parameters created on ``meta`` (e.g. in ``LightningModule.configure_model()`` under the stage-3 strategy's
``model_sharded_context``) are replaced by empty placeholders that remember their shape, so an optimizer
can be built over them before any memory is spent. The engine then materializes module by module in
registration order: it gives the module's parameters full storage, runs the init function
(``reset_parameters()`` or a user ``param_init_fn(module)``), and as soon as every module touching a unit's
parameters is done, flattens the unit, keeps this rank's shard and frees the rest. Peak memory during setup
is the rank's shards plus roughly one unit, not the model.

Values: with the same RNG state, a module's parameters get exactly what its ``reset_parameters()`` would give
in a full init in registration order, which is what standard layers do at construction. A weight tied across
modules is initialized by every module that holds it, in order (as ``model.apply(fn)`` would).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in list(module.parameters()) + list(module.buffers()))


class DeferredInit:
    def __init__(self, module: nn.Module, init_fn: Optional[Callable[[nn.Module], None]],
                 device: torch.device) -> None:
        self.module, self.init_fn, self.device = module, init_fn, device
        self.shapes: dict[int, torch.Size] = {}
        self.referrers: dict[int, list[nn.Module]] = {}  # param id -> modules holding it directly
        replaced: dict[int, nn.Parameter] = {}
        for m in module.modules():
            for name, p in list(m._parameters.items()):
                if p is None or not p.is_meta:
                    if p is not None:
                        self.referrers.setdefault(id(p), []).append(m)
                    continue
                new = replaced.get(id(p))
                if new is None:
                    new = nn.Parameter(torch.empty(0, dtype=p.dtype, device=device), requires_grad=p.requires_grad)
                    replaced[id(p)] = new
                    self.shapes[id(new)] = p.shape
                m._parameters[name] = new  # the same placeholder everywhere: ties survive
                self.referrers.setdefault(id(new), []).append(m)
        self.pending = {id(p) for p in replaced.values()}
        self.replaced = replaced  # id(meta parameter) -> its placeholder (optimizers made before: see remap)
        # accounting: bytes of full (unsharded) parameter storage alive at once during materialization
        self.live: dict[int, int] = {}
        self.peak_live_bytes = 0

    def remap(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """Optimizers created over the meta parameters (Fabric: before set-up) take the placeholders instead."""
        for opt in optimizers:
            for g in opt.param_groups:
                g["params"] = [self.replaced.get(id(p), p) for p in g["params"]]

    def is_deferred(self, p: nn.Parameter) -> bool:
        return id(p) in self.shapes

    def numel(self, p: nn.Parameter) -> int:
        shape = self.shapes.get(id(p))
        return p.numel() if shape is None else int(torch.Size(shape).numel())

    def modules_in_order(self) -> list[nn.Module]:
        """Modules that hold a deferred parameter or a meta buffer, in registration order."""
        out = []
        for m in self.module.modules():
            direct = list(m._parameters.values())
            if any(p is not None and id(p) in self.shapes for p in direct) or \
                    any(b is not None and b.is_meta for b in m._buffers.values()):
                out.append(m)
        return out

    def sharded(self, params: list[nn.Parameter]) -> None:
        """These parameters now live only as shards: their full storage is gone."""
        for p in params:
            self.live.pop(id(p), None)

    def materialize(self, m: nn.Module) -> None:
        """Give ``m``'s parameters and buffers full storage and initialize them."""
        for p in m._parameters.values():
            if p is not None and id(p) in self.pending:
                p.data = torch.empty(self.shapes[id(p)], dtype=p.dtype, device=self.device)
                self.pending.discard(id(p))
                self.live[id(p)] = p.numel() * p.element_size()
        self.peak_live_bytes = max(self.peak_live_bytes, sum(self.live.values()))
        meta_buffers = [n for n, b in m._buffers.items() if b is not None and b.is_meta]
        for n in meta_buffers:
            m._buffers[n] = torch.empty_like(m._buffers[n], device=self.device)
        if self.init_fn is not None:
            with torch.no_grad():
                self.init_fn(m)
        elif hasattr(m, "reset_parameters"):
            m.reset_parameters()
        elif any(True for _ in m.parameters(recurse=False)) or meta_buffers:
            raise ValueError(
                f"module {type(m).__name__} was created on the meta device but has no reset_parameters(), so its "
                f"values cannot be initialized shard by shard; pass param_init_fn=fn to the strategy (fn(module) "
                f"initializes that module's own parameters and buffers)."
            )
