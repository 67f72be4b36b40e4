"""Recipes: LightningModules and DataModules that the strategies train.

Recipes depend on Lightning and torch only; they never import ``lightning_shard.engine``
(docs/architecture.md, "Design rules" 1).
"""

from lightning_shard.recipes.corpus import StdlibTextDataModule, WindowDataset, load_stdlib_corpus
from lightning_shard.recipes.gpt import GPT, GPTLightningModule

__all__ = ["GPT", "GPTLightningModule", "StdlibTextDataModule", "WindowDataset", "load_stdlib_corpus"]
