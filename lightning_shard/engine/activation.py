"""Activation checkpointing of chosen blocks (the ``activation_checkpointing`` knob): each block's forward runs
under ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``, so the activations inside it are dropped
after forward and recomputed from its inputs in backward.

The blocks: ``"auto"`` takes the classes of the modules held in ``nn.ModuleList``s (the notion of fsdp_shard's
``wrap_classes="auto"``, :func:`.units.auto_wrap_classes`), or a list of module classes / class names. Only the
outermost matching module of a subtree is checkpointed (checkpointing inside a checkpointed block would recompute
its body twice).

**How: the forward is replaced on the instance** (``module.forward = CheckpointedForward(module)``), not the module
wrapped in another one (torch's ``checkpoint_wrapper``):

- the parameter names stay: a wrapper module puts ``_checkpoint_wrapped_module.`` into every FQN below it, so
  ``model.state_dict()``, the engine's parameter names, sharded checkpoints and the unit plan would all need their
  keys fixed; here they are the unwrapped model's, and checkpoints load across runs with and without the knob;
- the class stays: ``wrap_classes``, ``leaf_modules`` and ``plan_units`` see the same model;
- the module's own hooks (stage 3's gather/free, zero1/2's wait for the post-step gather, a user's) stay outside the
  checkpoint and run once per forward; only the body is recomputed (what Hugging Face's
  ``GradientCheckpointingLayer`` does too). Hooks of modules *inside* the block do run again in the recomputation:
  the stage-3 controller recognises it (``state.autograd_running()``, engine/zero3/forward.py).

Only training forwards are checkpointed (the block in ``train()`` mode with gradients enabled, Hugging Face's rule):
in validation, under ``torch.no_grad()`` or in ``eval()`` mode the block runs as it is. A Hugging Face KV cache passed
to a checkpointed block is dropped, as Hugging Face's own gradient checkpointing does: the recomputation would write
it a second time. :meth:`ActivationCheckpointing.remove` puts the original forwards back.
"""

from __future__ import annotations

import difflib
import logging
from dataclasses import dataclass, field
from typing import Any, Union

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .zero3.plan import _classes, _matches, auto_wrap_classes

log = logging.getLogger(__name__)

Spec = Union[None, str, type, list, tuple]


def _name(c: Union[str, type]) -> str:
    return c if isinstance(c, str) else c.__name__


def select(root: nn.Module, spec: Spec) -> list[tuple[str, nn.Module]]:
    """The modules to checkpoint, outermost only, in registration order (the root itself never). ``spec``: the
    ``activation_checkpointing`` option as validated (``lightning_shard/options``)."""
    if spec is None:
        return []
    classes = auto_wrap_classes(root) if spec == "auto" else _classes(spec)
    modules = [(n, m) for n, m in root.named_modules() if n]
    if spec != "auto":
        missing = [c for c in classes if not any(_matches(m, (c,)) for _, m in modules)]
        if missing:
            present = sorted({type(m).__name__ for _, m in root.named_modules()})
            close = [m for c in missing if isinstance(c, str) for m in difflib.get_close_matches(c, present, n=1)]
            raise ValueError(f"activation_checkpointing={[_name(c) for c in classes]}: "
                             f"{', '.join(repr(_name(c)) for c in missing)} matched no module of the model"
                             + (f" (did you mean {', '.join(map(repr, close))}?)" if close else "")
                             + f"; module classes in this model: {present}")
    chosen: list[tuple[str, nn.Module]] = []
    for n, m in modules:
        if classes and _matches(m, classes) and not any(n.startswith(c + ".") for c, _ in chosen):
            chosen.append((n, m))
    return chosen


def _is_hf_cache(x: Any) -> bool:
    return any(c.__name__ == "Cache" and c.__module__.startswith("transformers") for c in type(x).__mro__)


class CheckpointedForward:
    """A module's forward under non-reentrant ``torch.utils.checkpoint``, set as the instance's ``forward``."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.previous = module.__dict__.get("forward")  # an instance-level forward already there (else the class's)

    def original(self, *args: Any, **kwargs: Any) -> Any:
        if self.previous is not None:
            return self.previous(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not (self.module.training and torch.is_grad_enabled()):  # not a training forward (as Hugging Face's rule)
            return self.original(*args, **kwargs)
        if any(_is_hf_cache(a) for a in (*args, *kwargs.values())):  # written again by the recomputation
            args = tuple(None if _is_hf_cache(a) else a for a in args)
            kwargs = {k: None if _is_hf_cache(v) else v for k, v in kwargs.items()}
            if kwargs.get("use_cache"):
                kwargs["use_cache"] = False
        return checkpoint(self.original, *args, use_reentrant=False, **kwargs)


@dataclass
class ActivationCheckpointing:
    """The checkpointed modules of one model (FQN, module), and how to undo it."""

    spec: Spec
    modules: list[tuple[str, nn.Module]] = field(default_factory=list)

    def describe(self) -> str:
        """One line for the log: how many modules of which classes."""
        if not self.modules:
            return (f"activation_checkpointing={self.spec!r} found no block (no nn.ModuleList holding modules with "
                    "parameters): nothing is checkpointed; name the block classes instead")
        counts: dict[str, int] = {}
        for _, m in self.modules:
            counts[type(m).__name__] = counts.get(type(m).__name__, 0) + 1
        kinds = ", ".join(f"{c} x {n}" for c, n in counts.items())
        return (f"activation checkpointing: {kinds} ({len(self.modules)} module(s), forward recomputed in backward; "
                f"first {self.modules[0][0]})")

    def remove(self) -> None:
        """Put every original forward back."""
        for _, m in self.modules:
            patched = m.__dict__.get("forward")
            if isinstance(patched, CheckpointedForward):
                if patched.previous is None:
                    del m.forward
                else:
                    m.forward = patched.previous
        self.modules = []


def apply(root: nn.Module, spec: Spec) -> ActivationCheckpointing:
    """Checkpoint the modules ``spec`` selects in ``root`` (a module already checkpointed here is left as it is)."""
    chosen = select(root, spec)
    for _, m in chosen:
        if not isinstance(m.__dict__.get("forward"), CheckpointedForward):
            m.forward = CheckpointedForward(m)
    return ActivationCheckpointing(spec, chosen)


def checkpointed(module: nn.Module) -> bool:
    return isinstance(module.__dict__.get("forward"), CheckpointedForward)


__all__ = ["ActivationCheckpointing", "CheckpointedForward", "apply", "checkpointed", "select"]
