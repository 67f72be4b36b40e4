"""The engine's lifecycle enums, in one place, with the transitions the engine may take.

* :class:`GradState`: a bucket's gradients over an accumulation window (:func:`transition`);
* :class:`ParamState`: whether a stage-3 bucket's parameters are gathered (:func:`param_transition`);
* :class:`AccumulationPolicy`: what a micro-batch that is not an accumulation boundary communicates;
* :class:`SyncState`: the backward in progress, as the gradient-sync controller (``buckets/sync.py``) sees it;
* :class:`ControllerState`: what the stage-3 controller (``zero3/controller.py``) does with the units.

Every gradient and parameter state change goes through its transition function, which raises on an illegal move:
a bug in the sync controller shows up as a named error at the point it happens, not as silently wrong gradients
later.
"""

from __future__ import annotations

import enum
from typing import Callable

import torch


class GradState(enum.Enum):
    EMPTY = "empty"  # no gradient held for the current accumulation window
    ACCUMULATING = "accumulating"  # gradients held locally (full buffer or fp32 shard accumulator), not yet final
    REDUCING = "reducing"  # a collective on this unit's gradients is in flight
    REDUCED = "reduced"  # the rank's final, averaged gradient shard is ready for the optimizer


_ALLOWED = {
    GradState.EMPTY: {GradState.ACCUMULATING, GradState.REDUCING},
    GradState.ACCUMULATING: {GradState.ACCUMULATING, GradState.REDUCING, GradState.EMPTY},
    GradState.REDUCING: {GradState.ACCUMULATING, GradState.REDUCED},
    GradState.REDUCED: {GradState.EMPTY},
}


def transition(current: GradState, new: GradState, what: str) -> GradState:
    if new not in _ALLOWED[current]:
        raise RuntimeError(
            f"lightning_shard internal error: {what} cannot go from {current.value} to {new.value} "
            f"(allowed: {sorted(s.value for s in _ALLOWED[current])}). Please report this with the traceback."
        )
    return new


class ParamState(enum.Enum):
    """Whether a ZeRO-3/FSDP unit's parameters are materialized (stage 3 only)."""

    SHARDED = "sharded"  # only the rank's shard exists; module parameters are empty placeholders
    GATHERING = "gathering"  # an all-gather into the full buffer is in flight (e.g. a prefetch)
    UNSHARDED = "unsharded"  # module parameters are views into the full buffer


_PARAM_ALLOWED = {
    ParamState.SHARDED: {ParamState.GATHERING},
    ParamState.GATHERING: {ParamState.UNSHARDED},
    ParamState.UNSHARDED: {ParamState.SHARDED},
}


def param_transition(current: ParamState, new: ParamState, what: str) -> ParamState:
    if new not in _PARAM_ALLOWED[current]:
        raise RuntimeError(f"lightning_shard internal error: parameters of {what} cannot go from {current.value} "
                           f"to {new.value}. Please report this with the traceback.")
    return new


class AccumulationPolicy(str, enum.Enum):
    """What a shard unit communicates on micro-batches that are not an accumulation boundary."""

    DEFER = "defer"  # nothing; full gradients are held until the boundary (ZeRO-3: "keep_unsharded_grads")
    PER_MICRO_BATCH = "per_micro_batch"  # reduce-scatter into an fp32 shard accumulator, free full grads
    KEEP_PARAMS = "keep_params"  # ZeRO-3: parameters and full gradients stay materialized across the window

    @classmethod
    def parse(cls, value: str) -> "AccumulationPolicy":
        if value == "keep_unsharded_grads":
            return cls.DEFER
        return cls(value)


class SyncState(enum.Enum):
    """The backward in progress (from ``GradSync.begin`` to ``GradSync.end``), or none."""

    IDLE = "idle"  # no backward in progress
    LOCAL = "local"  # a no_sync backward under "defer": gradients stay in the full buffers, nothing moves
    MICRO_BATCH = "micro_batch"  # a no_sync backward under "per_micro_batch": reduce-scatter into accumulators
    BOUNDARY = "boundary"  # the backward that ends an accumulation window: every bucket is reduced and published


class ControllerState(enum.Enum):
    """What the parameter-sharding controller does with the units."""

    TRAINING = "training"  # hooks gather and free units along the schedule
    FULL_PARAMS = "full_params"  # inside full_params(): every unit gathered, hooks idle (generation, export)
    RELEASED = "released"  # after release_to_module(): the module owns full parameters for good, hooks removed


def autograd_running() -> bool:
    """True while autograd's engine runs a backward on this thread (hooks fired from backward, activation
    checkpointing's recomputation)."""
    return torch._C._current_graph_task_id() != -1


def eager(hook: Callable) -> Callable:
    """A module hook of the engine, run eagerly even inside a ``torch.compile``'d module: gathers, frees and waits
    change parameters' storage and register autograd hooks on real tensors, which a traced graph cannot replay.
    ``module.compile()`` compiles the hooks with the forward: a hook of the compiled module itself runs before or
    after its graph (dynamo counts no graph break, measured), a hook of a module inside it breaks the graph."""
    return torch.compiler.disable(hook, recursive=True)
