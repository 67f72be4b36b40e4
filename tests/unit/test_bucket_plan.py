"""Stages 0-2 bucketing (core/plan.py ``flat_buckets``): a param group spread thinly over the model (the biases and
norms of a no-weight-decay group, as every GPT recipe has) must not make one bucket that completes only at the end of
backward; buckets are launched in the order they complete.

Before issue 16 the no-decay group of Hugging Face GPT-2 was one 0.12 MiB bucket holding ``ln_f.bias`` ...
``h.0.ln_1.weight``, first in launch order: since reductions launch in bucket order, no reduction could start before
the end of backward (no overlap at all).
"""

from __future__ import annotations

from torch import nn

from lightning_shard.core.plan import bucketed_trainable, flat_buckets


class Deep(nn.Module):
    """``depth`` blocks of a weight (``width x width``) and a bias; the weights are group 0, the biases group 1."""

    def __init__(self, depth: int = 12, width: int = 64) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))


def _plan(model: nn.Module, bucket_bytes: int):
    owner = {id(p): (0, 0 if p.dim() >= 2 else 1) for p in model.parameters()}
    return owner, flat_buckets(model, owner, bucket_bytes)


def test_thin_group_is_cut_as_backward_walks_and_buckets_launch_as_they_complete():
    model = Deep()
    weight_bytes = 64 * 64 * 4
    bucket_bytes = 3 * weight_bytes  # ~3 blocks of the model per bucket
    owner, buckets = _plan(model, bucket_bytes)
    walk = list(reversed(bucketed_trainable(model, owner)))
    pos = {id(p): i for i, p in enumerate(walk)}
    sizes = [p.numel() * 4 for p in walk]
    # every parameter in exactly one bucket, each bucket of one group
    assert sorted(pos[id(p)] for _, ps in buckets for p in ps) == list(range(len(walk)))
    assert all(len({owner[id(p)] for p in ps}) == 1 for _, ps in buckets)
    # the bias group is cut into several buckets, not one spanning the whole model
    bias_buckets = [ps for key, ps in buckets if key == (0, 1)]
    assert len(bias_buckets) >= 3, [len(ps) for ps in bias_buckets]
    for _, ps in buckets:  # each bucket closes within bucket_bytes (+ one parameter) of model walked since it opened
        first, end = pos[id(ps[0])], pos[id(ps[-1])]
        assert sum(sizes[first:end]) < bucket_bytes + max(sizes), (first, end)
    ends = [pos[id(ps[-1])] for _, ps in buckets]
    assert ends == sorted(ends)  # launch order = completion order in the walk


def test_one_group_keeps_the_plain_size_rule():
    model = Deep(depth=4)
    owner = {id(p): (0, 0) for p in model.parameters()}
    nbytes = (64 * 64 + 64) * 4  # one block
    buckets = flat_buckets(model, owner, 2 * nbytes)
    assert [len(ps) for _, ps in buckets] == [4, 4]  # two blocks (weight + bias each) per bucket, as before
    assert [p for _, ps in buckets for p in ps] == list(reversed(list(model.parameters())))


def test_gpt2_first_bucket_completes_early():
    transformers = __import__("pytest").importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=1024, n_positions=64,
                                  bos_token_id=1023, eos_token_id=1023)
    model = transformers.GPT2LMHeadModel(cfg)
    owner, buckets = _plan(model, 1 << 20)
    walk = {id(p): i for i, p in enumerate(reversed(bucketed_trainable(model, owner)))}
    first_end = max(walk[id(p)] for p in buckets[0][1])
    assert first_end < len(walk) // 2, (first_end, len(walk))  # launched mid-backward, not at its end
