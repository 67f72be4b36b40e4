"""Lightning's model summary with the real parameter counts of a sharded model.

Under zero3 / fsdp_shard a parameter holds no elements between steps (its data lives in a flat shard), so
Lightning's own summary reports ``Total params: 0``. :func:`install` points every ``ModelSummary`` callback of
the trainer at :class:`ShardedSummary`, which counts each parameter's full size (from the engine's layout) and
adds a "Params per Device" column with the elements this rank holds, as Lightning's DeepSpeed summary does.
"""

from __future__ import annotations

import types
from collections import OrderedDict
from typing import Any

from lightning.pytorch.callbacks import ModelSummary as ModelSummaryCallback
from lightning.pytorch.utilities.model_summary import LayerSummary, ModelSummary
from lightning.pytorch.utilities.model_summary.model_summary import get_human_readable_count


def param_sizes(engine: Any) -> dict[int, tuple[int, int]]:
    """``id(parameter) -> (full numel, elements this rank holds)`` for every parameter the engine shards."""
    out: dict[int, tuple[int, int]] = {}
    for b in engine.buckets:
        lo, hi = b.own_lo, b.own_hi
        for p, slot in zip(b.params, b.layout.slots):
            held = slot.numel if not b.spec.shards_params else max(0, min(hi, slot.end) - max(lo, slot.offset))
            out[id(p)] = (slot.numel, held)
    return out


def _count(params: Any, sizes: dict[int, tuple[int, int]], which: int) -> int:
    return sum(sizes[id(p)][which] if id(p) in sizes else p.numel() for p in params)


class _ShardedLayerSummary(LayerSummary):
    sizes: dict[int, tuple[int, int]] = {}

    @property
    def num_parameters(self) -> int:
        return _count(self._module.parameters(), self.sizes, 0)

    @property
    def held_parameters(self) -> int:
        return _count(self._module.parameters(), self.sizes, 1)


class ShardedSummary(ModelSummary):
    """:class:`ModelSummary` counting full parameter sizes from ``sizes`` (see :func:`param_sizes`)."""

    def __init__(self, model: Any, sizes: dict[int, tuple[int, int]], max_depth: int = 1) -> None:
        self._sizes = sizes
        super().__init__(model, max_depth=max_depth)

    def summarize(self) -> dict[str, LayerSummary]:  # as Lightning's, with our layer summary
        summary: dict[str, LayerSummary] = OrderedDict()
        for name, module in self.named_modules:
            layer = _ShardedLayerSummary(module)
            layer.sizes = self._sizes
            summary[name] = layer
        if self._model.example_input_array is not None:
            self._forward_example_input()
        for layer in summary.values():
            layer.detach_hook()
        if self._max_depth >= 1:
            for k in [k for k in summary if k.count(".") >= self._max_depth]:
                del summary[k]
        return summary

    @property
    def total_parameters(self) -> int:
        return _count(self._model.parameters(), self._sizes, 0)

    @property
    def trainable_parameters(self) -> int:
        return _count((p for p in self._model.parameters() if p.requires_grad), self._sizes, 0)

    def _get_summary_data(self) -> list[tuple[str, list[str]]]:
        data = super()._get_summary_data()
        held = [get_human_readable_count(layer.held_parameters) for layer in self._layer_summary.values()]
        at = next(i for i, (title, _) in enumerate(data) if title == "Params") + 1
        return [*data[:at], ("Params per Device", held), *data[at:]]


def install(trainer: Any, engine: Any) -> None:
    """Make the trainer's model-summary callbacks (plain or rich) summarize with the engine's full sizes."""
    sizes = param_sizes(engine)

    def _summary(cb: Any, trainer: Any, pl_module: Any) -> ModelSummary:
        return ShardedSummary(pl_module, sizes, max_depth=cb._max_depth)

    for cb in trainer.callbacks:
        if isinstance(cb, ModelSummaryCallback):
            cb._summary = types.MethodType(_summary, cb)
