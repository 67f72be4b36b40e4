"""Engine <-> sharded checkpoint: which pieces this rank writes, and how a rank fills its layout back.

Pieces are per parameter name (the first name of a tied weight; ``meta["aliases"]`` lists the others), so
the reading layout (strategy, world size, bucket sizes, units) never has to match the writing one.
Writers: in stages 1-3 each rank writes what it owns; stage 0 and the replicas of hybrid sharding hold
copies, so only the first copy (rank 0 / the first shard group) writes. Frozen parameters outside the
buckets (stages 0-2) and buffers are written whole by rank 0.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..engine.comm import collectives as C
from ..engine.state_dict import param_aliases
from .format import CheckpointError, Reader

if TYPE_CHECKING:
    from ..engine.engine import ShardEngine


def _jsonable(v: Any) -> Any:
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if torch.is_tensor(v):
        return v.item() if v.numel() == 1 else v.tolist()
    if isinstance(v, (int, float, str, bool)) or v is None:
        return v
    return str(v)


def collect_pieces(engine: "ShardEngine") -> tuple[dict[str, torch.Tensor], dict[str, list], dict[str, Any]]:
    """(pieces, index entries ``key -> [lo, hi]``, meta) for this rank. Meta is identical on every rank."""
    engine.wait_params()
    aliases = param_aliases(engine.module)
    first_replica = engine.groups.replicate is None or C.get_rank(engine.groups.replicate) == 0
    global_rank = C.get_rank()
    pieces: dict[str, torch.Tensor] = {}
    index: dict[str, list] = {}
    shapes: dict[str, list[int]] = {}
    bucketed: set[int] = set()
    for b in engine.buckets:
        writer = first_replica and (b.spec.reduce_scatters or global_rank == 0)
        binding = engine.bindings[b.opt_index] if b.trainable else None
        states = b.optimizer_view.slot_state(binding.optimizer.state) if binding is not None else {}
        store = b.store
        for si, (slot, p) in enumerate(zip(b.layout.slots, b.params)):
            name = aliases[id(p)][0]
            shapes[name] = list(slot.shape)
            bucketed.add(id(p))
            a, e = max(slot.offset, b.own_lo), min(slot.end, b.own_hi)
            if not writer or a >= e:
                continue
            rng = [a - slot.offset, e - slot.offset]
            lo, hi = a - b.shard_start, e - b.shard_start
            src = store.flat_param[a:e] if not b.spec.shards_params else store.shard[lo:hi]
            pieces[f"param/{name}"], index[f"param/{name}"] = src, rng
            own = slice(a - b.own_lo, e - b.own_lo)
            if store.master is not None:
                pieces[f"master/{name}"], index[f"master/{name}"] = store.master[own], rng
            for k, v in states.get(si, {}).items():  # this parameter's own optimizer state (absent: never stepped)
                key = f"optim/{b.opt_index}/{name}/{k}"
                if torch.is_tensor(v) and v.dim() == 1 and v.numel() == e - a:
                    pieces[key], index[key] = v, rng
                elif rng[0] == 0:  # scalar state (step): written once, by the owner of the first element
                    pieces[key], index[key] = torch.as_tensor(v).clone(), [0, 1]
    module_state = engine.module.state_dict()
    for name, p in engine.module.named_parameters():
        if id(p) in bucketed:
            continue
        shapes[name] = list(p.shape)
        if global_rank == 0:
            pieces[f"param/{name}"], index[f"param/{name}"] = p.detach().reshape(-1), [0, p.numel()]
    param_names = {n for names in aliases.values() for n in names}
    for key, t in module_state.items():
        if key in param_names or not torch.is_tensor(t):
            continue
        shapes[key] = list(t.shape)
        if global_rank == 0:
            pieces[f"buffer/{key}"] = t.detach().reshape(-1) if t.dim() else t.detach()
            index[f"buffer/{key}"] = [0, max(1, t.numel())]
    optimizers = []
    for binding in engine.bindings:
        groups = []
        for gi, g in enumerate(binding.optimizer.param_groups):
            entry = {k: _jsonable(v) for k, v in g.items() if k != "params"}
            entry["param_names"] = [aliases[id(p)][0] for p in binding.orig_groups[gi]]
            groups.append(entry)
        optimizers.append({"class": type(binding.optimizer).__name__, "groups": groups})
    meta = {"shapes": shapes, "aliases": {ns[0]: ns for ns in aliases.values()}, "optimizers": optimizers,
            "dtypes": {k: str(v.dtype).replace("torch.", "") for k, v in pieces.items()}}
    return pieces, index, meta


def _check_names(reader: Reader, engine: "ShardEngine") -> None:
    have = set(reader.keys("param/"))
    want = {ns[0] for ns in param_aliases(engine.module).values()}
    missing, unexpected = sorted(want - have), sorted(have - want)
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {reader.path} does not match this model: missing {missing[:10]}"
                              f"{'...' if len(missing) > 10 else ''}, unexpected {unexpected[:10]}"
                              f"{'...' if len(unexpected) > 10 else ''}. Was it written for another model?")


def load_pieces(engine: "ShardEngine", reader: Reader, params: bool, optimizer: bool) -> None:
    """Fill this rank's shards (stage 3 parameters and every fp32 master) and/or its optimizer state."""
    engine.wait_params()
    _check_names(reader, engine)
    aliases = param_aliases(engine.module)
    for b in engine.buckets:
        if params:
            _load_bucket_params(b, reader, aliases)
        if optimizer and b.trainable:
            _load_bucket_optimizer(b, engine, reader, aliases)


def _load_bucket_params(b: Any, reader: Reader, aliases: dict) -> None:
    b.drop_secondary()  # hpZ's island copies hold the values before the load
    shard, master = b.store.shard, b.store.master
    with torch.no_grad():
        for slot, p in zip(b.layout.slots, b.params):
            name = aliases[id(p)][0]
            if b.spec.shards_params:  # from the fp32 masters where the writer had them (param_dtype, bf16-true)
                a, e = max(slot.offset, b.shard_start), min(slot.end, b.shard_end)
                key = f"master/{name}" if reader.has(f"master/{name}") else f"param/{name}"
                if a < e:
                    shard[a - b.shard_start:e - b.shard_start].copy_(
                        reader.read(key, a - slot.offset, e - slot.offset))
            if master is not None:
                a, e = max(slot.offset, b.own_lo), min(slot.end, b.own_hi)
                if a < e:
                    key = f"master/{name}" if reader.has(f"master/{name}") else f"param/{name}"
                    master[a - b.own_lo:e - b.own_lo].copy_(reader.read(key, a - slot.offset, e - slot.offset))


def _load_bucket_optimizer(b: Any, engine: "ShardEngine", reader: Reader, aliases: dict) -> None:
    binding = engine.bindings[b.opt_index]
    states: dict[int, dict[str, Any]] = {}
    for si, (lo, hi) in b.optimizer_view.slot_ranges.items():
        slot = b.layout.slots[si]
        name = aliases[id(b.params[si])][0]
        entry: dict[str, Any] = {}
        for k in reader.keys(f"optim/{b.opt_index}/{name}/"):
            first = reader.read(f"optim/{b.opt_index}/{name}/{k}", 0, 1)
            if first.dim() == 0:
                entry[k] = first
            else:
                a = b.own_lo + lo - slot.offset  # this rank's piece, in the parameter's flat coordinates
                entry[k] = reader.read(f"optim/{b.opt_index}/{name}/{k}", a, a + hi - lo).to(b.device)
        if entry:  # absent: saved before this parameter ever stepped
            states[si] = entry
    if b.optimizer_view.set_slot_state(binding.optimizer.state, states):
        binding.rebind(engine.buckets)  # parameters saved with different step counts got chunks of their own
    saved = reader.meta["optimizers"][b.opt_index]["groups"] if b.opt_index < len(reader.meta["optimizers"]) else []
    if len(saved) != len(binding.optimizer.param_groups):
        raise CheckpointError(f"checkpoint {reader.path}: optimizer {b.opt_index} has {len(saved)} param groups, the "
                              f"model's has {len(binding.optimizer.param_groups)}")
    for g, s in zip(binding.optimizer.param_groups, saved):
        for k, v in s.items():
            if k != "param_names" and k in g:
                g[k] = tuple(v) if isinstance(g[k], tuple) else v
