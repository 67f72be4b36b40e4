"""Phases 3 and 4, memory and speed at world 1: the engine's own overhead against plain training and FSDP2.

The recipe GPT at ~1B parameters (gpu_models.SIZES["cuda"]["perf"]: 18 x 2048, vocab 50304, seq 1024; ``--perf
KEY=VALUE`` overrides), bf16-mixed, AdamW, micro-batch 8 x 1024, built directly on the device
(``bench/variants.py``'s module, the speed bench's). Variants, each a fresh ``Trainer.fit`` in this process:
``plain`` (no strategy), ``zero0``..``zero3``, ``fsdp_shard`` (registry names, default knobs) and ``fsdp2`` (torch
``fully_shard`` per block + root under Lightning's ``ModelParallelStrategy``, data-parallel size 1). Rounds run in
alternating order (ABC, CBA); a second round is skipped, with a note, when the time left would not fit it.

Per run: ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` since just before the model was built, to the
end of the timed steps (``--cpu``: peak RSS, ``VmHWM`` reset per run, a stand-in); tokens/s over the timed steps
(``torch.cuda.synchronize`` at both ends); MFU = 6 Psi tokens/s / 989e12 (NVIDIA H100/H200 SXM datasheet: 989 TFLOPS
dense BF16 Tensor Core, 1,979 with sparsity; 6 Psi per token: forward + backward matmuls, attention not counted); the
profiler labels of a few steps after the timed ones (``lightning_shard.*``, ``FSDP::*``; host time, as the speed bench
reads them: bench/measure.py).

Checked (against plain training or a formula, never the engine's own accounting): each run trains; its first loss
equals plain training's (same weights, same batch: relative 1e-2); its peak holds at least the model state the ZeRO
paper counts at world 1, 16 Psi bytes (fp32 parameters, gradients, AdamW's two moments). Reported, not asserted: the
goals (zero2, zero3, fsdp_shard at >= 0.97 x plain's tokens/s and >= FSDP2's).
"""

from __future__ import annotations

import argparse
import gc
import math
import time
from typing import Any

from gpu_common import Recorder, short
from gpu_models import SIZES

VARIANTS = ("plain", "zero0", "zero1", "zero2", "zero3", "fsdp_shard", "fsdp2")
GOAL_VARIANTS = ("zero2", "zero3", "fsdp_shard")
# NVIDIA H100 / H200 SXM datasheets: BF16 Tensor Core 1,979 TFLOPS with sparsity, i.e. 989 TFLOPS dense
PEAK_BF16_FLOPS = 989e12


def config(args: argparse.Namespace) -> dict[str, Any]:
    cfg = dict(SIZES["cpu" if args.cpu else "cuda"]["perf"])
    for item in args.perf or ():
        key, _, value = item.partition("=")
        if key not in cfg:
            raise ValueError(f"--perf {item}: unknown key {key!r}; keys: {', '.join(cfg)}")
        cfg[key] = int(value)
    return cfg


def bench_args(cfg: dict[str, Any]) -> argparse.Namespace:
    return argparse.Namespace(model="gpt", devices=1, **{k: cfg[k] for k in ("vocab", "block_size", "n_layer",
                                                                             "n_head", "n_embd", "batch_size")})


def make_strategy(variant: str, device: str) -> Any:
    if variant == "plain":
        return "auto"
    if variant == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1, save_distributed_checkpoint=True,
                                     process_group_backend="nccl" if device == "cuda" else "gloo")
    return variant  # the registry name, default knobs


def one_run(cfg: dict[str, Any], variant: str, device: str) -> dict[str, Any]:
    import lightning as L
    import torch
    from measure import EnginePhaseProfile, peak_rss_bytes, reset_peak_rss, rss_bytes
    from torch.utils.data import DataLoader, TensorDataset
    from variants import make_module

    import lightning_shard.strategies  # noqa: F401  the registry names

    cuda = device == "cuda"
    warmup, steps, n_prof = cfg["warmup"], cfg["steps"], cfg["profile_steps"]
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    else:
        reset_peak_rss()
    before = torch.cuda.memory_allocated() if cuda else rss_bytes()
    out: dict[str, Any] = {"before_bytes": before, "losses": []}
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    class Meter(L.Callback):
        prof = EnginePhaseProfile()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if batch_idx == warmup:
                sync()
                out["t0"] = time.perf_counter()
            if batch_idx == warmup + steps and n_prof:
                self.prof.start()
            self.t = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            out["losses"].append(float(outputs["loss"]))
            if warmup <= batch_idx < warmup + steps:
                sync()
                out.setdefault("step_s", []).append(time.perf_counter() - self.t)
            if batch_idx == warmup + steps - 1:
                out["t1"] = time.perf_counter()
                out["peak_bytes"] = torch.cuda.max_memory_allocated() if cuda else peak_rss_bytes()
                out["reserved_bytes"] = torch.cuda.max_memory_reserved() if cuda else None
            if n_prof and batch_idx == warmup + steps + n_prof - 1:
                out["engine_phases"] = self.prof.stop(n_prof)
                out["labels"] = self.prof.labels

        def on_exception(self, trainer, pl_module, exception) -> None:
            self.prof.close()

    L.seed_everything(0, verbose=False)
    with torch.device(device):  # ~1B parameters: built where they train, not on the host
        module = make_module(bench_args(cfg), variant)
    out["params_bytes"] = (torch.cuda.memory_allocated() if cuda else rss_bytes()) - before
    n = (warmup + steps + n_prof) * cfg["batch_size"]
    t = torch.randint(cfg["vocab"], (n, cfg["block_size"] + 1), generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(t[:, :-1], t[:, 1:]), batch_size=cfg["batch_size"], shuffle=False)
    trainer = L.Trainer(accelerator=device, devices=1, strategy=make_strategy(variant, device), precision="bf16-mixed",
                        max_steps=warmup + steps + n_prof, use_distributed_sampler=False, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0, callbacks=[Meter()])
    trainer.fit(module, data)
    out["tokens_per_s"] = steps * cfg["batch_size"] * cfg["block_size"] / (out.pop("t1") - out.pop("t0"))
    del trainer, module
    gc.collect()
    return out


def run(rec: Recorder) -> None:
    import torch
    from variants import model_param_count

    args = rec.args
    device = "cpu" if args.cpu else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("no CUDA device: run the GPU check on a GPU machine, or pass --cpu")
    cfg = config(args)
    psi = model_param_count(bench_args(cfg))
    rec.put("config", {**cfg, "params": psi, "precision": "bf16-mixed", "peak_flops": PEAK_BF16_FLOPS})
    results: dict[str, dict[str, Any]] = {}
    rec.put("results", results)
    longest = [0.0]  # the longest run so far, seconds
    for r in range(cfg["rounds"]):
        order = VARIANTS if r % 2 == 0 else tuple(reversed(VARIANTS))
        if r and rec.time_left() < len(order) * longest[0] * 1.2 + 5:
            rec.note(f"round {r + 1} skipped: {rec.time_left():.0f} s left, a round takes "
                     f"~{len(order) * longest[0]:.0f} s")
            break
        if not one_round(rec, cfg, order, r, results, psi, device, longest):
            break
    goals(rec, results)


def one_round(rec: Recorder, cfg: dict[str, Any], order: tuple[str, ...], r: int, results: dict[str, Any], psi: int,
              device: str, longest: list[float]) -> bool:
    """Every variant once; False when a later round stopped for time (the first round raises OutOfTime instead)."""
    for v in order:
        if "error" in results.get(v, {}):
            continue
        if not r:
            rec.need(max(10.0, 1.5 * longest[0]), f"the {v} run")
        elif rec.time_left() < 1.5 * longest[0]:
            rec.note(f"round {r + 1} stopped before {v}: out of time")
            return False
        t = time.perf_counter()
        try:
            got = one_run(cfg, v, device)
        except Exception as err:  # noqa: BLE001 - a run that cannot train is a failure, loudly
            results[v] = {"error": short(err, 500)}
            rec.error(f"perf/{v}", err, "Trainer.fit of the memory/speed GPT")
            continue
        longest[0] = max(longest[0], time.perf_counter() - t)
        record(rec, results, v, got, psi, r, device)
    return True


def record(rec: Recorder, results: dict[str, Any], v: str, got: dict[str, Any], psi: int, r: int,
           device: str) -> None:
    res = results.setdefault(v, {"rounds": []})
    res["rounds"].append(got["tokens_per_s"])
    res["tokens_per_s"] = max(res["rounds"])
    res["mfu"] = 6 * psi * res["tokens_per_s"] / PEAK_BF16_FLOPS if device == "cuda" else None
    if r:
        rec.put("results", results)
        return
    step_s = sorted(got.get("step_s", []))
    res.update(peak_bytes=got["peak_bytes"], reserved_bytes=got["reserved_bytes"], before_bytes=got["before_bytes"],
               params_bytes=got["params_bytes"], median_step_s=step_s[len(step_s) // 2] if step_s else None,
               losses=got["losses"], labels=got.get("labels"), engine_phases=got.get("engine_phases"))
    bad = sum(not math.isfinite(x) for x in got["losses"])
    rec.check(f"perf/{v}/finite", float(bad), 0.0, what="non-finite losses", reference="-")
    plain = results.get("plain")
    if v != "plain" and plain and plain.get("losses"):
        rel = abs(got["losses"][0] - plain["losses"][0]) / abs(plain["losses"][0])
        rec.check(f"perf/{v}/first_loss", rel, 1e-2, what="|loss_0 - loss_0(plain)| / loss_0(plain)",
                  reference="plain training: the same initial weights and batch")
    rec.check(f"perf/{v}/memory_holds_state", float(got["peak_bytes"]), float(16 * psi), op=">=",
              what="peak memory, bytes" + (" (peak RSS: CPU stand-in)" if device == "cpu" else ""),
              reference="16 Psi: fp32 parameters + gradients + AdamW's two moments at world 1 (ZeRO paper)")


def goals(rec: Recorder, results: dict[str, Any]) -> None:
    tp = {v: r.get("tokens_per_s") for v, r in results.items() if "error" not in r}
    out = []
    for v in GOAL_VARIANTS:
        if tp.get(v) and tp.get("plain"):
            x = tp[v] / tp["plain"]
            out.append({"variant": v, "what": "tokens/s vs plain", "value": x, "goal": ">= 0.97", "met": x >= 0.97})
        if tp.get(v) and tp.get("fsdp2"):
            x = tp[v] / tp["fsdp2"]
            out.append({"variant": v, "what": "tokens/s vs FSDP2", "value": x, "goal": ">= 1.0", "met": x >= 1.0})
    rec.put("goals", out)
