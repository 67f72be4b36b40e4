"""The mixed-precision policy ``param_dtype`` (like FSDP2's ``MixedPrecisionPolicy(param_dtype=...)``) for fp32 models.

The buckets hold each rank's owned elements as fp32 masters (the truth: the optimizer steps them) and everything
else in ``param_dtype``: the parameters the module computes with, the all-gathers after a step (stages 1/2) or
before use (stage 3), and the gradients autograd produces. Gradients are reduced in fp32 by default
(``reduce_dtype``), so only the parameter traffic and the full-parameter memory halve for bf16.

This module holds the three pieces outside the buckets: the checks at set-up, the input cast (a module whose
parameters are in ``param_dtype`` gets its floating inputs in ``param_dtype``, as FSDP2's ``cast_forward_inputs``),
and the end of training (the module gets the full fp32 masters back, so ``model.state_dict()`` after fit holds
what was trained, in the dtype the user built).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_map

from .buckets.plan import Owner

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
           "fp16": torch.float16, "float16": torch.float16}


def parse_dtype(value: Any) -> Optional[torch.dtype]:
    """A dtype option (``compression.reduce_dtype``), validated by the options: None, a torch dtype or a name."""
    return value if value is None or isinstance(value, torch.dtype) else _DTYPES[value]


def parse_param_dtype(value: Any) -> Optional[torch.dtype]:
    """``param_dtype``: None (compute in the parameters' own dtype) or the dtype fp32 parameters are computed and
    gathered in (``"bf16"``/``"fp16"``; ``"fp32"`` is the same as None)."""
    dtype = parse_dtype(value)
    return None if dtype is torch.float32 else dtype


def check_module(module: nn.Module, owner: dict[int, Owner], shards_params: bool, dtype: torch.dtype) -> None:
    """Refuse what the policy cannot do exactly: parameters that are not fp32, and (stages 0-2) floating
    parameters outside the buckets (frozen ones), whose fp32 values would otherwise be lost."""
    half = [(n, p.dtype) for n, p in module.named_parameters() if p.is_floating_point() and p.dtype != torch.float32]
    if half:
        raise ValueError(f"param_dtype={_name(dtype)} is a policy for fp32 parameters, but {half[0][0]} is "
                         f"{half[0][1]} ({len(half)} such parameter(s)): the model is already in low precision "
                         "(Trainer(precision='bf16-true'/'16-true')?). Use Trainer(precision='32-true') (or "
                         "'bf16-mixed') with param_dtype, or drop param_dtype.")
    if shards_params:
        return
    outside = [n for n, p in module.named_parameters()
               if p.is_floating_point() and not (p.requires_grad and id(p) in owner)]
    if outside:
        raise ValueError(f"param_dtype={_name(dtype)} with zero0/zero1/zero2 casts only the parameters the optimizer "
                         f"trains, but {outside[0]} ({len(outside)} floating parameter(s) in all) is frozen or held by "
                         "no optimizer: it would stay fp32 beside bf16 weights, or lose its fp32 values. Use zero3 or "
                         "fsdp_shard (frozen weights are sharded in fp32 and gathered in param_dtype), or drop "
                         "param_dtype.")


def _name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))


def cast_inputs(module: nn.Module, params: list[nn.Parameter], dtype: torch.dtype) -> list[Any]:
    """Forward pre-hooks on every module that holds one of ``params`` directly: floating tensor inputs (positional
    and keyword, nested in lists/tuples/dicts) are cast to ``dtype``. Returns the hook handles."""
    ids = {id(p) for p in params}

    def cast(t: Any) -> Any:
        if torch.is_tensor(t) and t.is_floating_point() and t.dtype != dtype:
            return t.to(dtype)
        return t

    def hook(_: nn.Module, args: tuple, kwargs: dict) -> tuple:
        return tree_map(cast, args), tree_map(cast, kwargs)

    return [m.register_forward_pre_hook(hook, with_kwargs=True) for m in module.modules()
            if any(id(p) in ids for p in m.parameters(recurse=False))]


def restore(module: nn.Module, buckets: list, full: dict[str, torch.Tensor]) -> None:
    """Give every parameter of ``buckets`` its full fp32 value (``full``: by name, from the masters)."""
    with torch.no_grad():
        for b in buckets:
            for p, name in zip(b.params, b.names):
                p.grad = None
                p.data = full[name]
