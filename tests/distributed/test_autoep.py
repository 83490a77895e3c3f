"""AutoEP (``expert_parallel``): Hugging Face MoE models converted to expert parallelism train as on one process.

For every family (tiny random-weight models from transformers configs, no downloads), converted at
ep=2 on 2 ranks or at ep=2 x dp=2 on 4 ranks, at ZeRO stage 2 or 3 (each layout for some family), against the unconverted model on one process that
averages the ranks' losses (what data parallelism computes): each rank's logits and loss (with the
model's own auxiliary loss, where it has one) at the first step, every parameter's gradient then, and
every parameter after 3 optimizer steps, fp32 within 1e-5.
"""
import pytest
import torch

pytest.importorskip("transformers")

import hf_moe  # noqa: E402

import zeroengine  # noqa: E402
from zeroengine import comm  # noqa: E402
from zeroengine.moe.autoep import ShardedExperts  # noqa: E402
from zeroengine.testing import run_distributed  # noqa: E402
from zeroengine.zero import safe_get_full_fp32_param, safe_get_full_grad  # noqa: E402

# Adam's eps: an update is lr * m / (sqrt(v) + eps), whose sensitivity to a gradient much smaller than eps is
# lr / eps. With eps 1e-6, gradient rounding differences of ~1e-9 (summation order: one graph over both ranks'
# batches against per-rank graphs and a reduction) in near-zero coordinates became 1e-5-4e-5 weight differences
# after 3 steps while every gradient agreed to 5e-8; eps 1e-4 keeps the comparison about the engine.
STEPS, LR, CLIP, EPS = 3, 1e-2, 1.0, 1e-4


def config(world: int, stage: int, ep: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "train_batch_size": 2 * world,
        "gradient_clipping": CLIP, "steps_per_print": None,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "eps": EPS, "weight_decay": 0.01}},
        # persistence 0: at stage 3 the tiny model's experts are partitioned too, not kept whole
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 3000, "stage3_param_persistence_threshold": 0},
        "expert_parallel": {"enabled": True, "autoep_size": ep},
    }


def forward(model, step, rank):
    ids, mask, labels = hf_moe.batch(step, rank)
    return model(input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=True)


def reference(family: str, world: int):
    """(per-rank logits and losses of step 0, gradients of step 0, parameters after STEPS) of the unconverted
    model on one process, every step's loss the mean of the ranks' losses."""
    model = hf_moe.build(family)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=0.01)
    first = grads = None
    for step in range(STEPS):
        outs = [forward(model, step, r) for r in range(world)]
        torch.stack([o.loss for o in outs]).mean().backward()
        if step == 0:
            first = [(o.logits.detach().clone(), o.loss.item()) for o in outs]
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    return first, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def full(p: torch.Tensor, value: torch.Tensor, module_of: dict) -> torch.Tensor:
    """A parameter's whole value from this rank's (an AutoEP expert parameter: gathered over its EP group)."""
    experts = module_of.get(id(p))
    if experts is None or experts.ep_size == 1:
        return value
    parts = [torch.empty_like(value) for _ in range(experts.ep_size)]
    torch.distributed.all_gather(parts, value.contiguous(), group=experts.groups.ep_group)
    return torch.cat(parts)


def converted(rank, world, family, ep, stage):
    model = hf_moe.build(family)
    engine, _, _, _ = zeroengine.initialize(model=model, config=config(world, stage, ep))
    module_of = {id(p): m for m in model.modules() if isinstance(m, ShardedExperts) for p in m.parameters()}
    assert module_of and engine.autoep.ep_size == ep
    assert all(m.count == m.num_experts // ep for m in module_of.values())
    names = dict((id(p), n) for n, p in model.named_parameters())
    first = grads = None
    for step in range(STEPS):
        out = forward(engine, step, rank)
        engine.backward(out.loss)
        if step == 0:
            first = (out.logits.detach().clone(), out.loss.item())
            grads = {names[id(p)]: full(p, safe_get_full_grad(p), module_of) for p in model.parameters()}
        engine.step()
    params = {names[id(p)]: full(p, safe_get_full_fp32_param(p), module_of) for p in model.parameters()}
    return first, grads, params


def assert_close(actual: dict, expected: dict, what: str):
    assert set(actual) == set(expected), what
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, rtol=0, atol=1e-5, msg=f"{what} {name}")


# Every family once and every layout (world, stage) at least once, not their product: what a family changes (its
# expert layout, router, auxiliary loss) is converted the same way whatever the world and stage, and the layouts
# exercise the same engine paths whatever the family (the product ran 24 cases, 2.5 minutes of the suite).
LAYOUTS = [(2, 2), (4, 2), (2, 3), (4, 3)]
CASES = [(family, *LAYOUTS[i % len(LAYOUTS)]) for i, family in enumerate(hf_moe.FAMILIES)]


@pytest.mark.parametrize("family,world,stage", CASES)
def test_converted_model_trains_as_the_unconverted_one(family, world, stage):
    ref_first, ref_grads, ref_params = reference(family, world)
    for rank, (first, grads, params) in enumerate(run_distributed(converted, world, family, 2, stage)):
        logits, loss = first
        torch.testing.assert_close(logits, ref_first[rank][0], rtol=0, atol=1e-5)
        assert loss == pytest.approx(ref_first[rank][1], abs=1e-5)
        assert_close(grads, ref_grads, "gradient")
        assert_close(params, ref_params, "after 3 steps:")


def test_stage_1_and_ep_size_1():
    """Stage 1 (expert state sharded over expert data parallelism) and ep=1 (grouped experts, no all-to-all)."""
    _, _, ref_params = reference("mixtral", 2)
    for stage, ep in ((1, 2), (2, 1)):
        for _, _, params in run_distributed(converted, 2, "mixtral", ep, stage):
            assert_close(params, ref_params, f"stage {stage} ep {ep}:")


def keys_after_conversion(rank, world):
    model = hf_moe.build("qwen2_moe")
    before = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    engine, _, _, _ = zeroengine.initialize(model=model, config=config(world, 2, 2))
    after = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    return before, after, engine.autoep


def test_state_dict_keys_are_the_models_own():
    for before, after, conversion in run_distributed(keys_after_conversion, 2):
        assert set(before) == set(after)
        assert conversion.blocks == ("model.layers.0.mlp", "model.layers.1.mlp") and conversion.num_experts == 4
        for key, shape in before.items():
            if ".experts." in key:  # this rank's half of the experts
                assert after[key] == (shape[0] // 2, *shape[1:]), key
            else:  # router, shared expert and its gate, attention: untouched
                assert after[key] == shape, key


def refused(rank, world, cfg_update, family="mixtral", stage=2):
    cfg = config(world, stage, 2)
    cfg["expert_parallel"].update(cfg_update)
    try:
        zeroengine.initialize(model=hf_moe.build(family), config=cfg)
    except (zeroengine.ConfigError, ValueError) as error:
        return str(error)
    return None


@pytest.mark.parametrize("update,says", [
    ({"autoep_size": 3}, "autoep_size (3) must divide the world size (2)"),
    ({"preset_model": "gpt2"}, "unknown preset 'gpt2'"),
    ({"moe_layer_pattern": r"model\.nothing"}, "no MoE block found"),
    ({"route_norm": True}, "keeps the model's own router"),
    ({"load_balance_coeff": 0.001}, "auxiliary-loss-free"),
])
def test_bad_settings_are_named(update, says):
    for message in run_distributed(refused, 2, update):
        assert message is not None and "expert_parallel" in message and says in message, message


def three_experts(rank, world):
    import transformers

    cfg = transformers.MixtralConfig(**{**hf_moe.COMMON, "intermediate_size": 64, "num_local_experts": 3,
                                       "num_experts_per_tok": 2})
    torch.manual_seed(0)
    try:
        zeroengine.initialize(model=transformers.MixtralForCausalLM(cfg), config=config(world, 2, 2))
    except zeroengine.ConfigError as error:
        return str(error)
    return None


def test_experts_that_ep_size_does_not_divide_are_named():
    for message in run_distributed(three_experts, 2):
        assert "must divide the number of experts (3)" in message and "[1]" in message, message


def count_dispatch(rank, world):
    model = hf_moe.build("olmoe")
    engine, _, _, _ = zeroengine.initialize(model=model, config=config(world, 2, 2))
    comm.counters.reset()
    engine.backward(forward(engine, 0, rank).loss)
    return comm.counters.snapshot().get("all_to_all", {}).get("calls", 0), len(engine.autoep.blocks)


def test_the_comm_module_counts_the_dispatch():
    """Tokens travel through zeroengine.comm (counted): the counts exchange, then the rows there and back in
    forward and back and there again in backward, per MoE block and step."""
    for calls, blocks in run_distributed(count_dispatch, 2):
        assert calls == 5 * blocks, (calls, blocks)


def train_and_save(rank, world, family, ep, save_dir, autoep=True, stage=2):
    model = hf_moe.build(family)
    cfg = config(world, stage, ep)
    cfg["expert_parallel"]["enabled"] = autoep
    engine, _, _, _ = zeroengine.initialize(model=model, config=cfg)
    for step in range(2):
        engine.backward(forward(engine, step, rank).loss)
        engine.step()
    engine.save_checkpoint(save_dir, tag="t")
    module_of = {id(p): m for m in model.modules() if isinstance(m, ShardedExperts) for p in m.parameters()}
    names = dict((id(p), n) for n, p in model.named_parameters())
    return {names[id(p)]: full(p, safe_get_full_fp32_param(p), module_of) for p in model.parameters()}


def load_and_read(rank, world, family, ep, save_dir, autoep=True, stage=2):
    model = hf_moe.build(family, seed=5)  # other weights: everything must come from the checkpoint
    cfg = config(world, stage, ep)
    cfg["expert_parallel"]["enabled"] = autoep
    engine, _, _, _ = zeroengine.initialize(model=model, config=cfg)
    engine.load_checkpoint(save_dir)
    module_of = {id(p): m for m in model.modules() if isinstance(m, ShardedExperts) for p in m.parameters()}
    names = dict((id(p), n) for n, p in model.named_parameters())
    loaded = {names[id(p)]: full(p, safe_get_full_fp32_param(p), module_of) for p in model.parameters()}
    loss = forward(engine, 2, rank).loss.item()  # the next step trains on from the loaded state
    return loaded, loss


# Stage 3 only: its checkpoint partitions the parameters as well as the optimizer state, so every piece of an
# expert is re-cut on load; stage 2's keeps the parameters whole and differs only there (stage-2 checkpoints
# of ordinary models load across worlds in test_checkpoint_reshard.py).
@pytest.mark.parametrize("stage", [3])
def test_a_converted_checkpoint_loads_into_the_unconverted_model_and_back(tmp_path, stage):
    from zeroengine.checkpoint import get_fp32_state_dict_from_zero_checkpoint

    saved = run_distributed(train_and_save, 2, "qwen2_moe", 2, str(tmp_path / "ep2"), True, stage)[0]
    # the consolidated state_dict is the unconverted model's: its keys and full shapes, strictly
    state = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "ep2"))
    plain = hf_moe.build("qwen2_moe", seed=5)
    plain.load_state_dict(state, strict=True)
    for name, p in plain.named_parameters():
        torch.testing.assert_close(p.detach(), saved[name], rtol=0, atol=0, msg=name)
    # ...into engines at other layouts: unconverted on one rank, AutoEP at ep=1 and at ep=4 x dp=1 on 4 ranks
    for world, ep, autoep in ((1, 1, False), (2, 1, True), (4, 4, True)):
        for loaded, _ in run_distributed(load_and_read, world, "qwen2_moe", ep, str(tmp_path / "ep2"), autoep, stage):
            for name, value in saved.items():
                torch.testing.assert_close(loaded[name], value, rtol=0, atol=0, msg=f"{world} ranks ep {ep}: {name}")
    # ...and back: a checkpoint of the unconverted model loads into a converted one
    plain_saved = run_distributed(train_and_save, 1, "qwen2_moe", 1, str(tmp_path / "plain"), False, stage)[0]
    for loaded, _ in run_distributed(load_and_read, 2, "qwen2_moe", 2, str(tmp_path / "plain"), True, stage):
        for name, value in plain_saved.items():
            torch.testing.assert_close(loaded[name], value, rtol=0, atol=0, msg=f"into ep 2: {name}")
