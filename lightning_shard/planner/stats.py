"""Model statistics without running a training step: parameters, units, activation bytes.

Parameters are read from the module (the meta device is fine: only shapes and dtypes are used); a tied
weight counts once (``named_parameters`` deduplicates). Per-unit sizes reuse the engine's own
:func:`lightning_shard.engine.zero3.plan.plan_units`, so they are the units stage 3 would gather.

Activation bytes per transformer layer follow Korthikanti et al. 2022, "Reducing Activation Recomputation
in Large Transformer Models" (arXiv:2205.05198), section 4.1: ``s·b·h·(34 + 5·a·s/h)`` bytes with 16-bit
activations and 1-byte dropout masks (s sequence, b micro-batch, h hidden, a heads). Their breakdown:
attention 11sbh + 5as²b, MLP 19sbh, two LayerNorms 4sbh. Two adjustments, both stated:
* without dropout the three sbh-sized masks (attention output, MLP output, 1 byte each ... 2sbh in the
  16-bit accounting of that paper) and the attention dropout (mask as²b, output 2as²b) are not stored;
* with fused attention (FlashAttention, Dao et al. 2022; ``F.scaled_dot_product_attention``'s flash and
  memory-efficient kernels) the s² terms vanish: the kernel saves its output and a logsumexp per row.
Scaling to other activation widths multiplies the 16-bit terms by act_bytes / 2. A third adjustment, read from
the module: an MLP activation written as several elementwise ops instead of one kernel saves more tensors of the
MLP's width 4h (``UNFUSED_MLP_ACTIVATIONS``; Hugging Face GPT-2's ``gelu_new``: 3 more per layer).
The output layer (not in that formula), at the start of backward, where activations peak: the final LayerNorm's
input and output (2h), the log-softmax output the loss saved (V), the gradient of the loss with respect to it
(V, from the NLL backward) and the logits' gradient (V, from the log-softmax backward): (2h + 3V)·act_bytes per
token. The logits themselves (V) are freed once the step has returned the loss; at the end of forward, while the
loss is computed, they and the log-softmax (2V) are all the output layer holds.
Checked against ``torch.autograd.graph.saved_tensors_hooks`` and the profiler's allocations for HF GPT-2 6 x 384,
vocab 16384, 4 x 128 tokens, fp32 (the peak-memory benchmark's model): 21.0 MiB per layer, 223.6 MiB at the start
of backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from torch import nn

from ..engine.zero3.plan import plan_units


@dataclass(frozen=True)
class ModelStats:
    params: int  # unique parameters (tied counted once)
    trainable: int
    frozen: int
    by_dtype: dict[str, int]
    param_bytes: int
    buffer_bytes: int


def model_stats(module: nn.Module) -> ModelStats:
    params = list(module.parameters())  # deduplicated: a tied weight appears once
    by_dtype: dict[str, int] = {}
    for p in params:
        key = str(p.dtype).replace("torch.", "")
        by_dtype[key] = by_dtype.get(key, 0) + p.numel()
    trainable = sum(p.numel() for p in params if p.requires_grad)
    total = sum(p.numel() for p in params)
    return ModelStats(total, trainable, total - trainable, by_dtype,
                      sum(p.numel() * p.element_size() for p in params),
                      sum(b.numel() * b.element_size() for b in module.buffers()))


def unit_sizes(module: nn.Module, granularity: str = "fsdp", wrap_classes: Any = "auto",
               min_params: Optional[int] = None) -> list[tuple[str, int, int]]:
    """``(unit name, parameters, bytes)`` of each stage-3 unit, the root unit first (engine's plan_units)."""
    return [(s.name, sum(p.numel() for p in s.params), sum(p.numel() * p.element_size() for p in s.params))
            for s in plan_units(module, granularity, wrap_classes, min_params)]


# MLP activation modules that run as several elementwise ops (autograd saves intermediates) rather than one fused
# kernel, by class name: how many tensors of the MLP's width (4h) each saves for backward beyond its input (the GELU
# output, which the second matmul saves, is in Korthikanti et al.'s count already). Hugging Face
# ``NewGELUActivation`` (GPT-2's ``gelu_new``), 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))): tanh's output and the
# final product's two operands, 0.5·x and 1 + tanh (x³ and the sums save nothing new): 3. nn.GELU / F.gelu: none.
UNFUSED_MLP_ACTIVATIONS = {"NewGELUActivation": 3}


@dataclass(frozen=True)
class TransformerShape:
    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    dropout: bool = False
    fused_attention: bool = True  # F.scaled_dot_product_attention (flash / memory-efficient kernels)
    mlp_act_saved: int = 0  # extra 4h-wide tensors the MLP activation saves (UNFUSED_MLP_ACTIVATIONS)


def transformer_shape(module: nn.Module, seq: Optional[int] = None) -> Optional[TransformerShape]:
    """Read layers/hidden/heads/vocab from a GPT-like module (the recipe GPT or similar); None otherwise."""
    lists = [m for m in module.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    emb = next((m for m in module.modules() if isinstance(m, nn.Embedding)), None)
    if not lists or emb is None:
        return None
    blocks = max(lists, key=len)
    heads = next((int(getattr(m, a)) for m in blocks[0].modules()
                  for a in ("n_head", "num_heads", "num_attention_heads") if hasattr(m, a)), 1)
    block_size = next((int(m.block_size) for m in module.modules() if hasattr(m, "block_size")), None)
    dropout = any(isinstance(m, nn.Dropout) and m.p > 0 for m in module.modules())
    act_saved = max((UNFUSED_MLP_ACTIVATIONS.get(type(m).__name__, 0) for m in blocks[0].modules()), default=0)
    return TransformerShape(len(blocks), emb.embedding_dim, heads, seq or block_size or 1, emb.num_embeddings, dropout,
                            mlp_act_saved=act_saved)


def activation_bytes_per_layer(shape: TransformerShape, micro_batch: int, act_bytes: int = 2) -> float:
    """Korthikanti et al. 2022, section 4.1 (see module docstring), adjusted for dropout and fused attention."""
    s, b, h, a = shape.seq, micro_batch, shape.hidden, shape.heads
    scale = act_bytes / 2
    sbh = 34 if shape.dropout else 32  # 16-bit accounting; masks are 1 byte (2 of the 34 are the two sbh masks)
    per = s * b * h * sbh * scale if not shape.dropout else s * b * h * (32 * scale + 2)
    if not shape.fused_attention:  # softmax output (+ dropout mask and output): 2as²b (+3as²b) at 16 bits
        per += a * s * s * b * (2 * scale + (1 + 2 * scale if shape.dropout else 0))
    per += shape.mlp_act_saved * 4 * s * b * h * act_bytes  # an unfused MLP activation's intermediates (4h wide)
    return per


def activation_bytes(shape: TransformerShape, micro_batch: int, act_bytes: int = 2) -> float:
    """Activation bytes of one micro-batch at their peak, the start of backward: every layer's saved tensors plus
    the output layer's (2h + 3V per token: final LayerNorm input and output, log-softmax output, its gradient and
    the logits' gradient; see the module docstring)."""
    head = shape.seq * micro_batch * (2 * shape.hidden + 3 * shape.vocab) * act_bytes
    return shape.layers * activation_bytes_per_layer(shape, micro_batch, act_bytes) + head


