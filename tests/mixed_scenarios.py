"""Scenarios for the mixed-precision policy ``param_dtype`` (tests/strategies/test_param_dtype.py).

The references are written without the engine:

* :func:`emulated_reference` does in one process, with plain torch, exactly what the policy promises: fp32 master
  weights stepped by the optimizer; each rank's micro-batches run forward and backward on a bf16 copy of the
  masters (``model.to(bf16)``); each rank's bf16 gradient (accumulated in bf16 over the rank's micro-batches, as
  autograd does into one buffer, or cast to fp32 per micro-batch for ``per_micro_batch``) is cast to fp32, summed
  over ranks and divided by the world size. Distributed runs must match it to fp32 rounding.
* the bf16-autocast run (Lightning ``precision="bf16-mixed"``, one process) and the fp32 run are the yardsticks a
  user compares with: the policy trains close to them, within a stated tolerance.
"""

from __future__ import annotations

import copy
from typing import Any, Optional

import lightning as L
import torch
from torch.utils.data import DataLoader

from tests.foreign import ForeignModule, dataset, fit_foreign
from tests.zoo import MICRO, RankMicroBatches


def emulated_reference(name: str, steps: int, acc: int, world: int, policy: str, optimizer: str = "adam",
                       dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` (fp32) after ``steps`` optimizer steps of the policy, in one process, on one thread
    as the ranks run (a bf16 matmul's rounding depends on how the kernel splits the work across threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _emulate(name, steps, acc, world, policy, optimizer, dtype)
    finally:
        torch.set_num_threads(threads)


def _emulate(name: str, steps: int, acc: int, world: int, policy: str, optimizer: str,
             dtype: torch.dtype) -> dict[str, torch.Tensor]:
    module = ForeignModule(name, optimizer)
    opt = module.configure_optimizers()
    master = module.net
    data = dataset(name, steps, acc, world)
    samplers = [list(RankMicroBatches(len(data), acc, world, r)) for r in range(world)]
    trained = [(n, p) for n, p in master.named_parameters() if p.requires_grad]
    for step in range(steps):
        total = {n: torch.zeros_like(p) for n, p in trained}
        for r in range(world):
            compute = copy.deepcopy(master).to(dtype)
            cparams = dict(compute.named_parameters())
            for k in range(acc):
                idx = samplers[r][step * acc + k]
                x, y = data[idx]
                loss = module._loss_fn(compute, x, y) / acc  # Lightning normalizes by accumulate_grad_batches
                loss.backward()
                if policy == "per_micro_batch":  # reduce-scattered in fp32 every micro-batch
                    for n, _ in trained:
                        g = cparams[n].grad
                        if g is not None:
                            total[n] += g.float()
                    compute.zero_grad(set_to_none=True)
            if policy != "per_micro_batch":  # held in bf16 over the window, reduced at the boundary
                for n, _ in trained:
                    g = cparams[n].grad
                    if g is not None:
                        total[n] += g.float()
        for n, p in trained:
            p.grad = total[n] / world
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def plain_reference(name: str, steps: int, acc: int, world: int, precision: str,
                    optimizer: str = "adam") -> dict[str, torch.Tensor]:
    """One process, plain Lightning, ``precision`` (``"32-true"`` or ``"bf16-mixed"``): ``model.state_dict()``."""
    module = ForeignModule(name, optimizer)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, accumulate_grad_batches=acc * world,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, precision=precision)
    trainer.fit(module, DataLoader(dataset(name, steps, acc, world), batch_size=MICRO, shuffle=False))
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def fit_policy(name: str, strategy: str, steps: int, acc: int, param_dtype: Optional[str],
               optimizer: str = "adam", **knobs: Any) -> dict[str, Any]:
    """Inside a World rank: the strategy with ``param_dtype`` (and ``knobs``); rank 0's ``model.state_dict()``
    after fit, the dtypes seen, and this rank's parameter all-gather bytes from the ledger."""
    from lightning_shard.engine.comm import collectives as C

    mark = C.LEDGER.mark()
    kwargs = dict(knobs)
    if param_dtype is not None:
        kwargs["param_dtype"] = param_dtype
    res = fit_foreign(name, strategy, steps, acc, optimizer=optimizer, strategy_kwargs=kwargs)
    entries = C.LEDGER.since(mark)
    gathers = [e for e in entries if e.op == "all_gather" and e.tag.startswith(("param_bucket", "unshard_bucket"))]
    reduces = [e for e in entries if e.tag.startswith("grad_bucket")]
    res["gather_bytes"] = sum(e.bytes for e in gathers)
    res["gather_dtypes"] = sorted({e.dtype for e in gathers})
    res["reduce_dtypes"] = sorted({e.dtype for e in reduces})
    res["state_dtypes"] = sorted({str(v.dtype) for v in res["state"].values()}) if res["state"] else None
    return res


def setup_error(name: str, strategy: str, param_dtype: str, precision: str = "32-true") -> str:
    """Inside a World rank: fit one step and return the error message the set-up raised ('' if none)."""
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_shard.engine.comm import collectives as C

    world, rank = C.get_world_size(), C.get_rank()
    module = ForeignModule(name, "adam")
    entry = StrategyRegistry[strategy]
    trainer = L.Trainer(accelerator="cpu", devices=world, max_steps=1, logger=False, precision=precision,
                        strategy=entry["strategy"](**dict(entry["init_params"], param_dtype=param_dtype)),
                        use_distributed_sampler=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    data = dataset(name, 1, 1, world)
    try:
        trainer.fit(module, DataLoader(data, batch_sampler=RankMicroBatches(len(data), 1, world, rank)))
    except ValueError as e:
        return str(e)
    return ""


def offload_layout(stage: int, offload: bool, offload_params: bool = False) -> dict[str, Any]:
    """Inside a World rank: an engine over a small MLP, one AdamW step; where the optimizer's tensors live."""
    from torch import nn

    from lightning_shard.engine.comm import collectives as C
    from lightning_shard.engine.engine import ShardEngine

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    from lightning_shard.options import options_for

    stage3 = {"offload_params": offload_params} if stage == 3 else {}
    engine = ShardEngine(model, [opt], options_for(f"zero{stage}", accumulation="keep_unsharded_grads" if stage == 3
                                                   else "defer", offload_optimizer=offload, **stage3))
    gathered_from: list[int] = []
    real = C.all_gather

    def spy(out: Any, src: Any, *a: Any, **k: Any) -> Any:
        gathered_from.append(src.data_ptr())
        return real(out, src, *a, **k)

    C.all_gather = spy
    engine.pre_backward()
    model(torch.randn(3, 8)).square().mean().backward()
    engine.post_backward()
    engine.prepare_step(opt)
    opt.step()
    engine.finish_step(opt)
    engine.wait_params()
    C.all_gather = real
    b = engine.buckets[0]
    shard = b.store.shard
    held = shard if b.spec.shards_params else b.store.flat_param
    state = [t for st in opt.state.values() for t in st.values() if torch.is_tensor(t) and t.dim() >= 1]
    out = {"separate": b.shard_param.untyped_storage().data_ptr() != held.untyped_storage().data_ptr(),
           "state_numel": sum(t.numel() for t in state), "owned": sum(x.owned_numel for x in engine.buckets),
           "report": engine.memory_report(), "pinned": [bool(t.is_pinned()) for t in state] if offload else [],
           "state_devices": sorted({t.device.type for t in state}),
           "staged": bool(gathered_from) and shard is not None and shard.data_ptr() not in gathered_from}
    engine.remove_hooks()
    return out
