"""Lightning Fabric: every strategy under a plain Fabric loop with accumulation (``fabric.no_backward_sync``),
against one process; the same collectives per micro-batch as under the Trainer; the true global norm from
``fabric.clip_gradients``; checkpoints that move between Fabric and the Trainer in both directions; deferred init
with ``fabric.init_module(empty_init=True)``."""

from __future__ import annotations

import pytest
import torch

from tests import fabric_scenarios as fs
from tests import scenarios as sc
from tests.zoo import max_diff

WORLD, STEPS, ACC = 2, 3, 2
NAMES = ["zero0", "zero1", "zero2", "zero3", "fsdp_shard"]
TOL = 1e-5


@pytest.fixture(scope="module")
def world(worlds):
    return worlds(WORLD)


@pytest.fixture(scope="module")
def ref():
    cache: dict = {}

    def get(model: str, steps: int = STEPS, clip=None, optimizer: str = "adam", bf16_autocast: bool = False,
            precision: str = "32-true"):
        key = (model, steps, clip, optimizer, bf16_autocast, precision)
        if key not in cache:
            cache[key] = fs.reference(model, steps, ACC, WORLD, clip=clip, optimizer=optimizer,
                                      bf16_autocast=bf16_autocast, precision=precision)
        return cache[key]

    return get


def test_names_registered_in_fabric():
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    import lightning_shard  # noqa: F401 - registers the names
    from lightning_shard.strategies import FSDPShardFabricStrategy, Zero2FabricStrategy, Zero3FabricStrategy

    assert isinstance(STRATEGY_REGISTRY.get("zero2"), Zero2FabricStrategy)
    assert STRATEGY_REGISTRY.get("zero3").options.stage == 3
    assert STRATEGY_REGISTRY.get("fsdp_shard").options.wrap_classes == "auto"
    hybrid = STRATEGY_REGISTRY.get("zero3_hybrid")
    assert isinstance(hybrid, Zero3FabricStrategy) and hybrid.options.shard_size == "auto"
    assert isinstance(FSDPShardFabricStrategy(), Zero3FabricStrategy)
    with pytest.raises(TypeError, match=r"unknown option\(s\) 'bucket_mbb' \(did you mean 'bucket_mb'\?\)"):
        Zero2FabricStrategy(tuning={"bucket_mbb": 3})
    with pytest.raises(TypeError, match=r"unknown option\(s\) 'acumulation' \(did you mean 'accumulation'\?\)"):
        Zero2FabricStrategy(acumulation="defer")


@pytest.mark.parametrize("name", NAMES)
def test_parity_with_one_process(world, ref, name):
    """Default knobs, a LightningModule's training_step in the loop, 2 ranks x 2 micro-batches, Adam: the weights
    a user saves (model.state_dict()) equal one process's on the same global batch."""
    expected, _ = ref("tiny_lm")
    outs = world.run(fs.fabric_fit, name, ACC, STEPS)
    assert outs[0]["class"].endswith("FabricStrategy")
    for out in outs:
        assert max_diff(out["state"], expected) < TOL
    assert max_diff(outs[0]["initial"], outs[1]["initial"]) == 0.0


@pytest.mark.parametrize("name,knobs", [("zero0", None), ("zero1", None), ("zero2", {"accumulation": "defer"})])
def test_gradients_dropped_inside_a_window_stay_dropped(world, name, knobs):
    """The user throws a micro-batch's gradients away (``net.zero_grad(set_to_none=True)`` after its backward, inside
    ``no_backward_sync``): they must not reach the step, as in one process. zero0-2 keep ``.grad`` as views of a
    flat buffer; a view the user set to None is void, and the next gradient is copied over it, not added to it."""
    expected, _ = fs.reference("tiny_lm", STEPS, ACC, WORLD, discard_first=True)
    kept, _ = fs.reference("tiny_lm", STEPS, ACC, WORLD)
    assert max_diff(kept, expected) > 1e-4  # the dropped micro-batches would have moved the weights
    outs = world.run(fs.fabric_fit, name, ACC, STEPS, knobs=knobs, discard_first=True)
    for out in outs:
        assert max_diff(out["state"], expected) < TOL


def side_pattern(steps: int) -> list[list[list[bool]]]:
    """``[window][rank][micro-batch]``: whether BranchyLM runs its side layer there (the data decides)."""
    from tests.zoo import MICRO, dataset

    data = dataset(steps, ACC, WORLD, "tiny_lm").tensors[0]
    return [[[fs.uses_side(data[(s * ACC * WORLD + k * WORLD + r) * MICRO:][:MICRO]) for k in range(ACC)]
             for r in range(WORLD)] for s in range(steps)]


@pytest.mark.parametrize("name,knobs,discard_first", [(n, None, False) for n in NAMES] + [
    ("zero0", None, True), ("zero1", None, True), ("zero2", {"accumulation": "defer"}, True)])
def test_a_layer_some_micro_batches_skip(world, name, knobs, discard_first):
    """Default knobs, a layer the data decides to run or skip per micro-batch. zero0-2 never zero the gradient
    buffer in advance: a parameter's range holds a gradient only once one arrived in this window (copied in whole),
    and a range no gradient reached is zeroed just before the reduction. So a rank that used the layer in one
    window and not in the next must send zeros for it (not last window's gradient), a rank that skipped it while the
    other used it too, and a gradient the user dropped (``zero_grad(set_to_none=True)``) with no later one in the
    window leaves the parameter with no gradient at all, as in torch (Adam leaves it untouched)."""
    steps = 6
    use = side_pattern(steps)
    ran = [[any(use[s][r]) for r in range(WORLD)] for s in range(steps)]
    assert any(any(w) and not all(w) for w in ran)  # a window one rank uses the layer in and the other does not
    assert any(ran[s][r] and not ran[s + 1][r] and any(ran[s + 1]) for s in range(steps - 1) for r in range(WORLD))
    assert any(not any(w) for w in ran)  # a window nobody uses it in: left out of the step
    if discard_first:  # a window where only the dropped first micro-batches used it
        assert any(any(u[0] for u in w) and not any(u[1] for u in w) for w in use)
    expected, _ = fs.reference("branchy", steps, ACC, WORLD, discard_first=discard_first)
    outs = world.run(fs.fabric_fit, name, ACC, steps, model="branchy", knobs=knobs, discard_first=discard_first)
    for out in outs:
        assert max_diff(out["state"], expected) < TOL


@pytest.mark.parametrize("name,model", [("zero3", "torch_lm"), ("fsdp_shard", "torch_lm"), ("zero2", "gpt")])
def test_parity_on_plain_modules(world, ref, name, model):
    """Models that are not LightningModules: torch's own TransformerEncoderLayer (MultiheadAttention), the GPT.
    SGD with momentum: the update is linear in the gradient, so only summation order differs (Adam's division by
    sqrt(v) + 1e-6 magnifies that to ~2e-5 on this model)."""
    expected, _ = ref(model, optimizer="sgd")
    out = world.run(fs.fabric_fit, name, ACC, STEPS, model=model, optimizer="sgd")[0]
    assert max_diff(out["state"], expected) < 1e-6


BLOCKS = {"wrap_classes": ["Block"]}


@pytest.mark.parametrize("name,stage,kw,clip", [("zero1", 1, {}, None), ("zero2", 2, {}, None), ("zero3", 3, {}, None),
                                               ("fsdp_shard", 3, BLOCKS, None), ("zero2", 2, {}, 0.05),
                                               ("zero3", 3, {}, 0.05)])
def test_same_collectives_per_micro_batch_as_the_trainer(world, name, stage, kw, clip):
    """Accumulation-aware sync: the non-boundary micro-batch (inside no_backward_sync) and the boundary one issue
    exactly the Trainer's collectives, with the same bytes, under the same default policy; with clipping too
    (fabric.clip_gradients before optimizer.step: one norm all-reduce, one used-mask exchange, as the Trainer)."""
    knobs = sc.merge_options({"tuning": {"bucket_mb": sc.SMALL_BUCKETS}}, kw)
    fab = world.run(fs.fabric_fit, name, ACC, STEPS, knobs=knobs, clip=clip)[0]
    trainer = world.run(sc.fit_zero, stage, "auto", ACC, STEPS, optimizer="adam", model="tiny_lm",
                        bucket_mb=sc.SMALL_BUCKETS, strategy_kwargs=kw, clip=clip)[0]
    assert fab["policy"] == trainer["policy"]
    assert len(fab["per_batch"]) == len(trainer["per_batch"]) == STEPS * ACC
    for k, (a, b) in enumerate(zip(fab["per_batch"], trainer["per_batch"])):
        assert sorted(a) == sorted(b), f"micro-batch {k}"
    assert not any(tag.startswith("grad_bucket") for _, tag, _ in fab["per_batch"][0])  # deferred: nothing moves
    if clip:  # one norm all-reduce per optimizer step, not two (clip_gradients and the step share one check)
        assert [tag for _, tag, _ in fab["per_batch"][1]].count("grad_norm") == 1


@pytest.mark.parametrize("name", ["zero2", "zero3"])
def test_clip_gradients_is_the_global_norm(world, ref, name):
    expected, norms = ref("tiny_lm", clip=0.05)
    assert min(norms) > 0.05  # the clip is active on every step
    out = world.run(fs.fabric_fit, name, ACC, STEPS, clip=0.05)[0]
    assert out["norms"] == pytest.approx(norms, rel=1e-5)
    assert max_diff(out["state"], expected) < TOL


def test_setup_module_then_setup_optimizers(world, ref):
    expected, _ = ref("tiny_lm")
    out = world.run(fs.fabric_fit, "zero3", ACC, STEPS, separate_setup=True)[0]
    assert max_diff(out["state"], expected) < TOL


@pytest.mark.parametrize("state_dict_type", ["sharded", "dcp"])
def test_fabric_checkpoint_resumes_under_the_trainer(world, ref, tmp_path, state_dict_type):
    """fabric.save after 3 steps (zero2; our sharded directory or torch.distributed.checkpoint's); a Trainer with
    zero3 loads it and trains 3 more: equal to 6 uninterrupted steps in one process."""
    expected, _ = ref("tiny_lm", steps=2 * STEPS)
    ckpt = str(tmp_path / "fabric.ckpt")
    world.run(fs.fabric_fit, "zero2", ACC, STEPS, save_to=ckpt, save_step=STEPS,
              knobs={"state_dict_type": state_dict_type})
    assert (tmp_path / "fabric.ckpt" / (".metadata" if state_dict_type == "dcp" else "meta.json")).is_file()
    assert (tmp_path / "fabric.ckpt").is_dir()
    out = world.run(sc.fit_zero, 3, "auto", ACC, STEPS, optimizer="adam", model="tiny_lm", resume_from=ckpt,
                    data_steps=2 * STEPS, first_step=STEPS)[0]
    assert max_diff(out["state"], expected) < TOL


def test_trainer_checkpoint_resumes_under_fabric(world, ref, tmp_path):
    """Trainer zero1 saves after 3 steps; Fabric fsdp_shard loads model and optimizer and trains 3 more."""
    expected, _ = ref("tiny_lm", steps=2 * STEPS)
    ckpt = str(tmp_path / "trainer.ckpt")
    world.run(sc.fit_zero, 1, "auto", ACC, STEPS, optimizer="adam", model="tiny_lm", save_to=ckpt)
    outs = world.run(fs.fabric_fit, "fsdp_shard", ACC, STEPS, load_from=ckpt, first_step=STEPS)
    assert outs[0]["loaded"]["global_step"] == STEPS  # what the checkpoint held beyond model and optimizer
    for out in outs:
        assert max_diff(out["state"], expected) < TOL


def test_fabric_round_trip_between_strategies(world, ref, tmp_path):
    """Fabric zero3 saves; Fabric zero1 resumes: the same result as one uninterrupted process."""
    expected, _ = ref("tiny_lm", steps=2 * STEPS)
    ckpt = str(tmp_path / "f3.ckpt")
    world.run(fs.fabric_fit, "zero3", ACC, STEPS, save_to=ckpt, save_step=STEPS)
    out = world.run(fs.fabric_fit, "zero1", ACC, STEPS, load_from=ckpt, first_step=STEPS)[0]
    assert out["loaded"]["step"] == STEPS
    assert max_diff(out["state"], expected) < TOL


@pytest.mark.parametrize("name", ["zero3", "fsdp_shard"])
def test_empty_init_materializes_shard_by_shard(world, ref, name):
    """fabric.init_module(empty_init=True) at stage 3: created on the meta device, materialized at set-up with the
    values a full init draws; training then matches one process."""
    expected, _ = ref("stack")
    outs = world.run(fs.fabric_fit, name, ACC, STEPS, model="stack", empty_init=True)
    for out in outs:
        assert max_diff(out["state"], expected) < TOL
    plain = world.run(fs.fabric_fit, name, ACC, 0, model="stack")[0]
    assert max_diff(outs[0]["initial"], plain["initial"]) == 0.0


def test_bf16_mixed_is_autocast(world, ref):
    """Fabric's bf16-mixed plugin computes under autocast through our module wrapper: equal to a one-process bf16
    autocast run, not to the fp32 one (a path that dropped autocast would match fp32 instead)."""
    expected, _ = ref("tiny_lm", bf16_autocast=True)
    fp32, _ = ref("tiny_lm")
    out = world.run(fs.fabric_fit, "zero2", ACC, STEPS, precision="bf16-mixed")[0]
    assert max_diff(out["state"], expected) < 1e-4
    assert max_diff(expected, fp32) > 1e-3


@pytest.mark.parametrize("precision,clip,param_dtype", [("bf16-true", None, torch.bfloat16),
                                                        ("16-mixed", 0.05, torch.float32)])
def test_half_precision_matches_its_reference(world, ref, precision, clip, param_dtype):
    """bf16-true (bf16 parameters, fp32 masters: model.state_dict() shows the masters) and fp16 autocast (a real
    ``MixedPrecision("16-mixed")`` plugin: the string falls back to bf16 on CPU) with our agreed loss scaler and
    clipping on unscaled gradients, against one process doing the same arithmetic in plain torch
    (fs.half_reference), to the fp32 parity bound TOL. Measured: bf16-true bitwise equal (0), fp16 2.8e-7 (the sum
    over ranks in another order, amplified by Adam in near-zero gradients). That reference is 2.1e-2 (bf16-true) and
    2.7e-3 (fp16) from the fp32 run, and 0.15 from the initial weights (3 Adam steps, lr 0.05 on the vectors), so a
    run that computed in fp32, or did not train, is hundreds of TOLs from it: the bound tells them apart."""
    expected, ref_norms = ref("tiny_lm", clip=clip, precision=precision)
    fp32, _ = ref("tiny_lm", clip=clip)
    out = world.run(fs.fabric_fit, "zero3", ACC, STEPS, precision=precision, clip=clip)[0]
    assert out["param_dtype"] == str(param_dtype)  # what the module computes with
    assert all(v.dtype == torch.float32 for v in out["state"].values())
    assert all(torch.isfinite(v).all() for v in out["state"].values())
    assert max_diff(expected, out["initial"]) > 1000 * TOL  # the reference trains far beyond the bound
    assert max_diff(expected, fp32) > 100 * TOL  # and the bound tells this precision from fp32
    d_ref, d_fp32 = max_diff(out["state"], expected), max_diff(out["state"], fp32)
    assert max_diff(out["state"], out["initial"]) > 1000 * TOL, "the run did not train"
    assert d_fp32 > 100 * d_ref, (d_fp32, d_ref)  # closer to its precision's reference than to the fp32 run
    assert d_ref <= TOL, d_ref
    if clip is not None:
        assert min(ref_norms) > clip  # clipping acts on every step
        assert out["norms"] == pytest.approx(ref_norms, rel=1e-5)  # the true norm, of unscaled fp16 gradients


def test_second_optimizer_setup_is_refused_with_advice(world):
    with pytest.raises(RuntimeError, match=r"set up all optimizers together: fabric.setup\(model, opt1, opt2\)"):
        world.run(fs.two_setups)


@pytest.mark.parametrize("name", ["zero2", "zero3"])
def test_two_backwards_without_no_backward_sync_sum_as_under_ddp(world, name):
    """Each backward is a boundary and reduces; the second adds its average to the first's (torch's contract, which
    DDP meets because its all-reduces are linear): the weights after the step are Fabric ddp's."""
    ours = world.run(fs.double_backward, name)[0]
    peer = world.run(fs.double_backward, "ddp")[0]
    assert max_diff(ours["state"], peer["state"]) <= 1e-6
    assert ours["reductions"] > 0 and ours["reductions"] % 2 == 0  # every bucket reduced by each backward


@pytest.mark.parametrize("name", NAMES)
def test_compiled_blocks_train_like_eager(world, ref, name):
    """torch.compile of each block (in place, names unchanged; the aot_eager backend: dynamo's tracing and AOT
    autograd without inductor's C++ build): the same weights as one eager process. The engine's hooks run eagerly
    outside the compiled graph: the wait for the post-step parameter gather (zero1/2), the gather and free of a
    unit at the start and end of its forward (zero3/fsdp_shard; zero3 makes each compiled block one unit)."""
    expected, _ = ref("tiny_lm")
    out = world.run(fs.fabric_fit, name, ACC, STEPS, compile_backend="aot_eager")[0]
    assert max_diff(out["state"], expected) < TOL
    # no graph breaks inside a block, and one graph for the two blocks in every step: the first step runs eagerly
    # (the engine discovers its plan there), so nothing is compiled again once the schedule is fixed
    assert (out["graph_breaks"], out["frames"]) == (0, 1), out["break_reasons"]


@pytest.mark.parametrize("name", ["zero2", "zero3", "fsdp_shard"])
def test_a_compiled_torch_encoder_layer_trains_like_eager(world, ref, name):
    """torch's own nn.TransformerEncoderLayer (MultiheadAttention reads its out_proj's weight itself) compiled in
    place, default knobs: zero3 makes it one unit, fsdp_shard keeps the whole model one unit (no block list)."""
    expected, _ = ref("torch_lm", optimizer="sgd")
    out = world.run(fs.fabric_fit, name, ACC, STEPS, model="torch_lm", optimizer="sgd",
                    compile_backend="aot_eager")[0]
    assert max_diff(out["state"], expected) < 1e-6
    assert out["graph_breaks"] == 0, out["break_reasons"]


@pytest.mark.parametrize("name", ["zero2", "zero3"])
def test_blocks_wrapped_by_torch_compile_train_like_eager(world, ref, name):
    """``blocks[i] = torch.compile(block)``: the OptimizedModule is the unit (zero3) or the place of the wait
    (zero2); its weights, named with torch's ``_orig_mod.``, equal one eager process's."""
    expected, _ = ref("tiny_lm")
    out = world.run(fs.fabric_fit, name, ACC, STEPS, compile_backend="aot_eager", compile_wrapped=True)[0]
    assert any("._orig_mod." in k for k in out["state"])
    assert max_diff({k.replace("._orig_mod.", "."): v for k, v in out["state"].items()}, expected) < TOL
    assert (out["graph_breaks"], out["frames"]) == (0, 1), out["break_reasons"]


@pytest.mark.parametrize("name", ["zero2", "zero3"])
def test_a_compiled_whole_model_trains_like_eager(world, ref, name):
    """The whole GPT compiled (it holds the blocks, so zero3 keeps its per-module units): every unit boundary
    inside it is a graph break where the engine's hook runs eagerly, and the weights still equal one process's."""
    expected, _ = ref("tiny_lm")
    out = world.run(fs.fabric_fit, name, ACC, STEPS, compile_backend="aot_eager", compile_whole=True)[0]
    assert max_diff(out["state"], expected) < TOL
    if name == "zero2":  # one wait hook, on the compiled module itself
        assert (out["graph_breaks"], out["frames"]) == (0, 1), out["break_reasons"]
    else:  # measured: 9 breaks, 13 graphs; every break is one of the engine's eager hooks
        assert out["graph_breaks"] > 0 and out["frames"] > 1
        ours = ("ForwardSchedule.",)
        assert all("torch.compiler.disable()" in r and any(o in r for o in ours) for r in out["break_reasons"]), out


@pytest.mark.parametrize("name,knobs,tol", [
    ("zero3", {"compression": {"gather_quant": "int8", "reduce_quant": "int8"}}, 6e-3),
    ("fsdp_shard", {"compression": {"reduce_quant": "int4"}}, 4e-3),
    ("zero2", {"compression": {"reduce_quant": "int8"}}, 3e-4),
])
def test_compressed_communication_under_fabric(world, ref, name, knobs, tol):
    """compression.gather_quant / reduce_quant reach the engine through Fabric too: close to one process (the bounds of
    tests/strategies/test_quant_lightning.py), not equal to it, and the same weights on both ranks."""
    expected, _ = ref("torch_lm", optimizer="sgd")
    outs = world.run(fs.fabric_fit, name, ACC, STEPS, model="torch_lm", optimizer="sgd", knobs=knobs)
    d = max_diff(outs[0]["state"], expected)
    assert 1e-7 < d < tol, d
    assert max_diff(outs[0]["state"], outs[1]["state"]) == 0.0


@pytest.mark.parametrize("name", ["zero3", "fsdp_shard"])
@pytest.mark.parametrize("model", ["torch_lm", "branchy"])
def test_world_one_stage3_matches_one_process(worlds, name, model):
    """One rank, stage 3, default knobs: the shard is the whole buffer, so the module computes on views of it (no
    gathered copy, nothing counted as gathered), and gradients are copied into buffers never zeroed in advance (a
    layer some micro-batches skip: its range is zeroed at the reduction). The weights equal plain torch's."""
    one = worlds(1)
    expected, _ = fs.reference(model, STEPS, ACC, 1)
    out = one.run(fs.fabric_fit, name, ACC, STEPS, model=model)[0]
    assert max_diff(out["state"], expected) < TOL
    probe = one.run(fs.shard_alias_probe, name, model)[0]
    assert probe["seen"] and all(probe["seen"]), probe["seen"]
    assert probe["gathered"] == 0
