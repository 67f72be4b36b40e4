"""The peak suite's table (``bench/results/peak_<hardware>_<date>.md``): measured peak memory per rank against the
ZeRO formula.

Measured (``measure.py``, peak suite): each rank's ``VmHWM`` (whole process, and the training window alone after a
reset at ``on_train_start``) and its ``VmRSS`` at ``on_train_start`` (the baseline), every rank started with
``MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=65536`` (``driver.PEAK_MALLOC_ENV``).

Formula (per rank, fp32, AdamW with two fp32 states, Psi parameters, N ranks): sharding the optimizer state saves
(N-1)/N x 8 Psi bytes (zero1 against zero0), the gradients a further (N-1)/N x 4 Psi (zero2 against zero1), the
parameters a further (N-1)/N x 4 Psi (stage 3 against zero2), less the full parameters gathered while a unit runs
(not subtracted here). The table puts the measured saving, the formula's and their ratio side by side; it does not
judge them.

Planner (``lightning_shard.planner``, :func:`planner_predictions`): for each of our strategies (ddp as the planner's
zero0, the same model states; DDP's reducer buckets, a second copy of the gradients, are not modelled; fsdp2 is a
peer the planner does not model) ``memory.peak_bytes`` for the same job, built from a meta-device copy of the model
with the bench's optimizer groups. Its ``total - at_setup`` is the predicted peak *above* what exists once the
strategy is set up (parameters as the engine lays them out): that is added to each rank's measured baseline (VmRSS at
train start, an input here) and compared with the measured training-window peak. What the prediction does not
contain: memory other than tensors that the first steps add to the process (library pages faulted in, the
allocator's and gloo's own buffers), ~32 MiB per rank here (docs/planner.md).
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
from pathlib import Path
from typing import Any, Optional

from variants import OPT_IN, OURS, block_class, build_model, split_variant

MIB = 2**20
REPO = Path(__file__).resolve().parents[1]
# the peak suite's allocator environment: glibc serves blocks >= 64 KiB with mmap and trims the heap top above
# 64 KiB, so freed tensor memory leaves the resident set and VmHWM follows the live tensors
PEAK_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}
STAGE = {"ddp": 0, "zero0": 0, "zero1": 1, "zero2": 2, "fsdp2": 3, "zero3": 3, "fsdp_shard": 3,
         "ds_zero1": 1, "ds_zero2": 2, "ds_zero3": 3}
# bytes per parameter a rank no longer holds (times (N-1)/N) once stage s shards: optimizer state, + grads, + params
SHARDED_BYTES_PER_PARAM = {0: 0, 1: 8, 2: 12, 3: 16}
# the previous rung of each variant: what it is compared with, one step down the ladder
RUNG = {"zero1": "zero0", "zero2": "zero1", "fsdp2": "zero2", "zero3": "fsdp2", "fsdp_shard": "fsdp2",
        # DeepSpeed against ours at the same stage (formula 0); a knob variant against its strategy without the knob
        "ds_zero1": "zero1", "ds_zero2": "zero2", "ds_zero3": "zero3",
        **{v: split_variant(v)[0] for v in OPT_IN["peak"] if split_variant(v)[1]}}


def formula_saving_bytes(variant: str, ref: str, world: int, n_params: int) -> Optional[float]:
    """Bytes per rank the formula says ``variant`` holds less than ``ref`` (None where either is not on the ladder)."""
    if variant not in STAGE or ref not in STAGE:
        return None
    per_param = SHARDED_BYTES_PER_PARAM[STAGE[variant]] - SHARDED_BYTES_PER_PARAM[STAGE[ref]]
    return (world - 1) / world * per_param * n_params


def _max(xs: Optional[list]) -> Optional[float]:
    xs = [x for x in xs or [] if x is not None]
    return max(xs) if xs else None


def _ranks(xs: Optional[list], d: int = 0) -> str:
    return " / ".join("?" if x is None else f"{x:.{d}f}" for x in xs or []) or "-"


def _mib(x: Optional[float], d: int = 0, sign: bool = True) -> str:
    if x is None:
        return "n/a"
    return f"{x:+.{d}f}" if sign else f"{x:.{d}f}"


def _ratio(measured: Optional[float], formula: Optional[float]) -> str:
    if measured is None or formula is None:
        return "n/a"
    if abs(formula) < 1e-9:
        return "n/a (formula 0)"
    return f"{measured / formula:.2f}"


def _growth(r: dict[str, Any], peak_key: str) -> Optional[list[Optional[float]]]:
    peaks, base = r.get(peak_key), r.get("baseline_rss_mib_per_rank")
    if not peaks or not base:
        return None
    return [None if p is None or b is None else p - b for p, b in zip(peaks, base)]


def _model_state(r: dict[str, Any]) -> str:
    """rank0's model state and where it comes from (``engine.memory_report()`` for ours)."""
    each = r.get("model_state_mib_each_rank") or []
    if not each:
        return "-"
    totals = " / ".join(f"{m['total']:.0f}" for m in each)
    gathered = [m.get("gathered_params_excluded", 0.0) for m in each]
    src = "memory_report" if r.get("model_state_source", "").startswith("engine") else "tensors"
    extra = f"; + gathered {' / '.join(f'{g:.0f}' for g in gathered)}" if any(gathered) else ""
    return f"{totals} ({src}{extra})"


def _savings(res: dict[str, Any], v: str, peak_key: str) -> tuple[Optional[float], Optional[float]]:
    """Measured saving (MiB, max rank) of ``v`` against zero0 and against its rung, from ``peak_key``."""
    mine = _max(res[v].get(peak_key))

    def against(ref: Optional[str]) -> Optional[float]:
        if ref is None or ref not in res or "error" in res[ref] or mine is None:
            return None
        theirs = _max(res[ref].get(peak_key))
        return None if theirs is None else theirs - mine

    return against("zero0" if v != "zero0" else None), against(RUNG.get(v))


def row_set(res: dict[str, Any], model: dict[str, Any], world: int, suite: str) -> list[str]:
    n_params = model["params"]
    k = (world - 1) / world * n_params / MIB  # MiB per rank for one fp32-byte-per-parameter sharded
    units = model.get("units", {})
    lines = [
        f"**{model.get('kind', 'gpt')} {model['n_layer']} layers x {model['n_embd']} wide, {model['n_head']} heads, "
        f"vocab {model['vocab']}, seq {model['block_size']}: Psi = {n_params:,} parameters "
        f"({model['param_mib_fp32']:.1f} MiB fp32); N = {world}.** Formula per rank: (N-1)/N x Psi x 8 B = "
        f"{8 * k:.1f} MiB (optimizer state), x 4 B = {4 * k:.1f} MiB (gradients; parameters). Full fp32 size of a "
        f"unit of the per-block wrap: block {units.get('block', 0) * 4 / MIB:.1f} MiB, root (embeddings, final "
        f"norm, tied head) {units.get('root', 0) * 4 / MIB:.1f} MiB.",
        "",
        "| variant | peak MiB/rank (VmHWM) | baseline MiB/rank (RSS at train start) | peak - baseline | "
        "saving vs zero0 | formula vs zero0 | measured/formula | rung | saving vs rung | formula vs rung | "
        "measured/formula | model state MiB/rank at last step (source) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | --- |",
    ]
    for v, r in res.items():
        rung = RUNG.get(v)
        if "error" in r:
            why = r.get("error_line") or ""
            lines.append(f"| {v} | error: {r['error']} | | | | | | {rung or '-'} | | | | {why} (see {suite}.json "
                         "log_tail) |")
            continue
        s0, sr = _savings(res, v, "peak_rss_mib_per_rank")
        f0 = None if v == "zero0" else formula_saving_bytes(v, "zero0", world, n_params)
        fr = formula_saving_bytes(v, rung, world, n_params) if rung else None
        f0 = None if f0 is None else f0 / MIB
        fr = None if fr is None else fr / MIB
        mark = " (*)" if r.get("exit_error") else ""
        lines.append(
            f"| {v}{mark} | {_ranks(r['peak_rss_mib_per_rank'])} | {_ranks(r.get('baseline_rss_mib_per_rank'))} | "
            f"{_ranks(_growth(r, 'peak_rss_mib_per_rank'))} | {_mib(s0) if v != 'zero0' else '(reference)'} | "
            f"{_mib(f0, 1, sign=False) if v != 'zero0' else '-'} | {_ratio(s0, f0) if v != 'zero0' else '-'} | "
            f"{rung or '-'} | {_mib(sr) if rung else '-'} | {_mib(fr, 1, sign=False) if rung else '-'} | "
            f"{_ratio(sr, fr) if rung else '-'} | {_model_state(r)} |")
    lines += [
        "",
        "Training window (VmHWM reset to the RSS at train start): what setup left as a high-water mark, then the "
        "peak of the warmup + timed steps alone, the same savings on it.",
        "",
        "| variant | setup peak MiB/rank (VmHWM at train start) | training-window peak MiB/rank | "
        "window peak - baseline | saving vs zero0 | measured/formula | saving vs rung | measured/formula | HWM reset | "
        "planner MiB/rank (baseline + predicted) | measured/planner | window peak - baseline: measured/predicted |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |",
    ]
    for v, r in res.items():
        if "error" in r:
            continue
        rung = RUNG.get(v)
        s0, sr = _savings(res, v, "train_peak_rss_mib_per_rank")
        f0 = formula_saving_bytes(v, "zero0", world, n_params)
        fr = formula_saving_bytes(v, rung, world, n_params) if rung else None
        reset = r.get("hwm_reset_each_rank") or []
        mark = " (*)" if r.get("exit_error") else ""
        lines.append(
            f"| {v}{mark} | {_ranks(r.get('setup_peak_rss_mib_per_rank'))} | "
            f"{_ranks(r.get('train_peak_rss_mib_per_rank'))} | {_ranks(_growth(r, 'train_peak_rss_mib_per_rank'))} | "
            f"{_mib(s0) if v != 'zero0' else '(reference)'} | "
            f"{_ratio(s0, None if f0 is None else f0 / MIB) if v != 'zero0' else '-'} | "
            f"{_mib(sr) if rung else '-'} | {_ratio(sr, None if fr is None else fr / MIB) if rung else '-'} | "
            f"{'yes' if reset and all(reset) else 'no' if reset else '?'} | {_planner_cells(r)} |")
    lines += _planner_notes(res)
    exits = [f"{v}: rc={r['exit_error']['rc']} ({r['exit_error']['error_line'] or 'no message'})"
             for v, r in res.items() if r.get("exit_error")]
    if exits:
        lines += ["", "(*) These variants' jobs failed after every rank had written its result at the end of training "
                      "(the figures above are those results; log tails in the JSON, `exit_error`): "
                  + "; ".join(exits) + "."]
    parts = []
    for v, r in res.items():
        each = r.get("model_state_mib_each_rank") if "error" not in r else None
        if each:
            m = each[0]
            parts.append(f"{v}: " + ", ".join(f"{key} {val:.1f}" for key, val in m.items()
                                              if key != "total" and (val or key in ("params", "grads"))))
    if parts:
        lines += ["", "Model state at the last timed step, rank 0 (MiB): " + "; ".join(parts) + "."]
    return lines


def markdown_peak(doc: dict[str, Any]) -> str:
    m = doc["machine"]
    world = m["ranks"]
    env = " ".join(f"{k}={v}" for k, v in (m.get("malloc_env") or {}).items())
    code = m.get("code") or {}
    differ = code.get("differ_from_head")
    code_line = (f"lightning_shard as on disk at the start: HEAD {str(code.get('head'))[:12]}, "
                 + ("no .py file differs from HEAD" if differ == [] else
                    f"{len(differ)} .py file(s) differ from HEAD ({', '.join(differ)})" if differ else
                    "difference from HEAD unknown")
                 + f", sha256 of lightning_shard/**/*.py {code.get('lightning_shard_py_sha256')}.")
    sets = [(doc["results"], m["model"], doc.get("row_set_wall_s", doc["wall_s"]))]
    sets += [(s["results"], s["model"], s["wall_s"]) for s in doc.get("row_sets", [])]
    changed = sorted({v for res, _, _ in sets for v, r in res.items()
                      if r.get("code_sha256_start") and r.get("code_sha256_end") != r.get("code_sha256_start")})
    hashes = sorted({r[k] for res, _, _ in sets for r in res.values() for k in ("code_sha256_start", "code_sha256_end")
                     if r.get(k)})
    if len(hashes) > 1:
        code_line += (f" The lightning_shard code changed on disk during this run ({len(hashes)} versions seen"
                      + (f"; during the run of {', '.join(changed)}" if changed else "")
                      + "): rows may have run different code.")
    lines = [
        "# Peak memory per rank: DDP, zero0-2, FSDP2, zero3, fsdp_shard against the ZeRO formula",
        "",
        f"{world} CPU rank(s) x {m['threads_per_rank']} thread (gloo) on {m['cores']} cores ({m['cpu']}); "
        f"torch {m['torch']}, lightning {m['lightning']}, python {m['python']}. **Every rank started with "
        f"`{env}`** (set by the driver for this suite only: glibc serves blocks >= 64 KiB with mmap and trims "
        "the heap, so freed memory leaves the resident set and the peak follows the live tensors).",
        f"AdamW (fp32, 2 states), no mixed precision; micro-batch {m['micro_batch_per_rank']} x "
        f"{m['model']['block_size']} tokens per rank; {m['warmup_steps']} warmup + {m['timed_steps']} timed steps; "
        f"{m['repeats']} run(s) per variant (memory from the first good run). lightning_shard strategies with default "
        f"options (zero0/1/2: tuning.bucket_mb={m['bucket_mb']}; fsdp_shard: wrap_classes=[block class]); fsdp2: "
        "fully_shard per block then the root under Lightning ModelParallelStrategy; ddp: Lightning DDPStrategy.",
        code_line,
        f"Command: `{doc['command']}` (wall {doc['wall_s']:.0f} s"
        + (", row sets " + ", ".join(f"{w:.0f} s" for _, _, w in sets) if len(sets) > 1 else "") + ").",
        "",
        "Peak = each rank's VmHWM, whole process (measured by the OS, independent of the engine). Baseline = the "
        "rank's VmRSS at `on_train_start` (strategy set up, parameters placed and sharded, optimizer built, no "
        "step yet). Per-rank columns are rank0 / rank1 / ...; savings are MiB the variant's peak is below the "
        "other's (max over ranks; negative: above). Formula = the ZeRO saving per rank in fp32 bytes (zero1: "
        "optimizer state (N-1)/N x 8 Psi; zero2: + gradients (N-1)/N x 4 Psi; stage 3: + parameters (N-1)/N x "
        "4 Psi, the full parameters gathered for the running unit not subtracted); measured/formula = their "
        "ratio. Rungs: zero1 <- zero0, zero2 <- zero1, fsdp2 <- zero2 (stage 3 <- stage 2), zero3 and fsdp_shard <- "
        "fsdp2 (same stage: formula 0). Model state = params + grads + optimizer state (+ master / accumulators) "
        "held at the last timed step before the update: `engine.memory_report()` for lightning_shard (gathered "
        "full parameters listed apart), the tensors held for ddp / fsdp2 (DDP's reducer buckets not counted); "
        "reported beside the measured peak, not used for it.",
        "",
    ]
    for i, (res, model, _) in enumerate(sets):
        if i:
            lines.append("")
        lines += row_set(res, model, world, doc["suite"])
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------ the planner's prediction beside the measurement
def _planner_cells(r: dict[str, Any]) -> str:
    p = r.get("planner")
    if not p:
        return "n/a | n/a | n/a"
    if "error" in p:
        return f"error: {p['error']} | | "
    return (f"{_ranks(p['predicted_peak_mib_per_rank'])} | {_ranks(p['measured_over_predicted_per_rank'], 2)} | "
            f"{_ranks(p['growth_measured_over_predicted_per_rank'], 2)}")


# peak_bytes terms of each moment (MiB), as a reader adds them up
_TERMS = {"backward_start": (("activations", "activations"), ("start_gathered", "units gathered for backward"),
                             ("start_grads", "full gradient buffers")),
          "backward_end": (("gradients", "full gradients + in flight"), ("gathered", "gathered units")),
          "step": ()}


def _planner_notes(res: dict[str, Any]) -> list[str]:
    parts = []
    for v, r in res.items():
        p = r.get("planner") if "error" not in r else None
        if not p or "error" in p:
            continue
        t = p["terms_mib"]
        moment = p["moment"].replace("_", " ")
        a = p.get("activations") or {}
        labels = {"activations": f"activations ({a['layers']} layers x {a['per_layer_mib']:.1f} + output layer "
                                 f"{a['output_layer_mib']:.1f})"} if a.get("layers") else {}
        terms = " + ".join(f"{labels.get(k, label)} {t[k]:.1f}" for k, label in _TERMS[p["moment"]] if t.get(k))
        parts.append(f"{v} = planner {p['config']}: {p['predicted_above_setup_mib']:.1f} = persistent above setup "
                     f"{t['persistent'] - t['at_setup']:.1f} + {moment} {t[p['moment']]:.1f} ({terms})")
    if not parts:
        return []
    return ["", "Planner (`lightning_shard.planner.memory.peak_bytes`, same job; ddp is its zero0): predicted peak "
                "above the train-start baseline, MiB/rank = persistent states not yet there at train start (the "
                "optimizer state) + the largest moment (start of backward, end of backward, "
                "optimizer step); planner MiB/rank = each rank's measured baseline + that. " + "; ".join(parts) + "."]


def planner_config(args: argparse.Namespace, variant: str) -> Optional[Any]:
    """The planner's ``StrategyConfig`` for a variant as the bench builds it (``variants.make_strategy``, default knobs:
    accumulation ``auto`` is ``recommend.auto_policy`` at accumulation 1); None where the planner has no such row."""
    from lightning_shard.planner.config import StrategyConfig
    from lightning_shard.planner.recommend import auto_policy

    name = {"ddp": "zero0"}.get(variant, variant)  # Lightning DDP: the same model states as zero0
    stage = {"zero0": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp_shard": 3}.get(name)
    if stage is None:  # fsdp2 (a peer), activation-checkpointing variants (not modelled), ...
        return None
    policy = auto_policy(stage, 1, 0.0)[0]
    if stage < 3:
        return StrategyConfig(name, stage, policy, bucket_mb=args.bucket_mb)
    return StrategyConfig(name, 3, policy, wrap_classes=(block_class(args),) if name == "fsdp_shard" else None)


def planner_predictions(args: argparse.Namespace, variants: list[str]) -> dict[str, dict[str, Any]]:
    """``memory.peak_bytes`` per variant for the bench's job: its model on the meta device, AdamW over the bench's two
    param groups (weight decay on >= 2-D parameters), ``args.devices`` CPU ranks, micro-batch ``batch_size`` x
    ``block_size`` tokens, fp32, accumulation 1."""
    import torch

    from lightning_shard.planner.recommend import plan
    from lightning_shard.planner.stats import activation_bytes_per_layer

    cfgs = {v: c for v in variants if (c := planner_config(args, v)) is not None}
    if not cfgs:
        return {}
    with torch.device("meta"):
        model = build_model(args)
    params = list(model.parameters())
    groups = [[[p for p in params if p.dim() >= 2], [p for p in params if p.dim() < 2]]]
    res = plan(model, None, args.devices, args.devices * args.batch_size, args.batch_size, "32-true",
               optimizer_groups=groups, seq=args.block_size, optimizer="adamw",
               configs=list(dict.fromkeys(cfgs.values())), require_fit=False)
    rows = {r.config: r for r in res.rows}
    shape = res.context.shape
    layer = activation_bytes_per_layer(shape, args.batch_size, 4) if shape is not None else 0.0
    acts = {"layers": shape.layers if shape else 0, "per_layer_mib": round(layer / MIB, 2),
            "output_layer_mib": round((res.context.activations - (shape.layers if shape else 0) * layer) / MIB, 2)}
    out = {}
    for v, c in cfgs.items():
        mem = rows[c].memory
        moment = max(("backward_start", "backward_end", "step"), key=lambda k: mem[k])
        kwargs = {k: [getattr(x, "__name__", str(x)) for x in w] if k == "wrap_classes" and not isinstance(w, str)
                  else w for k, w in c.kwargs().items()}  # JSON: classes by name
        out[v] = {"config": c.label, "strategy": c.registered, "kwargs": kwargs, "moment": moment,
                  "terms_mib": {k: round(x / MIB, 2) for k, x in mem.items()}, "activations": acts,
                  "predicted_total_mib": round(mem["total"] / MIB, 2),
                  "predicted_above_setup_mib": round((mem["total"] - mem["at_setup"]) / MIB, 2)}
    return out


def add_planner(args: argparse.Namespace, results: dict[str, dict[str, Any]]) -> None:
    """Put the planner's prediction (``planner``) into each result row, beside the measured baseline and peak."""
    try:
        preds = planner_predictions(args, [v for v, r in results.items() if "error" not in r])
    except Exception as exc:  # the bench reports what it measured whatever the planner does
        preds = {v: {"error": f"{type(exc).__name__}: {exc}"[:200]} for v in results if planner_config(args, v)}
    for v, p in preds.items():
        r = results[v]
        if "error" not in p:
            above, base = p["predicted_above_setup_mib"], r.get("baseline_rss_mib_per_rank") or []
            peaks = r.get("train_peak_rss_mib_per_rank") or []
            pred = [None if b is None else round(b + above, 1) for b in base]
            p["predicted_peak_mib_per_rank"] = pred
            p["measured_over_predicted_per_rank"] = [None if m is None or q is None else round(m / q, 3)
                                                     for m, q in zip(peaks, pred)]
            p["growth_measured_over_predicted_per_rank"] = [
                None if m is None or b is None or above <= 0 else round((m - b) / above, 3)
                for m, b in zip(peaks, base)]
        r["planner"] = p


# ------------------------------------------------------------------ the run side of the peak suite (driver.py)
def sizes_of(args: argparse.Namespace) -> list[argparse.Namespace]:
    """The peak suite's row sets: the run's own size first, then each ``--sizes`` entry (LAYERSxWIDTH[xHEADS])."""
    out = [args]
    for n_layer, n_embd, n_head in args.sizes:
        if (n_layer, n_embd, n_head) != (args.n_layer, args.n_embd, args.n_head):
            out.append(argparse.Namespace(**dict(vars(args), n_layer=n_layer, n_embd=n_embd, n_head=n_head)))
    return out


def code_state() -> dict[str, Any]:
    """Which lightning_shard code a run imported: HEAD, a hash of the ``lightning_shard/**/*.py`` files as they are
    on disk, and those that differ from HEAD (git blob ids computed here; only read-only git commands)."""
    files = sorted((REPO / "lightning_shard").rglob("*.py"))
    h = hashlib.sha256()
    blobs = {}
    for f in files:
        data = f.read_bytes()
        rel = str(f.relative_to(REPO))
        h.update(rel.encode() + b"\0" + data)
        blobs[rel] = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()

    def git(*cmd: str) -> str:
        try:
            return subprocess.run(["git", *cmd], cwd=REPO, capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            return ""

    head = git("rev-parse", "HEAD").strip() or None
    committed = {}
    for line in git("ls-tree", "-r", "HEAD", "--", "lightning_shard").splitlines():
        meta, _, path = line.partition("\t")
        if path.endswith(".py"):
            committed[path] = meta.split()[-1]
    differ = sorted(p for p in set(blobs) | set(committed) if blobs.get(p) != committed.get(p)) if head else None
    return {"head": head, "lightning_shard_py_sha256": h.hexdigest()[:16], "differ_from_head": differ}


def peak_fields(variant: str, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The peak suite's per-rank memory figures (MiB): see ``measure.py``."""
    mib = 2**20

    def per_rank(key: str) -> list[Optional[float]]:
        return [None if r[key] is None else round(r[key] / mib, 1) for r in ranks]

    return {
        "baseline_rss_mib_per_rank": per_rank("baseline_rss_bytes"),
        "setup_peak_rss_mib_per_rank": per_rank("setup_peak_rss_bytes"),
        "train_peak_rss_mib_per_rank": per_rank("train_peak_rss_bytes"),
        "hwm_reset_each_rank": [r["hwm_reset"] for r in ranks],
        "malloc_env_each_rank": [r["malloc_env"] for r in ranks],
        "model_state_source": "engine.memory_report()" if variant in OURS else "tensors held (params, .grad, AdamW)",
        "model_state_mib_each_rank": [{k: round(v / mib, 2) for k, v in r["model_state"].items()
                                       if k != "padding_elements"} for r in ranks],
    }



# ============================================================================================ CLI
