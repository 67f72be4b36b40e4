"""A trained ``hf_causal_lm`` recipe -> a Hugging Face folder (``lightning-shard consolidate CKPT OUT --hf``).

:func:`save_hf` takes the full weights of the LightningModule (``HFCausalLM``: keys ``model.<...>``, as the
consolidation reads them out of a sharded checkpoint) and its hyperparameters (the checkpoint's
``hyper_parameters``), rebuilds the module, loads the weights and writes:

* ``adapter=False`` (default): ``save_pretrained`` of the Hugging Face model, LoRA adapters merged into the base
  weights (peft's ``merge_and_unload``), safetensors and ``config.json``: ``AutoModelForCausalLM.from_pretrained(OUT)``
  gives the trained model;
* ``adapter=True``: peft's adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``) for
  ``PeftModel.from_pretrained(base, OUT)``; when the run started from a random-init config (no ``name_or_path``
  to load the base from), the base weights go to ``OUT/base`` and ``adapter_config.json`` points there.

The tokenizer of ``name_or_path`` is saved beside the weights when there is one.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import torch


def save_hf(state: dict[str, torch.Tensor], hparams: dict[str, Any], out: str | Path, adapter: bool = False) -> Path:
    from lightning_shard.recipes.hf_causal_lm import HFCausalLM

    out = Path(out)
    accepted = set(inspect.signature(HFCausalLM.__init__).parameters) - {"self"}
    if not hparams or not (hparams.get("name_or_path") or hparams.get("config")):
        raise ValueError("--hf needs a checkpoint of the hf_causal_lm recipe (its hyper_parameters name the model: "
                         f"name_or_path or config); this one has {sorted(hparams or {})}")
    module = HFCausalLM(**{k: v for k, v in hparams.items() if k in accepted})
    missing, unexpected = module.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith("val_loss_mean")]
    if missing or unexpected:
        raise ValueError(f"the checkpoint does not match the recipe's model: missing {missing[:5]}, unexpected "
                         f"{unexpected[:5]}")
    model = module.model
    lora = bool(module.lora_modules)
    if adapter and not lora:
        raise ValueError("--hf-adapter: this run trained no LoRA adapters (recipe.model.lora is null); use --hf")
    out.mkdir(parents=True, exist_ok=True)
    if adapter:
        model.save_pretrained(out)  # peft: the adapters only
        if not hparams.get("name_or_path"):
            base = model.unload()  # the base without adapter layers, unmerged
            base.save_pretrained(out / "base")
            cfg_path = out / "adapter_config.json"
            cfg = json.loads(cfg_path.read_text())
            cfg["base_model_name_or_path"] = str((out / "base").resolve())
            cfg_path.write_text(json.dumps(cfg, indent=2))
    else:
        (model.merge_and_unload() if lora else model).save_pretrained(out)
    if hparams.get("name_or_path"):
        try:
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(hparams["name_or_path"]).save_pretrained(out)
        except (OSError, ValueError):  # a model without a tokenizer of its own
            pass
    return out


__all__ = ["save_hf"]
