"""Bytes on the wire per optimizer step per rank, ring conventions.

Reduce-scatter / all-gather: (N-1)/N x full tensor; all-reduce: 2(N-1)/N x tensor; broadcast: bytes received.

* lightning_shard variants: ``LEDGER`` ring wire bytes (measured).
* ddp / zero_r: a DDP communication hook that counts each gradient bucket it all-reduces; zero_r broadcasts via a
  wrapped ``torch.distributed.broadcast`` (bytes this rank receives).
* fsdp2: **computed** from FSDP2's own units after lazy init: per unit padded flat size S (each parameter's dim 0
  padded to a multiple of N): all-gather in forward + all-gather in backward (units resharded after forward; the
  root is not) + reduce-scatter of the gradients, (N-1)/N x S each. As a cross-check, ``all_gather_single`` /
  ``reduce_scatter_single`` are wrapped to count what FSDP2 actually issued (reported next to it).
"""

from __future__ import annotations

import argparse
from typing import Any

from variants import OURS, STAGE3, program_of


class Counters:
    """Bytes counted outside the ledger (DDP comm hook, patched broadcast, patched FSDP2 collectives)."""

    def __init__(self, world: int, rank: int) -> None:
        self.world, self.rank = world, rank
        self.allreduce_bytes = 0
        self.allreduce_calls = 0
        self.bcast_bytes = 0  # all broadcast tensors (as root or receiver)
        self.bcast_recv_bytes = 0  # tensors this rank received
        self.bcast_calls = 0
        self.ag_bytes = 0  # all-gather output (full) bytes
        self.ag_calls = 0
        self.rs_bytes = 0  # reduce-scatter input (full) bytes
        self.rs_calls = 0

    def snapshot(self) -> dict[str, int]:
        return dict(vars(self))


def counting_allreduce_hook(state, bucket):  # no annotations: DDP checks that of `bucket`
    """DDP comm hook: average the bucket with one all-reduce (what DDP does by default), counting its bytes."""
    import torch.distributed as dist

    buf = bucket.buffer()
    state.allreduce_bytes += buf.numel() * buf.element_size()
    state.allreduce_calls += 1
    buf.div_(state.world)
    fut = dist.all_reduce(buf, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def patch_broadcast(counters: Counters) -> None:
    import torch.distributed as dist

    original = dist.broadcast

    def broadcast(tensor, src=None, group=None, async_op=False, **kwargs):
        nbytes = tensor.numel() * tensor.element_size()
        counters.bcast_calls += 1
        counters.bcast_bytes += nbytes
        if src is not None and dist.get_rank() != src:
            counters.bcast_recv_bytes += nbytes
        return original(tensor, src=src, group=group, async_op=async_op, **kwargs)

    dist.broadcast = broadcast


def patch_fsdp2_collectives(counters: Counters) -> None:
    """Count the all-gathers / reduce-scatters FSDP2 issues (it calls them as ``torch.distributed.<name>``)."""
    import torch.distributed as dist

    def nbytes(t: Any) -> int:
        return t.numel() * t.element_size()

    def wrap(name: str, kind: str, pick) -> None:
        original = getattr(dist, name, None)
        if original is None:
            return

        def counted(*a, **k):
            t = pick(a, k)
            setattr(counters, f"{kind}_bytes", getattr(counters, f"{kind}_bytes") + nbytes(t))
            setattr(counters, f"{kind}_calls", getattr(counters, f"{kind}_calls") + 1)
            return original(*a, **k)

        setattr(dist, name, counted)

    first = lambda a, k, key: a[0] if a else k[key]  # noqa: E731
    for name in ("all_gather_single", "all_gather_into_tensor"):
        wrap(name, "ag", lambda a, k: first(a, k, "output_tensor"))
    wrap("reduce_scatter_single", "rs", lambda a, k: a[1] if len(a) > 1 else k["input"])
    wrap("reduce_scatter_tensor", "rs", lambda a, k: a[1] if len(a) > 1 else k["input"])


def install_counters(variant: str, counters: Counters) -> None:
    """Wrap the collectives this variant issues outside the LEDGER (the DDP hook is registered at train start)."""
    if variant == "zero_r":
        patch_broadcast(counters)
    elif program_of(variant) == "fsdp2":
        patch_fsdp2_collectives(counters)


# ============================================================================================ FSDP2 units
def fsdp2_reshards_after_forward(unit: Any, is_root: bool) -> bool:
    """Whether FSDP2 frees this unit's full parameters after forward (so backward all-gathers them again).

    torch has no public getter for this: ``fully_shard(reshard_after_forward=...)`` is stored per parameter group
    as ``post_forward_mesh_info`` (None = keep the unsharded parameters until backward), and lazy init sets it to
    None on the root. This is the one place the benchmark reads FSDP2 private state
    (``FSDPModule._get_fsdp_state()._fsdp_param_groups[*].post_forward_mesh_info``); if those names move, it
    falls back to FSDP2's default (every unit but the root resharded).
    """
    try:
        groups = unit._get_fsdp_state()._fsdp_param_groups
        return any(g.post_forward_mesh_info is not None for g in groups)
    except AttributeError:
        return not is_root


def fsdp2_units(model: Any, world: int) -> list[dict[str, Any]]:
    """FSDP2's units after lazy init: padded flat bytes S and whether the unit is resharded after forward.

    A unit's parameters are those under its module that no nested ``FSDPModule`` holds; each is a DTensor sharded
    on dim 0, which FSDP2 pads to a multiple of ``world`` rows before it all-gathers / reduce-scatters it.
    """
    from torch.distributed.fsdp import FSDPModule

    fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]  # pre-order: [0] is the root
    claimed: set[int] = set()
    units = []
    for i, mod in reversed(list(enumerate(fsdp_modules))):  # innermost first, so a parent skips its children's
        own = [p for p in mod.parameters() if id(p) not in claimed]
        claimed.update(id(p) for p in own)
        padded = 0
        for p in own:
            rows = -(-p.shape[0] // world) * world
            padded += rows * (p.numel() // max(p.shape[0], 1)) * p.element_size()
        units.append({"module": type(mod).__name__, "params": len(own), "padded_bytes": padded,
                      "reshard_after_forward": fsdp2_reshards_after_forward(mod, is_root=i == 0)})
    return units[::-1]


# ============================================================================================ per step
def wire_per_step(args: argparse.Namespace, variant: str, trainer: Any, entries: list, c0: dict[str, int],
                  c1: dict[str, int], param_bytes: int) -> dict[str, Any]:
    """This rank's wire bytes per optimizer step over the timed window, how they were obtained, and a formula.

    ``entries``: the LEDGER entries of the window; ``c0`` / ``c1``: ``Counters.snapshot()`` at its ends.
    """
    world, n = trainer.world_size, args.steps
    ring = (world - 1) / world
    if variant in OURS:
        from lightning_shard.engine.comm.ledger import Ledger

        summary = {f"{op}/{grp}": v for (op, grp), v in Ledger.summarize(entries).items()}
        wire = sum(e.wire_bytes for e in entries) / n
        wire_source = "measured: lightning_shard LEDGER ring wire bytes"
        # zero0: all-reduce; zero1/2: reduce-scatter + all-gather (same total); stage 3: all-gather fwd + bwd + RS
        formula = (3 if variant in STAGE3 else 2) * ring * param_bytes
        mask = [e for e in entries if e.tag == "used_mask"]
        detail: dict[str, Any] = {"ledger": summary, "used_mask_calls_per_step": len(mask) / n,
                                  "used_mask_bytes_per_step": sum(e.bytes for e in mask) / n,
                                  "used_mask_wire_bytes_per_step": sum(e.wire_bytes for e in mask) / n}
    elif program_of(variant) == "fsdp2":
        units = fsdp2_units(trainer.lightning_module.model, world)
        wire = sum(ring * u["padded_bytes"] * (3 if u["reshard_after_forward"] else 2) for u in units)
        wire_source = ("computed, not measured: per FSDP2 unit padded flat S, all-gather fwd + all-gather bwd "
                       "(if resharded after forward) + reduce-scatter, (N-1)/N x S each")
        formula = 3 * ring * param_bytes
        ag = (c1["ag_bytes"] - c0["ag_bytes"]) / n
        rs = (c1["rs_bytes"] - c0["rs_bytes"]) / n
        detail = {"counted_wire_bytes_per_step": ring * (ag + rs),
                  "counted_all_gather_bytes_per_step": ag, "counted_reduce_scatter_bytes_per_step": rs,
                  "all_gather_calls_per_step": (c1["ag_calls"] - c0["ag_calls"]) / n,
                  "reduce_scatter_calls_per_step": (c1["rs_calls"] - c0["rs_calls"]) / n,
                  "units": units}
    else:
        ar = (c1["allreduce_bytes"] - c0["allreduce_bytes"]) / n
        bc_recv = (c1["bcast_recv_bytes"] - c0["bcast_recv_bytes"]) / n
        detail = {"allreduce_bytes_per_step": ar,
                  "allreduce_calls_per_step": (c1["allreduce_calls"] - c0["allreduce_calls"]) / n,
                  "broadcast_bytes_per_step": (c1["bcast_bytes"] - c0["bcast_bytes"]) / n,
                  "broadcast_recv_bytes_per_step": bc_recv,
                  "broadcast_calls_per_step": (c1["bcast_calls"] - c0["bcast_calls"]) / n}
        formula = 2 * ring * param_bytes + (ring * param_bytes if variant == "zero_r" else 0.0)
        if args.comm_hook:
            wire = 2 * ring * ar + bc_recv
            wire_source = "measured: DDP comm hook (all-reduce 2(N-1)/N x bucket bytes)" + \
                (" + received broadcast bytes" if variant == "zero_r" else "")
        else:
            wire = formula
            wire_source = "computed, not measured: 2(N-1)/N x grad bytes" + \
                (" + (N-1)/N x param bytes" if variant == "zero_r" else "")
    return {"wire_bytes_per_step": wire, "wire_source": wire_source, "wire_formula_bytes_per_step": formula,
            "wire_detail": detail}
