"""Batch arithmetic: accumulation steps are derived from the global and micro batch sizes
(docs/architecture.md, "Design rules" 7).

``global_batch_size = micro_batch_size * world_size * accumulate_grad_batches``; users give the first
two (in the recipe) and the launch shape gives ``world_size``; the accumulation count is never typed.
"""

from __future__ import annotations


def derive_accumulation(global_batch_size: int, micro_batch_size: int, world_size: int) -> int:
    """Return ``global_batch_size / (micro_batch_size * world_size)``, refusing anything but a positive integer.

    Errors name the config keys (``recipe.global_batch_size``, ``recipe.micro_batch_size``,
    ``trainer.devices * trainer.num_nodes``), show the arithmetic and suggest values that work.
    """
    for key, value in (("recipe.global_batch_size", global_batch_size),
                       ("recipe.micro_batch_size", micro_batch_size),
                       ("world_size (trainer.devices * trainer.num_nodes)", world_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{key} must be a positive integer, got {value!r}")
    per_pass = micro_batch_size * world_size
    if per_pass > global_batch_size:
        raise ValueError(
            f"recipe.micro_batch_size * world_size = {micro_batch_size} * {world_size} = {per_pass} samples per "
            f"forward pass exceeds recipe.global_batch_size = {global_batch_size}. "
            f"Fix: raise recipe.global_batch_size to {per_pass} (or a multiple of it), or lower "
            f"recipe.micro_batch_size to at most {max(1, global_batch_size // world_size)}"
            + ("" if global_batch_size >= world_size else
               f" and use at most {global_batch_size} ranks"))
    if global_batch_size % per_pass != 0:
        lower = (global_batch_size // per_pass) * per_pass
        upper = lower + per_pass
        divisors = [m for m in range(1, micro_batch_size + 1)
                    if global_batch_size % (m * world_size) == 0]
        hint = (f" or set recipe.micro_batch_size to one of {divisors}" if divisors else "")
        raise ValueError(
            f"recipe.global_batch_size = {global_batch_size} is not divisible by recipe.micro_batch_size * "
            f"world_size = {micro_batch_size} * {world_size} = {per_pass} "
            f"({global_batch_size} / {per_pass} = {global_batch_size / per_pass:.3g}), so "
            f"accumulate_grad_batches would not be an integer. Fix: set recipe.global_batch_size to "
            f"{lower} or {upper}{hint}")
    return global_batch_size // per_pass
