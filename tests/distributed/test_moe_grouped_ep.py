"""Stacked (grouped-GEMM) experts under expert parallelism equal one rank holding every expert as
per-expert modules: outputs, l_aux, input gradients and expert gradients (2 ranks, ep_size 2), and
ZeRO's domain split puts the stacked parameters in the expert domain."""
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
    assert names[0] == [f"local_experts.{n}.experts_0_1" for n in ("b1", "b2", "w1", "w2")]
    assert names[1] == [f"local_experts.{n}.experts_2_3" for n in ("b1", "b2", "w1", "w2")]
