"""``activation_checkpointing`` (issue 15): a knob of every strategy that recomputes the chosen blocks' activations in
backward (engine/activation.py).

On models the project did not write (Hugging Face GPT-2, torch's ``nn.TransformerEncoder`` whose
``nn.MultiheadAttention`` reads ``out_proj.weight`` itself), every other knob at its default, fp32 SGD with momentum:

- parity: rank 0's ``model.state_dict()`` after ``fit`` equals one process's to 1e-5 and the same strategy's without
  the knob to 1e-6, with ``"auto"`` and with a class list, with and without gradient accumulation;
- the recomputation happens: a module inside a checkpointed block runs twice per micro-batch (once without);
- stage 3 gathers every unit once in forward and once in backward, with or without the recomputation (ledger
  all-gathers per bucket tag and micro-batch are the same), and no unit counts as run twice in a pass; the one
  exception, frozen units before the first trainable one inside a checkpointed block (their forward is recomputed,
  so they are gathered in backward, where without checkpointing they need none), is measured too;
- names: the parameter names are the unwrapped model's, checkpoints load across strategies with and without the knob,
  and the original forwards are back after fit;
- errors: bad values at construction, a class name matching no module at setup, with the message.

One World of 2 ranks for the module; each fit takes well under a second.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from lightning_shard.engine import activation
from lightning_shard.strategies import AutoStrategy, FSDPShardStrategy, Zero0Strategy, Zero2Strategy, Zero3Strategy
from tests.ac_scenarios import fit_ac, load_ac, setup_error
from tests.foreign import diff, reference_state

STEPS = 4
TOL = 1e-5  # against one process ("Design rules" 8)
SAME = 1e-6  # against the same strategy without the knob: the recomputation repeats the same arithmetic
STRATEGIES = ["zero0", "zero1", "zero2", "zero3", "fsdp_shard"]
# model -> (the class list given instead of "auto", a module inside the first block, the blocks "auto" finds)
MODELS = {
    "hf_gpt2": (["GPT2Block"], "net.transformer.h.0.ln_1", ["net.transformer.h.0", "net.transformer.h.1"]),
    "torch_encoder": ([nn.TransformerEncoderLayer], "net.encoder.layers.0.linear1",
                      ["net.encoder.layers.0", "net.encoder.layers.1"]),
}
CASES = [("auto", 1), ("auto", 2), ("classes", 2)]  # (knob, accumulate_grad_batches)

_RUNS: dict = {}


def run(worlds, name: str, strategy: str, acc: int, knob) -> list[dict]:
    """One fit per (model, strategy, accumulation, knob) for the whole module."""
    key = (name, strategy, acc, knob)
    if key not in _RUNS:
        value = {None: None, "auto": "auto", "classes": MODELS[name][0]}[knob]
        _RUNS[key] = worlds(2).run(fit_ac, name, strategy, STEPS, acc, value, MODELS[name][1])
    return _RUNS[key]


@functools.lru_cache(maxsize=None)
def reference(name: str, acc: int) -> dict[str, torch.Tensor]:
    return reference_state(name, STEPS, acc, 2)


@pytest.mark.parametrize("knob,acc", CASES, ids=[f"{k}-acc{a}" for k, a in CASES])
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", list(MODELS))
def test_parity_and_recomputation(worlds, name, strategy, knob, acc):
    res, plain = run(worlds, name, strategy, acc, knob), run(worlds, name, strategy, acc, None)
    state = res[0]["state"]
    assert diff(state, reference(name, acc)) <= TOL, f"{diff(state, reference(name, acc)):.3e} from one process"
    assert diff(state, plain[0]["state"]) <= SAME, f"{diff(state, plain[0]['state']):.3e} from no checkpointing"
    for r, p in zip(res, plain):
        assert r["checkpointed"] == MODELS[name][2]
        assert r["calls"] == [2] * STEPS * acc, r["calls"]  # forward + recomputation in backward
        assert p["calls"] == [1] * STEPS * acc and p["checkpointed"] == []
        assert r["left_patched"] == []  # teardown put the original forwards back


@pytest.mark.parametrize("strategy", ["zero3", "fsdp_shard"])
@pytest.mark.parametrize("name", list(MODELS))
def test_stage3_gathers_each_unit_once_per_pass(worlds, name, strategy):
    """zero3: a block holds several per-module units, gathered as the recomputation reaches them, once each;
    fsdp_shard: the block is the unit, gathered for its backward before the recomputation runs. The step's root unit
    is gathered in forward only: it stays gathered into backward."""
    for knob in ("auto", "classes"):
        res, plain = run(worlds, name, strategy, 2, knob), run(worlds, name, strategy, 2, None)
        for r, p in zip(res, plain):
            assert r["gathers"] == p["gathers"], knob  # per micro-batch: (forward|backward, bucket tag) -> count
            for per_batch in r["gathers"]:
                assert per_batch and set(per_batch.values()) == {1}, per_batch
                forward = {tag for phase, tag in per_batch if phase == "forward"}
                backward = {tag for phase, tag in per_batch if phase == "backward"}
                held = {tag for tag in forward if r["unit_of"][tag] in r["step_units"]}  # kept into backward
                assert forward - held == backward, (forward ^ backward, held)
            assert r["resident"] == []  # the recomputation is not a second forward of a unit in the pass
        units = {tag for phase, tag in res[0]["gathers"][0]}
        # zero3: several units per GPT-2 block; torch's encoder layer reads its children's weights itself (its fast
        # path), so under zero3 too each layer is one unit (with the embedding and the head: 4)
        assert len(units) > (4 if strategy == "zero3" and name == "hf_gpt2" else 2), units


def test_zero3_frozen_units_before_the_first_trainable_one_join_the_backward_schedule(worlds):
    """The exception: without checkpointing, frozen units before the first trainable one need no backward and are not
    gathered in it; a checkpointed block that holds them recomputes their forward, so they are gathered once in
    backward too. They join the backward schedule in the first backward (like any unit found to need one), so later
    steps issue them in order with the others."""
    res, plain = (worlds(2).run(fit_ac, "adapters", "zero3", STEPS, 2, ac) for ac in ("auto", None))
    frozen = {"net.blocks.0.base"}  # the frozen norm is in the block's unit with the adapter (min_unit_mb)
    assert diff(res[0]["state"], reference_state("adapters", STEPS, 2, 2)) <= TOL
    assert diff(res[0]["state"], plain[0]["state"]) <= SAME
    for r, p in zip(res, plain):
        for ours, theirs in zip(r["gathers"], p["gathers"]):
            assert set(ours.values()) == {1} and set(theirs.values()) == {1}  # no unit gathered twice in a phase
            extra = {(phase, r["unit_of"][tag]) for phase, tag in set(ours) - set(theirs)}
            assert extra == {("backward", u) for u in frozen} and set(theirs) <= set(ours), extra
        assert frozen <= set(r["backward_schedule"]) and not frozen & set(p["backward_schedule"])


def test_strategy_auto_takes_the_knob(worlds):
    res = worlds(2).run(fit_ac, "hf_gpt2", "zero_auto", STEPS, 2, "auto", MODELS["hf_gpt2"][1])
    assert res[0]["checkpointed"] == MODELS["hf_gpt2"][2] and res[0]["calls"] == [2] * STEPS * 2
    assert diff(res[0]["state"], reference("hf_gpt2", 2)) <= TOL


def test_checkpoints_load_across_strategies_with_and_without_the_knob(worlds, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ac_ckpt")
    for (src, src_knob), (dst, dst_knob) in [(("fsdp_shard", "auto"), ("zero2", None)),
                                             (("zero1", None), ("zero3", ["GPT2Block"]))]:
        path = str(tmp / f"{src}.ckpt")
        saved = worlds(2).run(fit_ac, "hf_gpt2", src, STEPS, 2, src_knob, None, path)[0]["state"]
        loaded = worlds(2).run(load_ac, "hf_gpt2", dst, STEPS, 2, path, dst_knob)[0]
        assert diff(loaded, saved) == 0.0, (src, dst)


def test_a_class_name_matching_nothing_fails_at_setup_with_the_model_classes(worlds):
    for msg in worlds(2).run(setup_error, "hf_gpt2", "zero3", ["GPT2Blok"]):
        assert "activation_checkpointing=['GPT2Blok']: 'GPT2Blok' matched no module of the model" in msg, msg
        assert "did you mean 'GPT2Block'" in msg and "'GPT2MLP'" in msg, msg


def test_auto_without_blocks_checkpoints_nothing_and_says_so(worlds):
    res = worlds(2).run(fit_ac, "mlp", "zero2", 2, 1, "auto")
    assert res[0]["checkpointed"] == [] and res[0]["calls"] == [0, 0]
    assert any("found no block" in w for w in res[0]["warnings"]), res[0]["warnings"]
    assert diff(res[0]["state"], reference_state("mlp", 2, 1, 2)) <= TOL


BAD = [
    (True, "got True; for the transformer blocks use 'auto'"),
    (False, "got False; use None to turn it off"),
    ([], "got []"),
    ("", "nor a class name: ['']"),
    (5, "got 5"),
    ([nn.Linear, 3], "nor a class name: [3]"),
    ([torch.Tensor], "nor a class name: [<class 'torch.Tensor'>]"),
    (["auto"], "nor a class name: ['auto']"),
]


@pytest.mark.parametrize("cls", [Zero0Strategy, Zero2Strategy, Zero3Strategy, FSDPShardStrategy, AutoStrategy])
@pytest.mark.parametrize("value,message", BAD, ids=[repr(v) for v, _ in BAD])
def test_bad_values_fail_at_construction(cls, value, message):
    with pytest.raises(ValueError, match=r"activation_checkpointing must be None \(off\), 'auto'") as err:
        cls(activation_checkpointing=value)
    assert message in str(err.value)


@pytest.mark.parametrize("value,expected", [("auto", "auto"), ("GPT2Block", ["GPT2Block"]),
                                            (nn.Linear, [nn.Linear]), (("A", nn.GELU), ["A", nn.GELU])])
def test_values_are_normalised(value, expected):
    assert Zero3Strategy(activation_checkpointing=value).options.activation_checkpointing == expected


class _Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class _Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.ModuleList([_Inner(), _Inner()])
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m in self.inner:
            x = m(x)
        return self.head(x)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Outer(), _Outer()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(b(x) for b in self.blocks)


def test_outermost_blocks_only_same_names_same_gradients_and_undone():
    torch.manual_seed(0)
    net, x = _Net(), torch.randn(3, 4)
    names = [n for n, _ in net.named_parameters()]
    net(x).sum().backward()
    want = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    done = activation.apply(net, "auto")  # ModuleLists hold _Outer and, inside them, _Inner: _Outer only
    assert [n for n, _ in done.modules] == ["blocks.0", "blocks.1"]
    assert "_Outer x 2" in done.describe()
    assert [n for n, _ in net.named_parameters()] == names and list(net.state_dict()) == names
    calls = []
    net.blocks[0].inner[0].register_forward_pre_hook(lambda *a: calls.append(1))
    net(x).sum().backward()
    assert len(calls) == 2 and all(torch.equal(p.grad, g) for p, g in zip(net.parameters(), want))
    with torch.no_grad():  # no backward to recompute for: the plain forward
        net(x)
    net.eval()
    net(x).sum().backward()  # not a training forward: plain too
    assert len(calls) == 4
    net.train()
    assert activation.apply(net, [_Inner]).modules and activation.checkpointed(net.blocks[0].inner[1])
    done.remove()
    assert not activation.checkpointed(net.blocks[0])
