"""How a parameter all-gather runs: the backend's all-gather, or N broadcasts. Chosen per bucket (by backend and the
bucket's size) from ``CommChoices.all_gather`` (comm/choices.py) by :func:`all_gather_form`, and called by the
buckets' gathers (buckets/gather.py): stage 3's unit gathers and the post-step all-gather of stages 1/2."""

from __future__ import annotations

from typing import Any, Optional

import torch

from . import collectives as C

ALL_GATHER_VIA = ("auto", "all_gather", "broadcast")
BROADCAST_MIN_BYTES = 2**20  # ``"auto"`` on gloo: smaller all-gathers stay the backend's own


class AllGatherForm:
    """Concatenate every rank's ``input`` slice into ``output`` (the full padded buffer), on ``group``."""

    name = ""

    def __call__(self, output: torch.Tensor, input: torch.Tensor, group: C.Group, async_op: bool, tag: str) -> Any:
        raise NotImplementedError


class BackendAllGather(AllGatherForm):
    name = "all_gather"

    def __call__(self, output: torch.Tensor, input: torch.Tensor, group: C.Group, async_op: bool, tag: str) -> Any:
        return C.all_gather(output, input, group=group, async_op=async_op, tag=tag)


class BroadcastAllGather(AllGatherForm):
    """N broadcasts on the group, rank j's from its own slot of the output, all launched before any is waited
    (:func:`collectives.all_gather_by_broadcasts`): in place, the all-gather's bytes."""

    name = "broadcast"

    def __call__(self, output: torch.Tensor, input: torch.Tensor, group: C.Group, async_op: bool, tag: str) -> Any:
        return C.all_gather_by_broadcasts(output, input, group=group, async_op=async_op, tag=tag)


BACKEND_ALL_GATHER, BROADCAST_ALL_GATHER = BackendAllGather(), BroadcastAllGather()


def all_gather_form(choice: str, group: C.Group = None, nbytes: Optional[int] = None) -> AllGatherForm:
    """How a parameter all-gather of ``nbytes`` (the gathered output; None: any size) on ``group`` runs:

    * ``"all_gather"``: the backend's all-gather;
    * ``"broadcast"``: N broadcasts on the group, rank j's from its own slot of the output, all launched before any
      is waited: every rank sends its slot to the N-1 others and receives theirs, the all-gather's (N-1)/N of the
      output per rank, in place (no buffer). ``"auto"`` on gloo for an output of :data:`BROADCAST_MIN_BYTES` (1 MiB)
      or more: 1.4-4.2x faster than gloo's all-gather at 4-88 MiB on 2 ranks in two runs, 1.05-3.3x at 25-88 MiB on
      4, with 24-81% of its CPU time at 25-88 MiB; at 1 MiB and below, and at 1-4 MiB on 4 ranks, the runs disagree
      (0.45-4.1x) (the collectives benchmark, two runs). ``"all_gather"`` on every other backend (NCCL) and below
      the size.

    The ledger records an all-gather either way (its bytes and wire bytes), marked ``via="broadcast"``: its
    :attr:`LedgerEntry.calls` are the N broadcasts that run."""
    if choice == "auto":  # (a choice CommChoices validated)
        large = nbytes is None or nbytes >= BROADCAST_MIN_BYTES
        choice = "broadcast" if C.backend(group) == "gloo" and large else "all_gather"
    return BROADCAST_ALL_GATHER if choice == "broadcast" else BACKEND_ALL_GATHER
