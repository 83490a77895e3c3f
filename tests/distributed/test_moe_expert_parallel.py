"""Expert parallelism equals one rank holding every expert: outputs, l_aux, input gradients and expert
gradients, dropless and with a capacity nothing overflows, on 2 and 4 ranks with ep_size 2 and 4."""
import pytest
import torch
import torch.nn as nn

from zeroengine import comm
from zeroengine.moe import MoE, expert_checkpoint_names
from zeroengine.testing import run_distributed

H, EXPERTS, TOKENS = 8, 4, 12
MODES = [dict(k=1, drop_tokens=False), dict(k=2, drop_tokens=False),
         dict(k=2, drop_tokens=True, capacity_factor=4.0, min_capacity=0),
         dict(k=1, drop_tokens=True, capacity_factor=4.0, min_capacity=0)]


def _expert():
    return nn.Sequential(nn.Linear(H, 16), nn.GELU(), nn.Linear(16, H))


def _init(expert):
    for p in expert.parameters():
        nn.init.normal_(p, std=0.3)


def _build(ep_size, mode):
    torch.manual_seed(0)  # the gate: identical on every rank
    moe = MoE(H, _expert(), num_experts=EXPERTS, ep_size=ep_size, **mode)
    moe.init_experts(_init, seed=11)
    return moe


def _data(rank):
    g = torch.Generator().manual_seed(100 + rank)
    # uneven token counts per rank exercise the uneven all-to-all splits
    return torch.randn(TOKENS + rank, H, generator=g), torch.randn(TOKENS + rank, H, generator=g)


def _loss(out, l_aux, probe):
    return (out * probe).sum() + 0.5 * l_aux


def _worker(rank, world, ep_size):
    report = {}
    for m, mode in enumerate(MODES):
        ref = _build(1, mode)
        ref_out, ref_laux, ref_xgrad = [], [], []
        for r in range(world):
            x, probe = _data(r)
            x.requires_grad_()
            routing = ref.gate(x)
            assert routing.num_dropped == 0  # "with capacity when nothing overflows"
            out, l_aux, _ = ref(x)
            loss = _loss(out, l_aux, probe)
            loss.backward()
            ref_out.append(out.detach())
            ref_laux.append(l_aux.detach())
            ref_xgrad.append(x.grad)
        moe = _build(ep_size, mode)
        x, probe = _data(rank)
        x.requires_grad_()
        out, l_aux, counts = moe(x)
        _loss(out, l_aux, probe).backward()
        torch.testing.assert_close(out, ref_out[rank], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(l_aux, ref_laux[rank], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(x.grad, ref_xgrad[rank], rtol=1e-5, atol=1e-5)
        # Each expert's gradient sums its EP group's tokens; the EDP group holds the other token shares.
        for gid, expert in zip(moe.global_expert_ids, moe.local_experts):
            for p, p_ref in zip(expert.parameters(), ref.local_experts[gid].parameters()):
                g = p.grad.clone()
                comm.all_reduce(g, group=moe.groups.edp_group)
                torch.testing.assert_close(g, p_ref.grad, rtol=1e-5, atol=1e-5)
        g = moe.gate.wg.weight.grad.clone()
        comm.all_reduce(g)
        torch.testing.assert_close(g, ref.gate.wg.weight.grad, rtol=1e-5, atol=1e-5)
        report[m] = int(counts.sum())
    names = expert_checkpoint_names(moe)
    report["names"] = sorted(names.values())
    report["ep_rank"], report["global_ids"] = moe.groups.ep_rank, moe.global_expert_ids
    return report


@pytest.mark.parametrize("world,ep_size", [(2, 2), (4, 2), (4, 4)])
def test_expert_parallel_equals_single_rank(world, ep_size):
    reports = run_distributed(_worker, world, ep_size)
    for first in range(0, world, ep_size):
        group = reports[first:first + ep_size]
        # the EP group's experts are all experts, each once, named by global id
        assert sorted(i for r in group for i in r["global_ids"]) == list(range(EXPERTS))
        names = [n for r in group for n in r["names"]]
        assert len(names) == len(set(names)) == EXPERTS * 4  # 4 tensors per expert
    assert reports[0]["names"] == reports[ep_size]["names"] if world > ep_size else True
