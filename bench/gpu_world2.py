"""Phase 2, several ranks on one device: what the backends allow, then the engine's multi-rank paths at world 2.

NCCL refuses two ranks on one GPU (each communicator rank needs a device of its own); gloo takes CUDA tensors for
some collectives (it stages them through host memory). So, on the one H200 (``--cpu``: CPU tensors):

1. NCCL with two ranks on cuda:0 is tried and what happens is recorded (gpu_probes.py ``nccl_same_device``).
2. Two processes (torch.multiprocessing, spawn), gloo, both on cuda:0, probe every ``torch.distributed`` call the engine
   makes (gpu_probes.py ``probes``): a call that runs and returns wrong values is a failed check, a refusal is recorded.
3. In the same process group, ``ShardEngine`` driven directly (as tests/engine/test_engine_dist.py does) for
   stages 0-3, per-micro-batch accumulation, FSDP-style units (default options), then zero2 and zero3 on every other
   ``reduce_scatter_via`` path the engine offers whose call the backend runs here: 4 optimizer steps x 2
   micro-batches of the small Transformer LM (gpu_models.py: tied head, odd vocabulary), SGD with momentum; rank 0's
   full weights against one process training on the global batch on the same device (bound 1e-5). A case that fails
   on a call the probes found refused is recorded as "cannot run on one device" with its error, not as a wrong
   result.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import traceback
from collections import Counter
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any

from gpu_common import Recorder, perturb, short
from gpu_models import ACC, SIZES, build_small_tf, cpu_state, lm_loss, make_sgd, max_abs_diff, tokens
from gpu_probes import WORLD, classify, free_port, nccl_same_device, probes, spawn

STEPS, BOUND = 4, 1e-5
# (case, engine arguments); "units": the stage-3 granularity
CASES = [("zero0", dict(stage=0)), ("zero1", dict(stage=1)), ("zero2", dict(stage=2)),
         ("zero2_per_micro_batch", dict(stage=2, accumulation="per_micro_batch")),
         ("zero3", dict(stage=3, units="zero3")), ("fsdp_shard", dict(stage=3, units="fsdp"))]
# each ``reduce_scatter_via`` path the engine offers besides its default (``engine/comm/collectives.py``), for zero2 and
# zero3, where the call it makes works on this backend and device (the first listed: the one the engine prefers)
PATH_PROBES = {"reduce_scatter": ("reduce_scatter_single", "reduce_scatter_tensor"),
               "all_to_all": ("all_to_all_single",), "all_reduce": ("all_reduce",)}


def path_cases(probed: list[dict[str, Any]]) -> tuple[list[tuple[str, dict[str, Any]]], dict[str, str]]:
    """The cases of the explicit reduce-scatter paths, and the paths left out with the reason."""
    from lightning_shard.engine.comm.reduce import REDUCE_SCATTER_VIA

    cases, skipped = [], {}
    for via in REDUCE_SCATTER_VIA:
        if via == "auto":
            continue
        usable = [p for p in probed if p["op"] in PATH_PROBES.get(via, ()) and p["ok"] is not None]
        if via in PATH_PROBES and not (usable and usable[0]["ok"] and usable[0]["correct"]):
            skipped[via] = f"{usable[0]['op']}: {usable[0].get('error', 'wrong values')}" if usable else "absent"
            continue
        cases += [(f"zero2_{via}", dict(stage=2, reduce_scatter_via=via)),
                  (f"zero3_{via}", dict(stage=3, units="zero3", reduce_scatter_via=via))]
    return cases, skipped


# ============================================================================================ in each rank
def train_case(kw: dict[str, Any], device: str, size: dict[str, Any], micro: int, data: Any) -> dict[str, Any]:
    from torch import nn

    from lightning_shard.engine.comm import collectives as C
    from lightning_shard.engine.comm.choices import CommChoices
    from lightning_shard.engine.engine import ShardEngine
    from lightning_shard.options import options_for

    rank = C.get_rank()
    model = build_small_tf(size).to(device)
    opt = make_sgd(model)
    kw = dict(kw)
    stage, units = kw.pop("stage"), kw.pop("units", None)
    name = {None: f"zero{stage}", "zero3": "zero3", "fsdp": "fsdp_shard"}[units]
    policy = kw.pop("accumulation", "keep_unsharded_grads" if stage == 3 else "defer")  # the engine's old default
    wrap = {"wrap_classes": [nn.TransformerEncoderLayer]} if units == "fsdp" else {}
    options = options_for(name, accumulation=policy, tuning={"bucket_mb": 0.05}, **wrap)  # small buckets: several
    mark = C.LEDGER.mark()
    via = kw.pop("reduce_scatter_via", "auto")  # a path case: how the engine runs its reduce-scatters
    engine = ShardEngine(model, [opt], options, comm=CommChoices(reduce_scatter=via))
    hooks = []
    if engine.controller is not None:  # stage 3: each forward is one pass of the schedule (as the Fabric adapter)
        ctl = engine.controller
        hooks = [model.register_forward_pre_hook(lambda m, a: ctl.step_pre_forward()),
                 model.register_forward_hook(lambda m, a, out: ctl.step_post_forward(out))]
    x, y = data[:, :-1], data[:, 1:]
    for s in range(STEPS):
        for k in range(ACC):
            j = (s * ACC + k) * WORLD * micro + rank * micro  # this rank's slice of global micro-batch (s, k)
            with engine.no_sync() if k < ACC - 1 else nullcontext():
                loss = lm_loss(model, x[j:j + micro].to(device), y[j:j + micro].to(device)) / ACC
                engine.pre_backward()
                loss.backward()
                engine.post_backward()
        engine.prepare_step(opt)
        opt.step()
        engine.finish_step(opt)
        opt.zero_grad()
    engine.wait_params()
    state = dict(model.state_dict())
    if engine.spec.shards_params:
        state.update(engine.gather_full())
    ops = Counter(e.op for e in C.LEDGER.since(mark))
    for h in hooks:
        h.remove()
    engine.remove_hooks()
    return {"state": cpu_state(state) if rank == 0 else None, "ops": dict(ops)}


def rank_main(rank: int, port: int, device: str, size: dict[str, Any], micro: int, cases: list, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD))
    import warnings

    import torch

    warnings.filterwarnings("ignore")

    torch.set_num_threads(1 if device == "cpu" else 4)
    if device == "cuda":
        torch.cuda.set_device(0)
    from lightning_shard.engine.comm import collectives as C

    # a collective gloo cannot finish on this device raises after this long instead of hanging the phase
    C.init_process_group("gloo", rank, WORLD, f"tcp://127.0.0.1:{port}", timedelta(seconds=60 if device == "cpu"
                                                                                      else 30))
    result: dict[str, Any] = {"probes": probes(device), "cases": {}}
    torch.save(result, Path(out) / f"rank{rank}.pt")
    more, result["skipped_paths"] = path_cases(result["probes"])
    if len({tuple(n for n, _ in more)} | set(C.all_gather_object(tuple(n for n, _ in more)))) == 1:
        cases = cases + more  # both ranks found the same paths usable
    data = tokens(STEPS * ACC * WORLD * micro, size["seq"], size["vocab"])
    for name, kw in cases:
        try:
            result["cases"][name] = train_case(kw, device, size, micro, data)
        except Exception as err:  # noqa: BLE001 - reported to the parent, which classifies it
            result["cases"][name] = {"error": short(err, 600), "traceback": traceback.format_exc()[-2000:]}
        torch.save(result, Path(out) / f"rank{rank}.pt")
        C.barrier()  # both ranks done with the case (a rank that failed alone would stop here, not desync later)
    C.destroy_process_group()


# ============================================================================================ the phase (parent)
def reference(device: str, size: dict[str, Any], micro: int) -> dict[str, Any]:
    """One process, same device, the global batch of every micro-batch: plain torch, no engine."""
    model = build_small_tf(size).to(device)
    opt = make_sgd(model)
    data = tokens(STEPS * ACC * WORLD * micro, size["seq"], size["vocab"])
    x, y, g = data[:, :-1], data[:, 1:], WORLD * micro
    for s in range(STEPS):
        for k in range(ACC):
            j = (s * ACC + k) * g
            (lm_loss(model, x[j:j + g].to(device), y[j:j + g].to(device)) / ACC).backward()
        opt.step()
        opt.zero_grad()
    return cpu_state(model.state_dict())


def run(rec: Recorder) -> None:
    import torch

    args = rec.args
    device = "cpu" if args.cpu else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("no CUDA device: run the GPU check on a GPU machine, or pass --cpu")
    size, micro = SIZES[device]["small_tf"], SIZES[device]["micro"]
    tmp = Path(tempfile.mkdtemp(prefix="gpu_check_world2_"))
    try:
        if device == "cuda":
            nccl_same_device(rec, tmp)
        rec.need(20, "the gloo ranks")
        port = free_port()
        finished = spawn(rank_main, [(r, port, device, size, micro, CASES, str(tmp)) for r in range(WORLD)],
                         rec.time_left() - 5)
        results = [torch.load(tmp / f"rank{r}.pt", weights_only=False) if (tmp / f"rank{r}.pt").exists() else None
                   for r in range(WORLD)]
        compare(rec, device, size, micro, results, finished)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def compare(rec: Recorder, device: str, size: dict[str, Any], micro: int, results: list, finished: bool) -> None:
    if results[0] is None:
        rec.error("world2/ranks", RuntimeError("rank 0 wrote no result" + ("" if finished else " (killed: hung or "
                                                                             "out of time)")), "two gloo ranks")
        return
    probes_ = results[0]["probes"]
    rec.put("probes", probes_)
    for via, why in (results[0].get("skipped_paths") or {}).items():
        rec.note(f"reduce_scatter_via='{via}' not run at world 2: its call is refused here ({why})")
    for p in probes_:
        if p["ok"]:  # a call that runs must give the right values
            rec.check(f"world2/probe/{p['op']}", 0.0 if p["correct"] else 1.0, 0.0, what="wrong values (1) or right "
                      "(0)", reference="the collective's definition (sums, rank order, source rank)")
    other = results[1] or {"cases": {}}
    cases: list[dict[str, Any]] = []
    rec.put("cases", cases)
    ref = reference(device, size, micro)
    for name, got in results[0]["cases"].items():
        row: dict[str, Any] = {"case": name, "ops": got.get("ops")}
        cases.append(row)
        err = got.get("error") or other["cases"].get(name, {}).get("error")
        if err:
            row["error"] = err
            if classify(err, probes_) == "cannot_run":
                row["result"] = "cannot run on one device (a collective the backend refuses)"
                rec.note(f"world2 {name}: cannot run with gloo on {device}: {err[:200]}")
                continue
            row["result"] = "error"
            rec.error(f"world2/{name}", RuntimeError(err), "ShardEngine at world 2")
            continue
        state = got["state"]
        hit = perturb(rec.args, f"world2/{name}", state)
        row["diff"], where = max_abs_diff(state, ref)
        row["result"] = "pass" if row["diff"] <= BOUND else "FAIL"
        rec.check(f"world2/{name}", row["diff"], BOUND, what="max |w_rank0 - w_one_process| after 4 steps x 2 "
                  "micro-batches", reference="one process on the same device training on the global batch (plain "
                  "torch, SGD momentum)", worst_weight=where, perturbed=hit)
    if not finished:
        rec.error("world2/ranks", RuntimeError("the ranks were killed before they finished (hang or out of time)"),
                  "two gloo ranks")
