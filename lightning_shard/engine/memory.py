"""The engine's memory report: bytes of model state a rank holds, measured from the tensors themselves."""

from __future__ import annotations

from torch import nn

from .buckets.bucket import Bucket
from .buckets.optim import OptimizerBinding, optimizer_state_bytes


def memory_report(module: nn.Module, buckets: list[Bucket], bindings: list[OptimizerBinding],
                  offload_optimizer: bool, reduce_scatters: bool) -> dict[str, int]:
    """Bytes of parameters, gathered parameters, gradients, fp32 masters, accumulators, optimizer state,
    quantization residuals (``error_feedback``) and hpZ island copies (``secondary_params``); ``on_host``: the part
    of the total in host memory (offload); ``padding_elements``: the layouts' padding."""
    rep = {"params": 0, "gathered_params": 0, "grads": 0, "master": 0, "accumulators": 0, "optimizer_state": 0,
           "error_feedback": 0, "secondary_params": 0, "on_host": 0}
    # error_feedback: ``reduce_quant``'s residuals; secondary_params: ``secondary_shard``'s island copies
    bucketed = set()
    for b in buckets:
        for k, v in b.tensor_bytes().items():
            rep[k] += v
        bucketed.update(id(p) for p in b.params)
    for p in module.parameters():
        if id(p) not in bucketed:
            rep["params"] += p.numel() * p.element_size()
            if p.grad is not None:
                rep["grads"] += p.grad.numel() * p.grad.element_size()
    rep["optimizer_state"] = sum(optimizer_state_bytes(b.optimizer) for b in bindings)
    if offload_optimizer:  # the optimizer state was created beside the host masters
        rep["on_host"] += rep["optimizer_state"]
    rep["padding_elements"] = sum(b.layout.padding for b in buckets) if reduce_scatters else 0
    # ``on_host``: how much of the total lives in host memory (offload); a part of the total, not added to it
    rep["total"] = sum(v for k, v in rep.items() if k not in ("padding_elements", "on_host"))
    return rep
