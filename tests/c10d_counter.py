"""An independent count of the calls into ``torch.distributed``, to hold the ledger to account.

:class:`C10dCounter` replaces torch.distributed's public collective functions (in ``torch.distributed`` and
``torch.distributed.distributed_c10d``) with wrappers that record the op and the module that called it (the first
frame outside torch.distributed), counting only the outermost call (``all_gather_object`` calls ``all_gather``
inside: one call). It knows nothing of lightning_shard.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, Callable

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

# public function -> the ledger's op name for it
OPS = {
    "all_reduce": "all_reduce", "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter": "reduce_scatter", "all_gather_into_tensor": "all_gather", "all_gather_single": "all_gather",
    "all_gather": "all_gather", "broadcast": "broadcast", "barrier": "barrier", "monitored_barrier": "barrier",
    "all_gather_object": "all_gather_object", "broadcast_object_list": "broadcast_object", "reduce": "reduce",
    "gather": "gather", "scatter": "scatter", "gather_object": "gather_object", "scatter_object_list": "scatter_object",
    "all_to_all": "all_to_all", "all_to_all_single": "all_to_all", "send": "send", "recv": "recv", "isend": "send",
    "irecv": "recv", "batch_isend_irecv": "p2p",
}


class C10dCounter:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []  # (op, calling module)
        self._local = threading.local()
        self._lock = threading.Lock()
        self._saved: list[tuple[Any, str, Callable]] = []

    def mark(self) -> int:
        with self._lock:
            return len(self.calls)

    def since(self, mark: int) -> list[tuple[str, str]]:
        with self._lock:
            return list(self.calls[mark:])

    def _wrap(self, name: str, fn: Callable) -> Callable:
        op = OPS[name]

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(self._local, "depth", 0)
            if depth == 0:
                frame = sys._getframe(1)
                while frame is not None and frame.f_globals.get("__name__", "").startswith("torch.distributed"):
                    frame = frame.f_back
                caller = frame.f_globals.get("__name__", "?") if frame is not None else "?"
                with self._lock:
                    self.calls.append((op, caller))
            self._local.depth = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._local.depth = depth

        wrapper.__wrapped_by_counter__ = True  # type: ignore[attr-defined]
        return wrapper

    def __enter__(self) -> "C10dCounter":
        originals: dict[str, Callable] = {}
        for name in OPS:
            fn = getattr(c10d, name, None) or getattr(dist, name, None)
            if fn is None or getattr(fn, "__wrapped_by_counter__", False):
                continue
            originals[name] = fn
        for name, fn in originals.items():
            wrapped = self._wrap(name, fn)
            for mod in (dist, c10d):
                if getattr(mod, name, None) is fn:
                    self._saved.append((mod, name, fn))
                    setattr(mod, name, wrapped)
        return self

    def __exit__(self, *exc: Any) -> None:
        for mod, name, fn in self._saved:
            setattr(mod, name, fn)
        self._saved.clear()
