"""Stacked (grouped-GEMM) experts under expert parallelism equal one rank holding every expert as
per-expert modules: outputs, l_aux, input gradients and expert gradients (2 ranks, ep_size 2), and
ZeRO's domain split puts the stacked parameters in the expert domain."""
import json
import math
import os

import pytest
import torch
import torch.nn as nn

from zeroengine import comm
from zeroengine.moe import MoE, expert_checkpoint_names
from zeroengine.testing import run_distributed
from zeroengine.zero.moe_split import split_domains

H, EXPERTS, TOKENS = 8, 4, 12
MODES = [dict(k=2, drop_tokens=False), dict(k=1, drop_tokens=True, capacity_factor=4.0, min_capacity=0)]


def _expert():
    return nn.Sequential(nn.Linear(H, 16), nn.GELU(), nn.Linear(16, H))


def _init(expert):
    for p in expert.parameters():
        nn.init.normal_(p, std=0.3)


def _build(ep_size, mode, **kw):
    torch.manual_seed(0)
    moe = MoE(H, _expert(), num_experts=EXPERTS, ep_size=ep_size, **mode, **kw)
    moe.init_experts(_init, seed=11)
    return moe


def _data(rank):
    g = torch.Generator().manual_seed(200 + rank)
    return torch.randn(TOKENS + 2 * rank, H, generator=g), torch.randn(TOKENS + 2 * rank, H, generator=g)


def _worker(rank, world):
    for mode in MODES:
        ref = _build(1, mode, grouped="off")
        for r in range(world):
            x, probe = _data(r)
            x.requires_grad_()
            out, l_aux, _ = ref(x)
            ((out * probe).sum() + l_aux).backward()
            if r == rank:
                ref_out, ref_laux, ref_xgrad = out.detach(), l_aux.detach(), x.grad
        moe = _build(world, mode, expert_layout="stacked")
        x, probe = _data(rank)
        x.requires_grad_()
        out, l_aux, _ = moe(x)
        ((out * probe).sum() + l_aux).backward()
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(l_aux, ref_laux, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(x.grad, ref_xgrad, rtol=1e-5, atol=1e-5)
        st = moe.local_experts
        for name, index in (("w1", 0), ("b1", 0), ("w2", 2), ("b2", 2)):
            grad = getattr(st, name).grad.clone()
            comm.all_reduce(grad, group=moe.groups.edp_group)  # a no-op group here (world == ep_size)
            attr = "weight" if name[0] == "w" else "bias"
            want = torch.stack([getattr(ref.local_experts[g][index], attr).grad for g in moe.global_expert_ids])
            torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-5)
    domains = split_domains(list(moe.parameters()))
    expert_domain = [d for d in domains if d.is_expert]
    assert len(expert_domain) == 1 and {id(p) for p in expert_domain[0].params} == {id(p) for p in st.parameters()}
    return sorted(expert_checkpoint_names(moe).values())


def test_stacked_experts_expert_parallel_equal_single_rank():
    names = run_distributed(_worker, 2)
    # one stored tensor [num_experts, ...] per stacked parameter; each rank holds its own range of it
    assert names[0] == names[1] == [f"local_experts.{n}" for n in ("b1", "b2", "w1", "w2")]


# -- checkpoints reshard stacked experts over ep_size ------------------------------------------------

class _StackedNet(nn.Module):
    def __init__(self, ep_size):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(H, H)
        self.moe = MoE(H, _expert(), num_experts=EXPERTS, ep_size=ep_size, k=2, drop_tokens=False,
                       expert_layout="stacked")
        self.moe.init_experts(_init, seed=11)

    def forward(self, x, y):
        out, l_aux, _ = self.moe(self.inp(x))
        return torch.nn.functional.mse_loss(out, y) + 0.01 * l_aux


def _stacked_engine(world, ep_size):
    import zeroengine

    cfg = {"train_micro_batch_size_per_gpu": TOKENS, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": 2}}
    engine, _, _, _ = zeroengine.initialize(model=_StackedNet(ep_size), config=cfg)
    return engine


def _steps(engine, rank, first, count):
    for step in range(first, first + count):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(TOKENS, H, generator=g), torch.randn(TOKENS, H, generator=g)
        engine.backward(engine(x, y))
        engine.step()


def _stacked_resume(rank, world, save_dir, save_ep, load_ep, per_rank_names=False):
    straight = _stacked_engine(world, load_ep)
    _steps(straight, rank, 0, 4)
    first = _stacked_engine(world, save_ep)
    _steps(first, rank, 0, 2)
    first.save_checkpoint(save_dir, tag="half")
    if per_rank_names:
        if rank == 0:
            _write_per_rank_names(os.path.join(save_dir, "half", "manifest.json"), EXPERTS // save_ep)
        comm.barrier()
    resumed = _stacked_engine(world, load_ep)
    resumed.load_checkpoint(save_dir, tag="half")
    _steps(resumed, rank, 2, 2)
    return ({n: p.detach().clone() for n, p in straight.module.named_parameters()},
            {n: p.detach().clone() for n, p in resumed.module.named_parameters()})


def _write_per_rank_names(path, count):
    """Rewrite a manifest the way zeroengine named stacked experts before (``w1.experts_<a>_<b>``, one
    [count, ...] tensor per rank's stack)."""
    with open(path) as f:
        data = json.load(f)
    params = data["params"]
    stacked = [n for n in params if n.startswith("moe.local_experts.")]
    per = {n: math.prod(params[n]["shape"][1:]) for n in stacked}
    for info in data["files"].values():
        for entry in info.get("entries", []):
            name, start, end = entry
            if name in per:
                first = start // per[name] // count * count
                entry[:] = [f"{name}.experts_{first}_{first + count - 1}", start - first * per[name],
                            end - first * per[name]]
    for name in stacked:
        shape = params.pop(name)["shape"]
        for first in range(0, shape[0], count):
            params[f"{name}.experts_{first}_{first + count - 1}"] = {
                "shape": [count, *shape[1:]], "dtype": "float32", "group": 0}
    with open(path, "w") as f:
        json.dump(data, f)


@pytest.mark.parametrize("save_ep,load_ep,per_rank_names", [(2, 1, False), (1, 2, False), (2, 1, True)])
def test_stacked_expert_checkpoint_reshards_over_ep_size(tmp_path, save_ep, load_ep, per_rank_names):
    """per_rank_names: a checkpoint as zeroengine wrote stacked experts before (one name per rank's stack)
    loads too, at another ep_size."""
    for straight, resumed in run_distributed(_stacked_resume, 2, str(tmp_path / "run"), save_ep, load_ep,
                                             per_rank_names):
        assert straight["moe.local_experts.w1"].shape[0] == EXPERTS // load_ep
        for name, value in straight.items():
            torch.testing.assert_close(resumed[name], value, atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")
    # consolidated: one [num_experts, ...] tensor per stacked parameter, as a one-rank model has it
    from zeroengine.checkpoint.consolidate import get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "run"), tag="half")
    assert state["moe.local_experts.w1"].shape == (EXPERTS, 16, H)
    whole = _StackedNet(1).state_dict()
    assert set(state) == set(whole) and all(state[k].shape == v.shape for k, v in whole.items())
