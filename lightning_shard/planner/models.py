"""Models for the planner: recipe names and shape arguments, built as
``lightning_shard.recipes.gpt.GPT`` on the meta device.

``gpt_tiny`` is the shipped recipe (``conf/recipe/gpt_tiny.yaml``); ``gpt_1b`` and ``gpt_7b`` are planning
sizes with the shapes of GPT-3 XL-like 1.3B (24 layers, 2048 wide, Brown et al. 2020 table 2.1) and
LLaMA-7B-like (32 x 4096, 32 heads, 4096 context; Touvron et al. 2023 table 2), built from the same GPT
class (learned positions, tied head, 4x GELU MLP), so their parameter counts are this class's: ~1.3B, ~6.6B.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import yaml

from lightning_shard.shipped import CONF_DIR

if TYPE_CHECKING:
    from torch import nn

RECIPE_DIR = CONF_DIR / "recipe"
SIZES = {  # name: (n_layer, n_embd, n_head, block_size, vocab_size)
    "gpt_1b": (24, 2048, 16, 2048, 50304),
    "gpt_7b": (32, 4096, 32, 4096, 32000),
}
# shapes to pick when only a parameter count is given (GPT-3 table 2.1 / LLaMA table 2 families)
_BY_PARAMS = [(125e6, 12, 768), (350e6, 24, 1024), (1.3e9, 24, 2048), (2.7e9, 32, 2560), (6.7e9, 32, 4096),
              (13e9, 40, 5120), (30e9, 60, 6656), (70e9, 80, 8192)]


def build_gpt(n_layer: int, n_embd: int, n_head: int, block_size: int, vocab_size: int) -> nn.Module:
    import torch

    from lightning_shard.recipes.gpt import (
        GPT,  # recipes never import core; the planner may import lightning_shard.recipes
    )

    with torch.device("meta"):
        return GPT(vocab_size=vocab_size, block_size=block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd)


def recipe_names() -> list[str]:
    return sorted(set(SIZES) | {p.stem for p in RECIPE_DIR.glob("*.yaml")})


def from_recipe(name: str) -> nn.Module:
    if name in SIZES:
        return build_gpt(*SIZES[name])
    path = RECIPE_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"unknown recipe {name!r}; known: {', '.join(recipe_names())} (or give shape arguments: "
                         "--params 7e9, or --layers 32 --hidden 4096 --seq 4096)")
    m = yaml.safe_load(path.read_text())["model"]
    seq = (m["block_size"] if isinstance(m["block_size"], int) else
           yaml.safe_load(path.read_text())["data"]["block_size"])
    return build_gpt(m["n_layer"], m["n_embd"], m["n_head"], seq, m["vocab_size"])


# what a planning size or a bare shape is planned with unless told otherwise (``lightning-shard plan``)
UNSHIPPED_JOB = {"global_batch": 64, "micro_batch": 1, "precision": "bf16-true"}


def recipe_job(name: Optional[str]) -> tuple[dict, str]:
    """The batch and precision ``name`` trains with: a shipped Hydra recipe's ``global_batch_size`` and
    ``micro_batch_size`` and the trainer's default precision (``conf/trainer/default.yaml``), with where they come
    from; a planning size or a shape (``name`` None): :data:`UNSHIPPED_JOB`."""
    path = RECIPE_DIR / f"{name}.yaml"
    if name is None or name in SIZES or not path.is_file():
        return dict(UNSHIPPED_JOB), "the planner's default for a model without a recipe"
    recipe = yaml.safe_load(path.read_text())
    trainer = yaml.safe_load((CONF_DIR / "trainer" / "default.yaml").read_text())
    return ({"global_batch": int(recipe["global_batch_size"]), "micro_batch": int(recipe["micro_batch_size"]),
             "precision": str(trainer["precision"])}, f"recipe {name} as it trains (recipe/{name}.yaml, "
            "trainer/default.yaml)")


def from_shape(params: Optional[float] = None, layers: Optional[int] = None, hidden: Optional[int] = None,
               heads: Optional[int] = None, seq: int = 2048, vocab: int = 32000) -> nn.Module:
    """A GPT from shape arguments; with only ``params``, the nearest standard shape (the count is the model's)."""
    if layers is None or hidden is None:
        if params is None:
            raise ValueError("give --params N, or both --layers and --hidden (with --seq, --vocab, --heads)")
        _, layers_, hidden_ = min(_BY_PARAMS, key=lambda r: abs(r[0] - params) / r[0])
        layers, hidden = layers or layers_, hidden or hidden_
    heads = heads or max(1, hidden // 128)
    if hidden % heads:
        raise ValueError(f"--hidden {hidden} is not divisible by --heads {heads}")
    return build_gpt(layers, hidden, heads, seq, vocab)
