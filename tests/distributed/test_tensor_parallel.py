"""Tensor parallelism (AutoTP: ``tensor_parallel.autotp_size``) on Hugging Face models, against one process.

GPT-2 (a fused query-key-value Conv1D cut in three blocks; the vocabulary-parallel embedding tied to the LM
head), a Llama-style decoder (grouped-query attention: key-value heads split too; SwiGLU) and Mixtral (its
attention like Llama's, its stacked experts' intermediate dimension split, the router replicated), Qwen2-MoE
(a shared expert split like a Llama MLP) and DeepSeek-V3 (its latent attention replicated, a dense first
layer and the experts split) train at tp=2 alone, and at dp=2 × tp=2 under ZeRO
stages 0, 1 and 2, on the same global batch as a single process stepping torch's AdamW. fp32 within 1e-5:
what differs is only the order of sums (a row-parallel layer adds its halves' partial products).
"""
from __future__ import annotations

import pytest
import torch
from megatron_mpu import TensorMpuWithModelGroup
from parity import ADAM_EPS, base_config
from test_real_models import build as build_dense
from test_real_models import loss_of

import zeroengine
from zeroengine.tensor_parallel.layers import TensorSplit, split_of
from zeroengine.testing import run_distributed

transformers = pytest.importorskip("transformers")

MICRO, STEPS, SEQ, VOCAB, LR, CLIP = 2, 3, 8, 128, 1e-3, 1.0


def build(name: str):
    """The dense models of test_real_models, or an MoE family of hf_moe (Qwen2-MoE, DeepSeek-V3)."""
    if name in ("qwen2_moe", "deepseek_v3"):
        import hf_moe

        return hf_moe.build(name)
    return build_dense(name)


def global_batches(dp: int):
    g = torch.Generator().manual_seed(11)
    return [torch.randint(VOCAB, (dp * MICRO, SEQ), generator=g) for _ in range(STEPS)]


def reference(name: str, dp: int):
    model = build(name)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, eps=ADAM_EPS)
    losses = []
    for ids in global_batches(dp):
        loss = loss_of(model, (ids,))
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in model.named_parameters()}, float(norm)


def local_state(model) -> dict:
    return {n: (p.detach().float().clone(), None if split_of(p) is None else split_of(p).as_dict())
            for n, p in model.named_parameters()}


def full_state(per_rank: list[dict]) -> dict:
    """Every parameter whole: the tensor-parallel ones merged from their ranks' pieces."""
    pieces: dict[str, dict[int, torch.Tensor]] = {}
    out = {}
    for state in per_rank:
        for name, (value, split) in state.items():
            if split is None:
                out.setdefault(name, value)
            else:
                pieces.setdefault(name, {})[split["rank"]] = (value, split)
    for name, by_rank in pieces.items():
        split = TensorSplit.from_dict(next(iter(by_rank.values()))[1])
        out[name] = split.merge([by_rank[r][0] for r in range(split.parts)])
    return out


def assert_matches(results, ref_losses, ref_state, tol=1e-5):
    """Every rank's losses, and the parameters merged from the ranks' pieces, against the one-process run."""
    for r in results:
        assert r["losses"] == pytest.approx(ref_losses, abs=tol)
    state = full_state([r["state"] for r in results])
    assert set(state) == set(ref_state)
    for n, p in ref_state.items():
        torch.testing.assert_close(state[n], p, atol=tol, rtol=0, msg=n)


def _train(rank, world, name, tp, stage, offload=""):
    dp = world // tp
    model = build(name)
    cfg = base_config(MICRO, 1, dp, CLIP, lr=LR, stage=stage)
    for what in filter(None, offload.split("+")):  # "optimizer", "param": kept in CPU memory (the C++ Adam steps)
        cfg["zero_optimization"][f"offload_{what}"] = {"device": "cpu"}
    cfg["tensor_parallel"] = {"autotp_size": tp}
    engine, *_ = zeroengine.initialize(model=model, config=cfg)
    losses = []
    for ids in global_batches(dp):
        d = engine.mesh.dp_rank
        loss = loss_of(engine, (ids[d * MICRO:(d + 1) * MICRO],))
        engine.backward(loss)
        engine.step()
        losses.append(zeroengine.comm.all_reduce_scalar(loss.item()) / world)
    tied = getattr(model, "lm_head", None) is not None and hasattr(model, "transformer") and \
        model.lm_head.weight is model.transformer.wte.weight
    with zeroengine.zero.GatheredParameters(list(model.parameters())):  # (stage 3: this rank's tensor slices)
        state = local_state(model)
    return {"losses": losses, "state": state, "autotp": engine.autotp, "tied": tied,
            "norm": engine.get_global_grad_norm()}


@pytest.mark.parametrize("name,world,stage,offload", [(*case, "") for case in [
    ("mixtral", 2, 1),
    ("gpt2", 4, 0), ("llama", 4, 1), ("gpt2", 4, 2), ("mixtral", 4, 2), ("qwen2_moe", 2, 1), ("deepseek_v3", 2, 2),
    ("gpt2", 4, 3), ("llama", 4, 3), ("mixtral", 4, 3),
]] + [("llama", 4, 2, "optimizer"), ("gpt2", 4, 3, "optimizer+param")])
def test_autotp_matches_one_process(name, world, stage, offload):
    tp = 2
    results = run_distributed(_train, world, name, tp, stage, offload)
    ref_losses, ref_params, ref_norm = reference(name, world // tp)
    assert results[0]["autotp"].layers >= 2 and results[0]["autotp"].embeddings.startswith("vocab-parallel")
    assert_matches(results, ref_losses, ref_params)
    # one global norm on every rank, each slice counted once (replicated norms and biases once, not tp times)
    assert len({r["norm"] for r in results}) == 1 and results[0]["norm"] == pytest.approx(ref_norm, rel=1e-5)
    if name == "gpt2":
        assert all(r["tied"] for r in results)
    if name != "gpt2" and name != "llama":  # the experts are split, not left replicated: each rank holds half of each expert
        assert results[0]["autotp"].experts
        experts = [n for n in results[0]["state"] if n.endswith("experts.down_proj")]
        assert experts and all(results[0]["state"][n][1] == {**results[0]["state"][n][1], "dim": 2, "parts": 2}
                               for n in experts)


def test_bf16_autotp_follows_the_fp32_reference():
    """GPT-2 at tp=2 in bf16: the fp32 trajectory up to bf16 rounding. Weights are stored in bf16 (2^-9 relative
    per rounding), the row-parallel halves are summed in bf16 too, so after 3 AdamW steps of lr 1e-3 the losses
    (about 4.9) agree within 1% and the weights (|w| < 0.2) within a few bf16 ulps (2^-10 each at that size) plus
    the 3e-3 the steps move them; a dropped partial sum or a missing head would be off by far more."""
    results = run_distributed(_train_bf16, 2)
    ref_losses, ref_params, _ = reference("gpt2", 1)
    assert results[0]["losses"] == pytest.approx(ref_losses, rel=0.01)
    state = full_state([r["state"] for r in results])
    for n, p in ref_params.items():
        torch.testing.assert_close(state[n], p, atol=0.01, rtol=0.02, msg=n)


def _train_bf16(rank, world):
    model = build("gpt2")
    cfg = base_config(MICRO, 1, 1, CLIP, lr=LR, stage=1, dtype="bf16")
    cfg["tensor_parallel"] = {"autotp_size": 2}
    engine, *_ = zeroengine.initialize(model=model, config=cfg)
    losses = []
    for ids in global_batches(1):
        loss = loss_of(engine, (ids,))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"losses": losses, "state": local_state(model)}


def _regression_batch(step: int):
    """4 rows and targets (the layer norm's output is regressed onto them: a loss whose gradients are well above
    rounding noise, which Adam would otherwise turn into lr-sized steps)."""
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)


def _train_with_mpu(rank, world):
    """Layers of one's own on the mpu's tensor group; ZeRO 1 over the mpu's data group."""
    from zeroengine.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    mpu = TensorMpuWithModelGroup()
    torch.manual_seed(0)
    model = torch.nn.Sequential(ColumnParallelLinear(8, 16, group=mpu.tp), torch.nn.Tanh(),
                                RowParallelLinear(16, 8, group=mpu.tp), torch.nn.LayerNorm(8))
    cfg = base_config(2, 1, 2, CLIP, lr=1e-2, stage=1)
    engine, *_ = zeroengine.initialize(model=model, config=cfg, mpu=mpu)
    for step in range(3):
        x, target = _regression_batch(step)
        rows = slice(2 * mpu.get_data_parallel_rank(), 2 * mpu.get_data_parallel_rank() + 2)
        engine.backward((engine(x[rows]) - target[rows]).pow(2).mean())
        engine.step()
    return {"state": local_state(model), "dp": engine.dp_world_size, "norm": engine.get_global_grad_norm(),
            "partitioned_over": engine.optimizer.flat_params.layout.world}


def test_a_megatron_mpu_gives_the_data_and_tensor_groups():
    results = run_distributed(_train_with_mpu, 4)
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8), torch.nn.LayerNorm(8))
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01, eps=ADAM_EPS)
    for step in range(3):
        x, target = _regression_batch(step)
        (ref(x) - target).pow(2).mean().backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    state = full_state([r["state"] for r in results])
    for n, p in ref.named_parameters():
        torch.testing.assert_close(state[n], p.detach(), atol=1e-5, rtol=0, msg=n)
    assert all(r["dp"] == 2 and r["partitioned_over"] == 2 for r in results)
    assert results[0]["norm"] == pytest.approx(float(norm), rel=1e-5)


def _built_under_init(rank, world):
    cfg = base_config(MICRO, 1, 1, CLIP, lr=LR, stage=3)
    cfg["tensor_parallel"] = {"autotp_size": 2}
    with zeroengine.zero.Init(config_dict_or_path=cfg):
        model = build("llama")
    with pytest.raises(zeroengine.ConfigError, match=r"tensor_parallel\.autotp_size.*zeroengine\.zero\.Init"):
        zeroengine.initialize(model=model, config=cfg)
    # (the refusal comes after the mesh's groups are made: a rank that returned at once could close the store
    # rank 0 hosts while the other still makes its last group)
    zeroengine.comm.barrier()
    return True


def test_a_model_built_under_zero_init_is_refused_with_the_reason():
    """AutoTP cuts whole weights; Init's are already partitioned over the world (not the data group)."""
    assert run_distributed(_built_under_init, 2) == [True, True]
