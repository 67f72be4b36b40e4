"""What the stage-3 plan makes of code nobody on the project wrote (issue 11): parameters read by a parent's code,
leaf modules, models without blocks, ranks that run different experts, parameters that get no gradient.

Single-process tests look at the plan; the distributed ones prove that the situation they claim really happens
(ranks ran different experts; a parameter really got no gradient) before checking the result.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_shard.engine.zero3.plan import describe_plan, plan_units
from lightning_shard.engine.zero3.reads import child_parameter_reads
from tests.foreign import fit_foreign, reference_state


# ------------------------------------------------------------------------------------------ the plan (1 process)
class _Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # reads its child's weight instead of calling the child
        return F.linear(x, self.proj.weight * self.scale, self.proj.bias)


def test_parent_reads_of_child_weights_join_the_parents_unit():
    mha = nn.MultiheadAttention(8, 2)
    assert set(child_parameter_reads(mha)) == {"out_proj.weight", "out_proj.bias"}
    assert set(child_parameter_reads(_Head())) == {"proj.weight", "proj.bias"}
    model = nn.ModuleDict({"attn": nn.MultiheadAttention(8, 2), "head": _Head()})
    units = {s.name: s.names for s in plan_units(model, "zero3")}
    assert "attn.out_proj" not in units and "head.proj" not in units, units
    assert set(units["attn"]) >= {"attn.in_proj_weight", "attn.out_proj.weight", "attn.out_proj.bias"}
    assert set(units["head"]) == {"head.scale", "head.proj.weight", "head.proj.bias"}
    # fsdp: the Linear wrap class would have cut out_proj off its reader; the reader's unit keeps it
    units = {s.name: s.names for s in plan_units(model, "fsdp", ["Linear"])}
    assert "attn.out_proj" not in units and "head.proj" not in units, units


def test_a_reader_without_parameters_of_its_own_becomes_a_unit():
    class Reader(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(3, 3)

        def forward(self, x):
            return x @ self.inner.weight.t()

    model = nn.Sequential(nn.Linear(3, 3), Reader())
    units = {s.name: s.names for s in plan_units(model, "zero3")}
    assert units["1"] == ["1.inner.weight"] and units["1.inner"] == ["1.inner.bias"], units  # only what is read


def test_leaf_modules_make_one_unit_of_a_subtree():
    model = nn.Sequential(nn.Linear(3, 3), nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3)), nn.Linear(3, 3))
    plan = [s.name for s in plan_units(model, "zero3", leaf_modules=["1"])]
    assert plan == ["0", "1", "2"], plan
    plan = [s.name for s in plan_units(model, "fsdp", "auto", leaf_modules=["LayerNorm"])]
    assert plan == ["<root>", "1.1"], plan
    with pytest.raises(ValueError, match=r"leaf_modules=\['Nope'\] matched no module.*Linear"):
        plan_units(model, "zero3", leaf_modules=["Nope"])


def test_a_compiled_block_is_one_zero3_unit():
    """Each unit boundary inside a compiled module is a graph break (the hooks run eagerly), so zero3 makes a
    compiled block one unit, whether compiled in place or wrapped by torch.compile; a compiled module that holds
    the blocks keeps its units; fsdp's plan does not change."""

    def model() -> nn.Module:
        blocks = nn.ModuleList(nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 4)) for _ in range(3))
        return nn.ModuleDict({"body": nn.ModuleDict({"blocks": blocks}), "head": nn.Linear(4, 2)})

    m = model()
    plain = [s.name for s in plan_units(m, "zero3")]
    assert "body.blocks.0.1" in plain and "body.blocks.0" not in plain
    m.body.blocks[0].compile()
    m.body.blocks[2] = torch.compile(m.body.blocks[2])
    units = {s.name: len(s.params) for s in plan_units(m, "zero3")}
    assert units["body.blocks.0"] == 6 and units["body.blocks.2"] == 6, units
    assert not any(n.startswith(("body.blocks.0.", "body.blocks.2.")) for n in units), units
    assert "body.blocks.1.0" in units and "head" in units  # not compiled: per module, as before
    m = model()
    m.body.compile()  # the blocks' holder: its units stay (each is a graph break inside the compiled forward)
    assert [s.name for s in plan_units(m, "zero3")] == plain
    m.body.blocks[1].compile()
    assert [s.name for s in plan_units(m, "fsdp", "auto")] == [s.name for s in plan_units(model(), "fsdp", "auto")]


def test_fsdp_auto_without_blocks_is_one_unit_and_says_so():
    model = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 4))
    specs = plan_units(model, "fsdp", "auto")
    assert [s.name for s in specs] == ["<root>"] and len(specs[0].params) == 3
    assert "whole model is one unit" in describe_plan(specs, "fsdp")
    blocks = nn.Sequential(nn.Embedding(5, 4), nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)]))
    assert "2 x Linear" in describe_plan(plan_units(blocks, "fsdp", "auto"), "fsdp")


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)  # 2 x width: small
        self.attn = nn.Sequential(nn.Linear(width, width // 8), nn.Linear(width // 8, width))  # 2 small Linears
        self.mlp = nn.Linear(width, 4 * width)  # large


def _tower(width: int = 512, depth: int = 4) -> nn.Module:
    return nn.Sequential(nn.Embedding(256, width), nn.ModuleList(_Block(width) for _ in range(depth)),
                         nn.LayerNorm(width))


def _sizes(specs) -> dict[str, int]:
    return {s.name: sum(p.numel() * 4 for p in s.params) for s in specs}


def test_small_modules_join_the_unit_of_a_module_enclosing_them():
    """zero3 with ``min_unit_mb``: a module whose unit would hold less joins its parent's unit, bottom-up; a parent
    with enough becomes a unit (here the small attention pair); what reaches the top goes to the root unit; a module
    at least that large stays a unit of its own; containers never become units; 0 keeps one unit per module."""
    model = _tower()  # width 512: embedding 512 KiB; mlp 4 MiB + 8 KiB; attn pair 258 KiB; norms 4 KiB
    per_module = [s.name for s in plan_units(model, "zero3")]
    assert {"1.0.norm", "1.0.attn.0", "1.0.attn.1", "1.0.mlp", "0", "2"} <= set(per_module)
    merged = _sizes(plan_units(model, "zero3", min_unit_bytes=2**18))  # 256 KiB
    assert set(merged) == {"<root>", "0", *(f"1.{i}.{m}" for i in range(4) for m in ("attn", "mlp"))}, merged
    assert all(merged[f"1.{i}.attn"] == (2 * 512 * 64 + 64 + 512) * 4 for i in range(4))
    assert merged["<root>"] == 4 * 2 * 512 * 4 + 2 * 512 * 4  # the blocks' norms and the last norm
    # every parameter exactly once, whatever the plan
    assert sum(merged.values()) == sum(p.numel() * 4 for p in model.parameters())
    # with a larger minimum a block's norm and attention pair (262 KiB) are still too small: up to the root they go,
    # all blocks' together (one gather per pass for all of them, held for the step)
    coarse = _sizes(plan_units(model, "zero3", min_unit_bytes=2**19))
    assert set(coarse) == {"<root>", "0", *(f"1.{i}.mlp" for i in range(4))}, coarse
    assert coarse["<root>"] == 4 * (merged["1.0.attn"] + 2 * 512 * 4) + 2 * 512 * 4
    # leaves stay whole units whatever their size
    assert "1.0.norm" in _sizes(plan_units(model, "zero3", min_unit_bytes=2**18, leaf_modules=["1.0.norm"]))


def test_merging_never_takes_a_unit_above_a_64th_of_the_model():
    """A small model keeps several units: the minimum is bounded by 1/64 of its parameter bytes."""
    model = _tower(width=64)  # 0.2 MiB in all: a 1 MiB minimum would make it one unit
    total = sum(p.numel() * 4 for p in model.parameters())
    plan = _sizes(plan_units(model, "zero3", min_unit_bytes=2**20))
    assert len(plan) > 4 and all(b >= total / 64 for n, b in plan.items() if n != "<root>"), plan
    assert "1.0.mlp" in plan and "1.0.norm" not in plan  # 65 KiB >= 1/64 of 0.2 MiB; 512 B is not


def test_completion_order_puts_enclosing_units_after_what_they_enclose():
    from lightning_shard.engine.zero3.schedule import completion_order

    names = {0: "emb", 1: "blocks.0", 2: "blocks.0.attn", 3: "blocks.0.mlp", 4: "blocks.1", 5: "blocks.1.mlp",
             6: "head"}
    assert completion_order([0, 1, 2, 3, 4, 5, 6], names) == [0, 2, 3, 1, 5, 4, 6]
    assert completion_order([0, 6], names) == [0, 6]  # nothing nested: the start order


def test_a_wrap_policy_that_matches_nothing_is_still_an_error():
    with pytest.raises(ValueError, match="matched no module"):
        plan_units(nn.Sequential(nn.Linear(2, 2)), "fsdp", ["Block"])


# ------------------------------------------------------------------------------------------ ranks that differ
def test_routed_experts_really_differ_between_ranks_and_zero3_matches(worlds):
    """The MoE case of the issue: an expert that gets tokens on one rank and none on the other in the same step.
    First prove it happens with this data, then that zero3 (default knobs) gives the one-process result."""
    pattern = r"net\.experts\.\d+"
    res = worlds(2).run(fit_foreign, "routed", "zero3", 4, 3, count_calls=pattern)
    ran = [r["calls"] for r in res]
    differing = [(mb, ran[0][mb] ^ ran[1][mb]) for mb in ran[0] if ran[0][mb] != ran[1][mb]]
    assert differing, ran  # in some micro-batch an expert ran on one rank only
    ref = reference_state("routed", 4, 3, 2)
    state = res[0]["state"]
    assert max(float((state[k] - ref[k]).abs().max()) for k in ref) <= 1e-5


def test_switch_transformer_experts_differ_between_ranks(worlds):
    res = worlds(2).run(fit_foreign, "hf_switch", "zero3", 4, 1,
                        count_calls=r"net\.(en|de)coder\.block\.\d\.layer\.\d\.mlp\.experts\.expert_\d")
    ran = [r["calls"] for r in res]
    assert any(ran[0][s] != ran[1][s] for s in ran[0]), ran


JOB = Path(__file__).parents[1] / "failure_job.py"


@pytest.mark.slow
def test_ranks_that_diverge_after_the_first_step_fail_naming_the_unit(tmp_path):
    """From step 3 on rank 1 alone runs a module twice: a gather outside the agreed schedule. Rank 1 refuses it
    with an error naming the unit before issuing it; rank 0 then fails on the closed connection: no hang."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("LOCAL_RANK", None)
    proc = subprocess.run([sys.executable, str(JOB), "diverge", str(tmp_path)], capture_output=True, text=True,
                          env=env, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "RANK1 STEP 3" in out and "RANK1 STEP 4" not in out, out[-3000:]
    assert "rank 1: lightning_shard must gather unit 'net.0' outside the schedule" in out, out[-3000:]
    assert "leaf_modules" in out


# ------------------------------------------------------------------------------------------ no gradient, no step
@pytest.mark.parametrize("strategy", ["zero0", "zero1", "zero2", "zero3", "fsdp_shard"])
def test_parameters_without_gradients_keep_torchs_per_parameter_optimizer_state(worlds, strategy):
    """Adam, default knobs: a parameter that never gets a gradient has no optimizer state at all, one used on odd
    steps only has stepped exactly as often as in one process (Adam's bias correction depends on it)."""
    res = worlds(2).run(fit_foreign, "unused", strategy, 4, 3, "adam", with_optimizer=True)
    _, ref_opt = reference_state("unused", 4, 3, 2, "adam", with_optimizer=True)
    ours = res[0]["optimizer"]
    names = [n for n, p in __import__("tests.foreign", fromlist=["ForeignModule"]).ForeignModule("unused")
             .named_parameters() if p.requires_grad]
    never = {i for i, n in enumerate(names) if ".never." in n}
    odd = {i for i, n in enumerate(names) if ".odd." in n}
    assert never and odd
    assert set(ref_opt["state"]) == set(ours["state"]), (sorted(ref_opt["state"]), sorted(ours["state"]))
    assert not never & set(ours["state"])  # never stepped: no state, as torch
    for i, st in ref_opt["state"].items():
        assert float(ours["state"][i]["step"]) == float(st["step"]), (names[i], ours["state"][i]["step"], st["step"])
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.allclose(ours["state"][i][k], st[k], rtol=1e-5, atol=1e-9), (names[i], k)
    assert {float(ours["state"][i]["step"]) for i in odd} == {2.0}  # steps 1 and 3 of 4


# ------------------------------------------------------------------------------------------ the first-step guard
class _Indexed(nn.Module):
    """Reads a child's weight through indexing (``self.blocks[1].weight``), which the bytecode scan cannot see."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(6))
        self.blocks = nn.ModuleList([nn.Linear(6, 6), nn.Linear(6, 6)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.blocks[0](x)) * self.scale
        return h @ self.blocks[1].weight.t()  # blocks[1]'s own forward never runs


def fit_indexed() -> dict:
    """zero3 with default knobs on the ranks of a World; in a process without one, the plain reference (the same
    global batch of 2: one sample per rank there, two at once here)."""
    import lightning as L
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from lightning_shard.engine.comm import collectives as C

    class M(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(3)
            self.net = _Indexed()

        def training_step(self, batch, i):
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)

    world = C.get_world_size()
    data = TensorDataset(torch.randn(16, 6, generator=torch.Generator().manual_seed(0)))
    common = dict(max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False)
    module, hosts = M(), {}
    if not C.is_initialized():
        L.Trainer(accelerator="cpu", devices=1, **common).fit(module, DataLoader(data, batch_size=2))
        return {"state": module.state_dict()}

    class Peek(L.Callback):
        def on_train_end(self, trainer, pl_module):
            ctrl = trainer.strategy.engine.controller
            hosts.update({u.name: u.host.name for u in ctrl.units if u.host is not None})

    sampler = DistributedSampler(data, num_replicas=world, rank=C.get_rank(), shuffle=False)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy="zero3", use_distributed_sampler=False,
                        callbacks=[Peek()], **common)
    trainer.fit(module, DataLoader(data, batch_size=1, sampler=sampler))
    return {"state": module.state_dict(), "hosts": hosts}


def test_a_weight_read_the_scan_cannot_see_is_found_in_the_first_step(worlds):
    """``self.blocks[1].weight`` used by the parent's code: the first step's guard gathers it where it is used,
    and from then on it is gathered with its reader; the result is the one-process result."""
    res = worlds(2).run(fit_indexed)
    assert res[0]["hosts"] == {"net.blocks.1": "net"}, res[0]["hosts"]
    ref = fit_indexed()["state"]
    for r in res:
        assert max(float((r["state"][k] - ref[k]).abs().max()) for k in ref) <= 1e-5
