"""Consolidation: a sharded checkpoint directory -> full tensors, without any model or process group.

``model_state(reader)`` gives the full state dict (fp32 masters by default where they exist, every alias
of a tied weight); ``optimizer_states(reader)`` gives torch's per-parameter optimizer format, numbered in
the order of the saved param groups (what ``torch.optim.Optimizer.load_state_dict`` expects);
``lightning_checkpoint(reader)`` puts both back into the rest of the saved Lightning checkpoint.
"""

from __future__ import annotations

from typing import Any

import torch

from .format import Reader


def model_state(reader: Reader, prefer_master: bool = True) -> dict[str, torch.Tensor]:
    shapes, aliases = reader.meta["shapes"], reader.meta.get("aliases", {})
    out: dict[str, torch.Tensor] = {}
    for name in reader.keys("param/"):
        key = f"master/{name}" if prefer_master and reader.has(f"master/{name}") else f"param/{name}"
        value = reader.read(key).view(shapes[name])
        for alias in aliases.get(name, [name]):
            out[alias] = value
    for name in reader.keys("buffer/"):
        t = reader.read(f"buffer/{name}")
        out[name] = t.view(shapes[name]) if t.dim() else t
    return out


def optimizer_states(reader: Reader) -> list[dict[str, Any]]:
    shapes, out = reader.meta["shapes"], []
    for oi, saved in enumerate(reader.meta["optimizers"]):
        state: dict[int, dict[str, Any]] = {}
        groups, idx = [], 0
        for g in saved["groups"]:
            ids = []
            for name in g["param_names"]:
                st = {}
                for k in reader.keys(f"optim/{oi}/{name}/"):
                    v = reader.read(f"optim/{oi}/{name}/{k}")
                    st[k] = v.view(shapes[name]) if v.dim() == 1 else v
                if st:
                    state[idx] = st
                ids.append(idx)
                idx += 1
            entry = {k: (tuple(v) if k == "betas" else v) for k, v in g.items() if k != "param_names"}
            entry["params"] = ids
            groups.append(entry)
        out.append({"state": state, "param_groups": groups})
    return out


def lightning_checkpoint(reader: Reader, prefer_master: bool = True) -> dict[str, Any]:
    ckpt = reader.trainer_state()
    ckpt["state_dict"] = model_state(reader, prefer_master)
    ckpt["optimizer_states"] = optimizer_states(reader)
    return ckpt
