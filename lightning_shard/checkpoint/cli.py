"""`lightning-shard consolidate CKPT OUT`: a sharded checkpoint directory -> one plain file.

    lightning-shard consolidate run/epoch=3-step=400.ckpt model.pt                 # bare model weights
    lightning-shard consolidate CKPT model.pt --strip-prefix model.                # keys of the inner nn.Module
    lightning-shard consolidate CKPT model.safetensors --safetensors               # needs `safetensors`
    lightning-shard consolidate CKPT full.ckpt --lightning                         # a Lightning checkpoint file
    lightning-shard consolidate CKPT hf_out --hf                                   # save_pretrained, LoRA merged
    lightning-shard consolidate CKPT adapter_out --hf-adapter                      # peft adapter folder

The weights file is a plain ``{name: tensor}`` state dict that ``model.load_state_dict`` accepts, with fp32
master weights where the run kept them (``--no-master`` for the training dtype). ``--lightning`` writes a
whole Lightning checkpoint (weights, optimizer state in torch's format, loops, callbacks, hparams) that any
Trainer resumes from with ``ckpt_path=``. ``--hf`` / ``--hf-adapter`` (a run of the ``hf_causal_lm`` recipe, which
needs ``transformers`` and ``peft``): a Hugging Face folder that ``AutoModelForCausalLM.from_pretrained(OUT)`` loads,
adapters merged, or peft's adapter folder for ``PeftModel.from_pretrained(base, OUT)`` (``recipes/hf_export.py``).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


def register(sub: Any) -> None:
    p = sub.add_parser("consolidate", help="turn a sharded checkpoint directory into one plain file",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("ckpt", help="sharded checkpoint directory (meta.json) or torch.distributed.checkpoint one "
                                "(.metadata)")
    p.add_argument("out", help="output file")
    p.add_argument("--strip-prefix", default="", help="remove this prefix from every key, e.g. 'model.'")
    p.add_argument("--no-master", action="store_true", help="weights in the training dtype, not fp32 masters")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--safetensors", action="store_true", help="write safetensors instead of torch.save")
    fmt.add_argument("--lightning", action="store_true", help="write a full Lightning checkpoint")
    fmt.add_argument("--hf", action="store_true",
                     help="hf_causal_lm recipe: a save_pretrained folder, LoRA adapters merged")
    fmt.add_argument("--hf-adapter", action="store_true",
                     help="hf_causal_lm recipe with LoRA: peft's adapter folder (the base in OUT/base when the run "
                          "started from a random-init config)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from lightning_shard.checkpoint.consolidate import lightning_checkpoint, model_state
    from lightning_shard.checkpoint.save_load import open_reader

    reader = open_reader(args.ckpt)
    if args.hf or args.hf_adapter:
        from lightning_shard.recipes.hf_export import save_hf

        hparams = dict(reader.trainer_state().get("hyper_parameters") or {})
        out = save_hf(model_state(reader, prefer_master=not args.no_master), hparams, args.out,
                      adapter=args.hf_adapter)
        print(f"wrote Hugging Face {'adapter ' if args.hf_adapter else ''}folder {out}")
        return 0
    if args.lightning:
        torch.save(lightning_checkpoint(reader, prefer_master=not args.no_master), args.out)
        print(f"wrote Lightning checkpoint {args.out}")
        return 0
    state = model_state(reader, prefer_master=not args.no_master)
    if args.strip_prefix:
        if not any(k.startswith(args.strip_prefix) for k in state):
            raise ValueError(f"no key starts with {args.strip_prefix!r}; keys look like {sorted(state)[:3]}")
        state = {k[len(args.strip_prefix):]: v for k, v in state.items() if k.startswith(args.strip_prefix)}
    if args.safetensors:
        try:
            from safetensors.torch import save_file
        except ImportError as err:
            raise ValueError("--safetensors needs the safetensors package: pip install safetensors") from err
        # safetensors refuses shared storage: tied weights are written as separate copies
        save_file({k: v.contiguous().clone() for k, v in state.items()}, args.out)
    else:
        torch.save(state, args.out)
    print(f"wrote {len(state)} tensors to {args.out}")
    return 0


if __name__ == "__main__":
    from lightning_shard.cli import main

    sys.exit(main(["consolidate", *sys.argv[1:]]))
