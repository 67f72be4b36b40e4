"""Phase 2's probes: what two ranks on one device can do, asked of the backends directly (gpu_world2.py uses them).

* :func:`probes` (in each gloo rank): every ``torch.distributed`` call the engine makes through
  ``engine/comm/collectives.py``, made the way it makes it (async + wait) on tensors of the device, each checked for its
  values; a call the backend refuses is recorded with its error.
* :func:`nccl_same_device` (CUDA only): two processes try NCCL on cuda:0 (one all-reduce, a 30 s limit); what
  happens (refused / hung / worked) is recorded, nothing is asserted.
* :func:`classify`: whether a case's error is one of those refusals ("cannot run on one device") or a wrong result.
"""

from __future__ import annotations

import socket
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from gpu_common import Recorder, short

WORLD = 2

USED_BY = {
    "all_reduce": "C.all_reduce (stage 0, gloo's reduce-scatter path, clipping norm; uint8: the unused mask)",
    "all_gather_single": "C.all_gather (stage 1/2 post-step gather: in place; stage 3 unit gathers) where torch has it",
    "all_gather_into_tensor": "C.all_gather where all_gather_single is absent",
    "reduce_scatter_single": "C.reduce_scatter (reduce_scatter_via='reduce_scatter', NCCL default; stage 1: in place)",
    "reduce_scatter_tensor": "C.reduce_scatter where reduce_scatter_single is absent",
    "all_to_all_single": "C.all_to_all (reduce_scatter_via='all_to_all': the gradient reduce-scatter on gloo)",
    "all_gather": "C.all_gather_list (Lightning's Strategy.all_gather)",
    "broadcast": "C.broadcast / broadcast_coalesced (initial states, buffers)",
    "all_gather_object": "C.all_gather_object (set-up agreement, unit discovery)",
    "broadcast_object_list": "C.broadcast_object", "barrier": "C.barrier",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def probes(device: str) -> list[dict[str, Any]]:
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    f = dict(device=device, dtype=torch.float32)

    def all_reduce(op, dtype=torch.float32):
        t = torch.full((5,), rank + 1, device=device, dtype=dtype)
        dist.all_reduce(t, op=op, async_op=True).wait()
        return bool((t == (sum(range(1, world + 1)) if op == dist.ReduceOp.SUM else world)).all())

    def gather(fn, in_place):  # in place: the input is this rank's range of the output (stage 1/2 post-step gather)
        out = torch.full((3 * world,), -1.0, **f)
        mine = out[3 * rank:3 * rank + 3] if in_place else torch.empty(3, **f)
        mine.fill_(float(rank))
        getattr(dist, fn)(out, mine, async_op=True).wait()
        return torch.equal(out.cpu(), torch.arange(world).float().repeat_interleave(3))

    def scatter(fn, in_place):  # in place: the output is this rank's range of the input (stage 1 keeps its buffer)
        inp = torch.arange(2 * world, **f) * (rank + 1)
        out = inp[2 * rank:2 * rank + 2] if in_place else torch.empty(2, **f)
        getattr(dist, fn)(out, inp, async_op=True).wait()
        return torch.equal(out.cpu(), torch.arange(2 * world).float()[2 * rank:2 * rank + 2] * sum(range(1, world + 1)))

    def all_to_all():  # rank j receives every rank's j-th piece, in rank order
        inp = torch.arange(2 * world, **f) + 10 * rank
        out = torch.empty(2 * world, **f)
        dist.all_to_all_single(out, inp, async_op=True).wait()
        want = torch.cat([torch.arange(2 * world).float()[2 * rank:2 * rank + 2] + 10 * i for i in range(world)])
        return torch.equal(out.cpu(), want)

    def gather_list():
        out = [torch.empty(3, **f) for _ in range(world)]
        dist.all_gather(out, torch.full((3,), float(rank), **f))
        return all(bool((t == i).all()) for i, t in enumerate(out))

    def broadcast():
        t = torch.full((4,), rank + 5.0, **f)
        dist.broadcast(t, src=0, async_op=True).wait()
        return bool((t == 5.0).all())

    def objects():
        out: list[Any] = [None] * world
        dist.all_gather_object(out, {"rank": rank})
        return out == [{"rank": r} for r in range(world)]

    def broadcast_objects():
        box = [{"from": rank}]
        dist.broadcast_object_list(box, src=0)
        return box == [{"from": 0}]

    calls = [("all_reduce", lambda: all_reduce(dist.ReduceOp.SUM)),
             ("all_reduce(max)", lambda: all_reduce(dist.ReduceOp.MAX)),
             ("all_reduce(max, uint8)", lambda: all_reduce(dist.ReduceOp.MAX, torch.uint8))]  # the unused-mask
    for fn in ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor"):
        for in_place in (False, True):
            probe = gather if fn.startswith("all_gather") else scatter
            calls.append((fn + "(in place)" * in_place,
                          (lambda fn=fn, i=in_place, p=probe: p(fn, i)) if hasattr(dist, fn) else None))
    calls.append(("all_to_all_single", all_to_all if hasattr(dist, "all_to_all_single") else None))
    calls += [("all_gather", gather_list), ("broadcast", broadcast), ("all_gather_object", objects),
              ("broadcast_object_list", broadcast_objects),
              ("barrier", lambda: dist.barrier() or True)]
    out = []
    for name, fn in calls:
        row: dict[str, Any] = {"op": name, "used_by": USED_BY.get(name.split("(")[0], "")}
        if fn is None:
            row.update(ok=None, correct=None, error=f"absent in torch {torch.__version__}")
        else:
            try:
                row.update(ok=True, correct=bool(fn()))
            except Exception as err:  # noqa: BLE001 - the backend refused: recorded
                row.update(ok=False, correct=None, error=short(err, 200))
        out.append(row)
    return out


def nccl_rank(rank: int, port: int, out: str) -> None:
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    torch.cuda.set_device(0)
    try:
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                                timeout=timedelta(seconds=20))
        t = torch.ones(4, device="cuda:0")
        dist.all_reduce(t)
        torch.cuda.synchronize()
        text = f"worked: all_reduce gave {t[0].item()}"
    except Exception as err:  # noqa: BLE001 - what NCCL says is the finding
        text = f"refused: {short(err, 400)}"
    Path(out, f"nccl{rank}.txt").write_text(text)


def spawn(target: Any, argss: list[tuple], timeout: float, done: Any = None) -> bool:
    """Start the ranks (spawn: CUDA cannot be forked) and wait until they exit or ``done()`` holds; the ones still
    alive then are killed. False when the ranks were killed at ``timeout`` before ``done()``."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=a, daemon=True) for a in argss]
    for p in procs:
        p.start()
    end = time.time() + timeout
    finished = False
    while time.time() < end:
        if all(not p.is_alive() for p in procs) or (done is not None and done()):
            finished = True
            break
        time.sleep(0.2)
    for p in procs:
        p.join(2 if finished else 0)
        if p.is_alive():
            p.kill()
            p.join()
    return finished


def nccl_same_device(rec: Recorder, tmp: Path) -> None:
    rec.need(40, "the NCCL same-device probe")
    port, files = free_port(), [tmp / f"nccl{r}.txt" for r in range(WORLD)]
    finished = spawn(nccl_rank, [(r, port, str(tmp)) for r in range(WORLD)], 30,
                     done=lambda: all(f.exists() for f in files))
    texts = [f.read_text() for f in files if f.exists()]
    if texts and all(t.startswith("worked") for t in texts):
        outcome = "worked"
    elif any(t.startswith("refused") for t in texts):
        outcome = "refused"
    else:
        outcome = "hung (killed after 30 s)" if not finished else "no answer"
    rec.put("nccl_same_device", {"outcome": outcome, "detail": " | ".join(sorted(set(texts)))})
    rec.note(f"NCCL with two ranks on cuda:0: {outcome}")


def classify(err: str, probes_: list[dict[str, Any]]) -> str:
    """``"cannot_run"`` when the error is one of the backend's refusals the probes found, else ``"wrong"``."""
    refused = [p for p in probes_ if p["ok"] is False]
    if refused and any(p["error"].split(":", 1)[-1].strip()[:50] in err for p in refused):
        return "cannot_run"
    low = err.lower()
    if refused and any(w in low for w in ("not supported", "unsupported", "does not support")):
        return "cannot_run"
    return "wrong"


