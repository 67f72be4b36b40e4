"""The one module of lightning_shard that calls ``torch.distributed``.

Every all-reduce, reduce-scatter, all-gather and broadcast of the project goes through the functions
below, and each call is written into :data:`LEDGER` with its op, process group, tensor bytes and the
bytes a ring implementation moves per rank ("wire bytes"). Tests compare the ledger with the ZeRO
formulas, the planner reads it back, and a logging callback reports it per step.

Wire bytes per rank follow the nccl-tests "busbw" conventions
(https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md):
reduce-scatter and all-gather move (N-1)/N of the full tensor, all-reduce twice that, a broadcast
delivers the tensor once to every non-root rank. Object collectives (pickled metadata) and barriers are
recorded too, so the ledger sees every call this project makes into ``torch.distributed``; their bytes are
this rank's pickle (an all-gather receives N-1 of them, approximated with this rank's size). The ledger itself:
:mod:`.ledger`.

torch 2.13 deprecates ``all_gather_into_tensor``/``reduce_scatter_tensor`` in favour of
``all_gather_single``/``reduce_scatter_single``: :func:`_rs_impl` / :func:`_ag_impl` pick whichever the
installed torch has.
"""

from __future__ import annotations

import atexit
import pickle
import time
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from .ledger import Ledger

__all__ = [
    "LEDGER",
    "all_gather",
    "all_gather_by_broadcasts",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "backend",
    "barrier",
    "broadcast",
    "broadcast_coalesced",
    "broadcast_object",
    "get_rank",
    "get_world_size",
    "group_name",
    "install_exit_guard",
    "is_initialized",
    "new_group",
    "reduce_scatter",
    "set_timeout",
    "wait",
]

Group = Optional[dist.ProcessGroup]  # None: the default (world) group
_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
# dist.ReduceOp.AVG exists only for NCCL; we divide explicitly instead.

def _rs_impl(*args: Any, **kwargs: Any) -> Any:  # looked up at each call (tests wrap torch.distributed's functions)
    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(*args, **kwargs)


def _ag_impl(*args: Any, **kwargs: Any) -> Any:
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(*args, **kwargs)


LEDGER = Ledger(lambda group: (group_name(group), get_world_size(group)))

_group_names: dict[Any, str] = {}


# ---------------------------------------------------------------------------------------------- groups
def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_world_size(group: Group = None) -> int:
    return dist.get_world_size(group) if is_initialized() else 1


def get_rank(group: Group = None) -> int:
    return dist.get_rank(group) if is_initialized() else 0


def backend(group: Group = None) -> str:
    """The process group's backend ("gloo", "nccl", ...); "" without a process group."""
    return str(dist.get_backend(group)) if is_initialized() else ""


class Works:
    """Several async works waited as one (an all-gather run as N broadcasts)."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self) -> bool:
        for w in self.works:
            w.wait()
        return True


def group_name(group: Group) -> str:
    if group is None or group is dist.GroupMember.WORLD:
        return "world"
    return _group_names.get(group, f"group{id(group) & 0xFFFF:x}")


def new_group(ranks: list[int], name: str, timeout: Optional[timedelta] = None) -> Group:
    """Create a process group (every rank must call this with the same arguments) and name it for the ledger."""
    group = dist.new_group(ranks=ranks, timeout=timeout)
    _group_names[group] = name
    return group


_duplicates: dict[tuple, Any] = {}


def duplicate_group(ranks: Optional[list[int]], name: str, timeout: Optional[timedelta] = None) -> Group:
    """A process group over ``ranks`` (None: every rank) besides the one that may already exist (collective over
    the world: every rank calls it for every such group, in the same order), cached so that repeated fits in one
    process reuse it. Collectives on it are ordered independently of those on the other group."""
    key = (tuple(range(get_world_size())) if ranks is None else tuple(ranks), name, timeout)
    if key not in _duplicates:
        _duplicates[key] = new_group(list(key[0]), name, timeout)
    return _duplicates[key]


def set_timeout(timeout: timedelta, group: Group = None) -> None:
    """The collective timeout of an existing group (the default one: created with the start-up timeout, which
    bounds the rendezvous). Uses torch's ``_set_pg_timeout``; where a torch lacks it, the start-up timeout stays."""
    setter = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if setter is None or not is_initialized():
        return
    try:
        setter(timeout, group)
    except (RuntimeError, ValueError, AssertionError) as err:  # a backend that cannot change it
        import warnings

        warnings.warn(f"could not set the collective timeout to {timeout} ({err}); collectives keep the "
                      "start-up timeout", stacklevel=2)


def wait(work: Any, what: str) -> None:
    """Wait for an async collective; a failure (timeout, peer gone, ranks that issued different collectives)
    is raised again naming what was waited for and this rank."""
    try:
        work.wait()
    except Exception as err:  # noqa: BLE001 - re-raised with context
        raise RuntimeError(f"rank {get_rank()}: {what} failed: {err}. Every rank must issue the same collectives "
                           "in the same order; a rank that died, stalled or ran different code stops the job here."
                           ) from err


def init_process_group(backend: str, rank: int, world_size: int, init_method: str,
                       timeout: timedelta) -> None:
    """Create the default group (used by tests and scripts that run without Lightning)."""
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout)
    install_exit_guard()


def init_process_group_in_launcher_store(backend: str, rank: int, world_size: int, host: str, port: int,
                                         attempt: int, timeout: timedelta, device_id: Any = None) -> None:
    """The default group of a torchrun job, rendezvous in torchrun's own store under a key prefix of this attempt.
    torch's ``env://`` rendezvous reuses the store's keys across ``--max-restarts`` restarts, so a restarted rank can
    read the address a dead rank of the previous attempt published and fail ("Gloo connectFullMesh failed ...
    Connection refused"); a prefix per attempt (``TORCHELASTIC_RESTART_COUNT``) keeps each attempt's keys apart."""
    store = dist.PrefixStore(f"lightning_shard/attempt_{attempt}",
                             dist.TCPStore(host, port, is_master=False, timeout=timeout))
    kwargs = {"device_id": device_id} if device_id is not None else {}
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout, **kwargs)


def agree_in_launcher_store(key: str, proposal: str, host: str, port: int, timeout: timedelta) -> str:
    """One value every process of a launch agrees on, before any process group exists: the first proposal set under
    ``key`` in the launcher's own key-value store at ``host:port`` wins and every caller gets it back. torchrun's
    agent hosts that store (``TORCHELASTIC_USE_AGENT_STORE``) and keeps it across the job's restarts, so the value
    stays the same for every rank, node and restart of one job. Not a collective: nothing goes into the ledger."""
    store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    return store.compare_set(key, "", proposal).decode()


# ---------------------------------------------------------------------------------------------- a clean exit
EXIT_GIL_RELEASE_S = 0.05
_exit_guard = {"installed": False}


def install_exit_guard() -> None:
    """Make the interpreter's exit safe from gloo's worker threads (once per process; every strategy calls it
    when it joins the process group).

    A gloo collective runs on a worker thread of its process group. When the caller has waited for it and dropped
    the work, the worker thread may still hold the last reference and destroy it a moment later; with torch 2.13
    that destruction takes the GIL (the work's tensors have Python objects). If the main thread reaches interpreter
    finalization first, Python ends the waiting thread with ``pthread_exit``, its unwinding meets a ``noexcept``
    destructor, and the process aborts (rc -6, "terminate called without an active exception") *after* the job
    finished: seen once in about 40 zero3/fsdp_shard benchmark runs (the core dump's thread was destroying an
    all-gather). The guard is an ``atexit`` handler (atexit runs before finalization,
    the interpreter fully alive) that releases the GIL for :data:`EXIT_GIL_RELEASE_S` seconds, so a worker waiting
    for it finishes. No collective and no join: a job that failed, with a peer gone or a collective stuck, exits as
    quickly as before (``destroy_process_group`` here could wait for a stuck collective until its timeout)."""
    if not _exit_guard["installed"]:
        atexit.register(_release_gil_at_exit)
        _exit_guard["installed"] = True


def exit_guard_installed() -> bool:
    return _exit_guard["installed"]


def _release_gil_at_exit() -> None:
    # also after destroy_process_group: a subgroup something still references keeps its worker threads
    time.sleep(EXIT_GIL_RELEASE_S)


def destroy_process_group() -> None:
    if is_initialized():
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------- collectives
def all_reduce(tensor: torch.Tensor, op: str = "sum", group: Group = None, async_op: bool = False, tag: str = ""):
    """In-place all-reduce of ``tensor`` (``op`` in sum/max/min)."""
    if op not in _REDUCE_OPS:
        raise ValueError(f"all_reduce op must be one of {sorted(_REDUCE_OPS)}, got {op!r}")
    LEDGER.record("all_reduce", group, tensor, tag)
    return dist.all_reduce(tensor, op=_REDUCE_OPS[op], group=group, async_op=async_op)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: Group = None, async_op: bool = False,
                   tag: str = ""):
    """Sum ``input`` (the full padded buffer) over ranks; this rank receives its contiguous slice in ``output``."""
    LEDGER.record("reduce_scatter", group, input, tag)
    return _rs_impl(output, input, group=group, async_op=async_op)


def all_to_all(output: torch.Tensor, input: torch.Tensor, group: Group = None, async_op: bool = False,
               tag: str = ""):
    """Rank j receives every rank's j-th 1/N of ``input``, in rank order, into ``output`` (same size)."""
    LEDGER.record("all_to_all", group, input, tag)
    return dist.all_to_all_single(output, input, group=group, async_op=async_op)


def exchange_pair(output: torch.Tensor, input: torch.Tensor, group: Group = None, async_op: bool = False,
                  tag: str = ""):
    """The all-to-all of :func:`all_to_all` on a group of **two** ranks, without this rank's own piece: ``input`` is
    the full buffer (2 x n elements); the other rank's half of it is sent, and the other rank's piece of this rank's
    half is received into ``output`` (n elements, which must not overlap ``input``). One ``all_to_all_single`` with
    split sizes (0 to and from this rank), so no full-size output is allocated and no piece is copied onto itself;
    the ledger records the all-to-all of ``input``, whose bytes it moves ((N-1)/N of the buffer)."""
    if get_world_size(group) != 2:
        raise ValueError(f"exchange_pair needs a group of 2 ranks, got {get_world_size(group)}")
    n = output.numel()
    if input.numel() != 2 * n:
        raise ValueError(f"exchange_pair: input has {input.numel()} elements, 2 x output's {n} expected")
    other = 1 - get_rank(group)
    LEDGER.record("all_to_all", group, input, tag)
    splits = [0, 0]
    splits[other] = n
    return dist.all_to_all_single(output, input[other * n:(other + 1) * n], splits, splits, group=group,
                                  async_op=async_op)


def all_gather(output: torch.Tensor, input: torch.Tensor, group: Group = None, async_op: bool = False, tag: str = ""):
    """Concatenate every rank's ``input`` slice into ``output`` (the full padded buffer); in-place safe."""
    LEDGER.record("all_gather", group, output, tag)
    return _ag_impl(output, input, group=group, async_op=async_op)


def all_gather_by_broadcasts(output: torch.Tensor, input: torch.Tensor, group: Group = None, async_op: bool = False,
                             tag: str = ""):
    """:func:`all_gather` as N broadcasts, one from each rank's slot of ``output``, all launched before any is waited
    (``input`` is copied into this rank's slot first unless it is that slot): comm/gather.py's
    ``BroadcastAllGather``. Recorded as the all-gather it is, ``via="broadcast"``; a group of one rank runs the
    plain all-gather."""
    world = get_world_size(group)
    if world == 1:
        return all_gather(output, input, group=group, async_op=async_op, tag=tag)
    if output.numel() != world * input.numel():
        raise ValueError(f"all_gather: output has {output.numel()} elements, {world} x input's {input.numel()} "
                         "expected")
    LEDGER.record("all_gather", group, output, tag, via="broadcast")
    slots = output.view(world, -1)
    mine = slots[get_rank(group)]
    if mine.data_ptr() != input.data_ptr():
        mine.copy_(input.view(-1))
    work = Works([dist.broadcast(slots[j], src=global_rank(group, j), group=group, async_op=True)
                  for j in range(world)])
    if async_op:
        return work
    work.wait()
    return None


def global_rank(group: Group, group_rank: int) -> int:
    """The global rank of ``group``'s member number ``group_rank``."""
    if group is None or group is dist.GroupMember.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def broadcast(tensor: torch.Tensor, src: int = 0, group: Group = None, async_op: bool = False, tag: str = ""):
    """Broadcast from the group's member number ``src`` (not a global rank)."""
    LEDGER.record("broadcast", group, tensor, tag)
    return dist.broadcast(tensor, src=global_rank(group, src), group=group, async_op=async_op)


def _pickled_bytes(obj: Any) -> int:
    try:
        return len(pickle.dumps(obj))
    except Exception:  # noqa: BLE001 - only for the ledger's byte count
        return 0


def broadcast_object(obj: Any, src: int = 0, group: Group = None, tag: str = "") -> Any:
    """Pickle-based broadcast of small metadata from the group's member ``src`` (not a global rank)."""
    if not is_initialized():
        return obj
    LEDGER.record_bytes("broadcast_object", group, _pickled_bytes(obj) if get_rank(group) == src else 0, tag)
    box = [obj]
    dist.broadcast_object_list(box, src=global_rank(group, src), group=group)
    return box[0]


def all_gather_object(obj: Any, group: Group = None, tag: str = "") -> list[Any]:
    """Pickle-based all-gather for small metadata."""
    if not is_initialized():
        return [obj]
    LEDGER.record_bytes("all_gather_object", group, _pickled_bytes(obj), tag)
    out: list[Any] = [None] * get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def all_gather_list(tensor: torch.Tensor, group: Group = None, tag: str = "") -> list[torch.Tensor]:
    """Every rank's ``tensor`` (same shape on every rank), as a list (Lightning's ``Strategy.all_gather``)."""
    out = [torch.empty_like(tensor) for _ in range(get_world_size(group))]
    LEDGER.record("all_gather", group, tensor, tag, full_numel=tensor.numel() * len(out))
    dist.all_gather(out, tensor, group=group)
    return out


def barrier(group: Group = None, tag: str = "") -> None:
    if is_initialized():
        LEDGER.record_bytes("barrier", group, 0, tag)
        dist.barrier(group=group)


def broadcast_coalesced(tensors: list[torch.Tensor], group: Group, tag: str) -> None:
    """Broadcast tensors from rank 0 in place, one collective per dtype/device."""
    by_key: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        by_key.setdefault((t.dtype, t.device), []).append(t)
    for ts in by_key.values():
        flat = torch.cat([t.detach().reshape(-1) for t in ts])
        broadcast(flat, src=0, group=group, tag=tag)
        with torch.no_grad():
            off = 0
            for t in ts:
                t.copy_(flat[off:off + t.numel()].view_as(t))
                off += t.numel()
