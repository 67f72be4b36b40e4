"""Run-time detection of sharded parameters used where their unit is not gathered (first step only).

The unit plan (:mod:`.plan`, with the bytecode scan of :mod:`.reads`) puts a parameter in the unit of the
module whose code uses it. Code the scan cannot see — ``self.layers[0].weight``, a module handed to a helper
that reads its weight, a LightningModule's ``training_step`` computing logits with ``self.embed.weight`` —
would hand an empty placeholder to an op and fail with a shape error far from the cause.

During the first forward pass of each kind (with and without gradients), the controller runs the step under
:class:`ShardedUseGuard` (installed by :class:`~.discovery.Discovery`), a ``TorchFunctionMode`` that looks at the
tensor arguments of every torch call. When one is a parameter whose unit is sharded, it asks the controller to
gather that unit right there and records which unit's code used it; at the end of the pass the ranks agree on these
findings and the unit is gathered with its user from then on (``Unit.host``). Property reads that are valid on a
placeholder (``.dtype``, ``.device``, ``.requires_grad`` ...) are not uses. After the first pass the guard is off
(no per-op cost).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch.overrides import TorchFunctionMode

# attributes that mean the same on the empty placeholder as on the full parameter
HARMLESS = frozenset({"dtype", "device", "requires_grad", "is_leaf", "grad_fn", "layout", "is_cuda", "is_meta",
                      "is_sparse", "is_quantized", "is_nested", "names", "grad", "data", "_version"})


# calls whose answer does not depend on the data or the shape
HARMLESS_CALLS = frozenset({"is_floating_point", "is_complex", "element_size", "get_device",
                            "_has_compatible_shallow_copy_type", "_parse_to", "_set_grad_enabled"})


def _is_harmless(func: Any) -> bool:
    name = getattr(func, "__name__", "")
    if name in HARMLESS_CALLS:
        return True
    if name not in ("__get__", "__set__"):
        return False
    return getattr(getattr(func, "__self__", None), "__name__", "") in HARMLESS


def _tensors(args: tuple, kwargs: dict):
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, torch.Tensor):
                    yield b


class ShardedUseGuard(TorchFunctionMode):
    """``lookup(tensor)`` returns the unit of a managed parameter that is sharded now, else None;
    ``on_use(unit, tensor, func)`` gathers it (and records the finding)."""

    def __init__(self, lookup: Callable[[torch.Tensor], Optional[Any]],
                 on_use: Callable[[Any, torch.Tensor, Any], None]) -> None:
        super().__init__()
        self.lookup, self.on_use = lookup, on_use
        self.paused = 0
        self._stance: Any = None

    def __enter__(self) -> "ShardedUseGuard":
        # torch.compile'd modules run eagerly while the guard watches (the first step): dynamo would trace this
        # mode into their graphs, specialised to this step's tensors, and compile them again in the next step
        self._stance = torch.compiler.set_stance("force_eager")
        try:
            return super().__enter__()
        except BaseException:
            self._stance.__exit__(None, None, None)
            raise

    def __exit__(self, *exc: Any) -> Any:
        try:
            return super().__exit__(*exc)
        finally:
            self._stance.__exit__(None, None, None)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.to and not self.paused:  # Module.to(dtype) on a shard: a no-op conversion is no use
            out = func(*args, **kwargs)
            if args and out is args[0]:
                return out
        if not self.paused and not _is_harmless(func):
            for t in _tensors(args, kwargs):
                unit = self.lookup(t)
                if unit is not None:
                    self.paused += 1
                    try:
                        self.on_use(unit, t, func)
                    finally:
                        self.paused -= 1
        return func(*args, **kwargs)
