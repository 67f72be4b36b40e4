"""The Fabric strategies' checkpoints (``fabric.save`` / ``fabric.load``, the module's full ``state_dict()``), over the
save/load functions the Trainer strategies use too (``checkpoint/save_load.py``): mixed into
:class:`~lightning_shard.strategies.fabric.ZeroFabricStrategy`."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Generator, Optional, Union

import lightning
import torch
from torch import nn

from ..checkpoint import save_load

OWN_KEYS = "lightning_shard_fabric"  # the trainer-state entry naming which state keys hold modules / optimizers


class ShardedModule(nn.Module):
    """What ``setup_module`` returns to Fabric: the user's module inside a wrapper, so that Fabric sends the calls
    of a LightningModule's ``training_step`` (and the other step methods) through ``forward`` (Fabric redirects
    them only for a wrapped module), where the engine's hooks and the precision's autocast apply. State dicts
    are the inner module's (Fabric saves ``_original_module``)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


def _restore_rest(state: dict[str, Any], saved: dict[str, Any], done: set, path: Any, strict: bool) -> dict[str, Any]:
    """The entries of ``state`` besides the module and its optimizers (``done``): objects with ``load_state_dict``
    load theirs, the others are replaced by the saved values (as Fabric's own strategies do); returns the rest."""
    for name, obj in list(state.items()):
        if name in done:
            continue
        if name not in saved:
            if strict:
                raise KeyError(f"'{name}' is not in the checkpoint {path}; it holds {sorted(saved)}")
            continue
        if hasattr(obj, "load_state_dict") and callable(obj.load_state_dict):
            obj.load_state_dict(saved.pop(name))
        else:
            state[name] = saved.pop(name)
    return saved


def _inner(module: Any) -> Any:
    """The user's module inside our wrapper (what ``fabric.save`` hands over is the wrapper)."""
    return module.module if isinstance(module, ShardedModule) else module


class FabricCheckpoints:
    """Checkpoint methods of the Fabric strategies (the host: a Lightning Fabric ``ParallelStrategy`` with an
    engine, ``options`` and the set-up module ``_module``)."""

    engine: Any
    options: Any
    _module: Optional[nn.Module]
    _raw_state = False  # state_dict() without the full-weights hook (shapes, buffers)

    def _full_state_hook(self, module: nn.Module, state: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        engine = self.engine
        if engine is None or self._raw_state or self._released():
            return
        engine.wait_params()  # a post-step all-gather may still be in flight
        for name, value in engine.gather_full().items():
            if prefix + name in state:
                state[prefix + name] = value

    @contextmanager
    def _raw(self) -> Generator[None, None, None]:
        previous, self._raw_state = self._raw_state, True
        try:
            yield
        finally:
            self._raw_state = previous

    def get_module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        """Full weights (collective: every rank calls it); fp32 masters in place of half-precision parameters."""
        if self.engine is not None:
            self.engine.wait_params()
        return _inner(module).state_dict()

    def load_module_state_dict(self, module: nn.Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        if _inner(module) is self._module:
            self._load_module(strict, None, weights=state_dict)
        else:
            _inner(module).load_state_dict(state_dict, strict=strict)

    def get_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Torch's per-parameter optimizer state of the full model (collective)."""
        if self.engine is None:
            return optimizer.state_dict()
        return self.engine.binding_for(optimizer).full_state_dict()

    def _released(self) -> bool:
        return save_load.released(self.engine)

    def _split_state(self, state: dict[str, Any]) -> tuple[Optional[str], list[str], dict[str, Any]]:
        """(the key of our module, the keys of its optimizers in order, the other entries)."""
        module_key, opt_keys, rest = None, [], {}
        optimizers = [b.optimizer for b in self.engine.bindings] if self.engine is not None else []
        for k, v in state.items():
            if isinstance(v, nn.Module) and _inner(v) is self._module:
                module_key = k
            elif isinstance(v, torch.optim.Optimizer) and any(v is o for o in optimizers):
                opt_keys.append(k)
            else:
                rest[k] = v
        opt_keys.sort(key=lambda k: next(i for i, o in enumerate(optimizers) if o is state[k]))
        return module_key, opt_keys, rest

    def save_checkpoint(self, path: Any, state: dict[str, Any], storage_options: Optional[Any] = None,
                        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None) -> None:
        """``state_dict_type="sharded"`` (default): a checkpoint directory in which each rank writes its own shards
        (the Trainer's format; ``lightning-shard consolidate`` makes one file of it). ``"dcp"``: the same through
        ``torch.distributed.checkpoint``. ``"full"``: one file from rank 0, as Fabric's own strategies write.
        Collective."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint does not take storage_options")
        if not save_load.writes_pieces(self.options.state_dict_type, self.engine):
            save_load.refuse_file_over_folder(path)
            return super().save_checkpoint(path, state, filter=filter)
        if filter:
            raise NotImplementedError("save filters with state_dict_type='sharded' (each rank writes whole shards); "
                                      "use state_dict_type='full' to filter")
        module_key, opt_keys, rest = self._split_state(state)
        if module_key is None:
            raise ValueError("fabric.save(path, state): the state holds no module set up by this strategy; pass "
                             "{'model': model, 'optimizer': optimizer, ...}")
        others = self._convert_stateful_objects_in_state(rest, filter={})
        others[OWN_KEYS] = {"module": module_key, "optimizers": opt_keys}
        # what a Trainer resuming from this checkpoint looks for (its loops start at 0: Fabric keeps no loop state)
        others.setdefault("pytorch-lightning_version", lightning.__version__)
        others.setdefault("lr_schedulers", [])
        save_load.save(self.engine, self.options.state_dict_type, others, path, type(self).strategy_name)

    def load_checkpoint(self, path: Any,
                        state: Optional[Union[nn.Module, torch.optim.Optimizer, dict[str, Any]]] = None,
                        strict: bool = True, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """A sharded directory (from Fabric or the Trainer, any strategy and world size) or a full file; the
        objects in ``state`` are restored in place; returns what the checkpoint holds beyond them."""
        reader = save_load.open_directory(path, self._module)  # a directory that is not a complete checkpoint raises
        if reader is None:
            return self._load_full(path, state, strict)
        saved = reader.trainer_state()
        own = saved.pop(OWN_KEYS, None) or {}
        saved.pop("lightning_shard", None)  # a DCP directory's record of the saving job
        if isinstance(state, nn.Module):
            state = {own.get("module", "model"): state}
        if not state:
            raise ValueError("fabric.load of a sharded checkpoint needs the objects to restore: "
                             "fabric.load(path, {'model': model, 'optimizer': optimizer}); for the full weights "
                             "without a model run `lightning-shard consolidate`")
        module_key, opt_keys, _ = self._split_state(state)
        if module_key is not None:
            self._load_module(strict, reader.path, reader=reader)
        if opt_keys:
            save_load.load_optimizers(self.engine, [state[k] for k in opt_keys], reader.path, reader=reader)
        for k in ("state_dict", "optimizer_states", own.get("module"), *own.get("optimizers", [])):
            saved.pop(k, None)
        return _restore_rest(state, saved, {module_key, *opt_keys}, path, strict)

    def _load_module(self, strict: bool, where: Any, reader: Any = None,
                     weights: Optional[dict[str, torch.Tensor]] = None) -> None:
        """The set-up module's weights from a checkpoint directory or full tensors (checkpoint/save_load.py), with
        ``model.state_dict()``'s full-weights hook off (the shapes check reads the module's own tensors)."""
        assert self._module is not None
        with self._raw():
            masters = save_load.load_model(self._module, self.engine, strict, where, reader=reader, weights=weights)
        if masters is not None and self.engine is not None:  # the module took them: the fp32 masters too
            self.engine.load_full(masters, masters_only=True)

    def _load_full(self, path: Any, state: Any, strict: bool) -> dict[str, Any]:
        """A regular file (ours with state_dict_type='full', or any Fabric strategy's): read with weights_only."""
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
        if not state:
            return checkpoint
        if isinstance(state, nn.Module):
            state = {"model": state}
            checkpoint = {"model": checkpoint}
        module_key, opt_keys, _ = self._split_state(state)
        if module_key is not None:
            self._load_module(strict, path, weights=checkpoint.pop(module_key))
        if opt_keys:
            save_load.load_optimizers(self.engine, [state[k] for k in opt_keys], path,
                            states=[checkpoint.pop(k) for k in opt_keys])
        return _restore_rest(state, checkpoint, {module_key, *opt_keys}, path, strict)
