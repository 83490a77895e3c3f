"""Matrix-wise optimizers on flat pieces (zeroengine/optim/partitioned.py) without processes: each fake rank
steps the contiguous pieces of the flattened parameters it would hold under ZeRO, in its own thread, and the
reduction is a barrier that sums (or maxes) what the threads bring. The result must be the whole-tensor
optimizer's (torch.optim.Adafactor; the SM3 reference below) for any cut, including ranks with no piece."""
import math
import threading

import pytest
import torch
import torch.distributed as dist
from optimizer_references import ReferenceSM3

from zeroengine.optim.adafactor import Adafactor
from zeroengine.optim.partitioned import Partition, PieceOf, blocks, stepping

SHAPES = [(6, 5), (7,), (2, 3, 4), (1, 9), (4, 1), (2, 3, 1, 4)]  # matrices, vectors, 3-D, 4-D, size-1 dims


class ThreadReduce:
    """An all-reduce among ``world`` threads: each call waits for all, then every one gets the sum / max."""

    def __init__(self, world: int):
        self.world, self.barrier, self.lock, self.parts = world, threading.Barrier(world), threading.Lock(), []

    def __call__(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> None:
        with self.lock:
            self.parts.append(tensor.clone())
        self.barrier.wait()
        stacked = torch.stack(self.parts)
        result = stacked.sum(0) if op == dist.ReduceOp.SUM else stacked.amax(0)
        self.barrier.wait()
        with self.lock:
            self.parts.clear()
        self.barrier.wait()
        tensor.copy_(result)


def cut(numels: list[int], world: int) -> list[list[tuple[int, int, int]]]:
    """Each rank's (param index, start, end) pieces when the parameters, flattened end to end, are cut into
    ``world`` equal chunks (the last ones short, or empty, as ZeRO's padded chunks can be)."""
    total = sum(numels)
    chunk = math.ceil(total / world) + 1  # padding: the last rank may get nothing
    out = [[] for _ in range(world)]
    flat_start = 0
    for i, n in enumerate(numels):
        for r in range(world):
            lo, hi = max(flat_start, r * chunk), min(flat_start + n, (r + 1) * chunk)
            if lo < hi:
                out[r].append((i, lo - flat_start, hi - flat_start))
        flat_start += n
    return out


def partitioned_run(make, params0, grads, world):
    shapes = [tuple(p.shape) for p in params0]
    reduce = ThreadReduce(world)
    results = [None] * world
    errors = []

    def rank(r, pieces):
        try:
            tensors = [params0[i].reshape(-1)[s:e].clone() for i, s, e in pieces]
            opt = make(tensors)
            places = {id(t): PieceOf(i, shapes[i], s, e, bucket=0) for t, (i, s, e) in zip(tensors, pieces)}
            opt.attach_partition(Partition(places, [[(i, shapes[i]) for i in range(len(shapes))]], reduce))
            for step_grads in grads:
                for t, (i, s, e) in zip(tensors, pieces):
                    t.grad = step_grads[i].reshape(-1)[s:e].clone()
                with stepping(opt, [0]):
                    opt.step()
            results[r] = [(i, s, e, t.detach()) for t, (i, s, e) in zip(tensors, pieces)]
        except Exception as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)
            reduce.barrier.abort()

    threads = [threading.Thread(target=rank, args=(r, p)) for r, p in enumerate(cut([p.numel() for p in params0],
                                                                                     world))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    out = [torch.empty(p.numel()) for p in params0]
    for pieces in results:
        for i, s, e, value in pieces:
            out[i][s:e] = value
    return [o.view(p.shape) for o, p in zip(out, params0)]


def whole_run(make, params0, grads):
    params = [p.clone().requires_grad_() for p in params0]
    opt = make(params)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in params]


def _problem(seed, steps=4):
    g = torch.Generator().manual_seed(seed)
    params0 = [torch.randn(s, generator=g) for s in SHAPES]
    grads = [[torch.randn(s, generator=g) for s in SHAPES] for _ in range(steps)]
    return params0, grads


def test_blocks_cover_any_range_in_order():
    for shape in [(5,), (4, 7), (3, 4, 5), (2, 3, 4, 5)]:
        n = math.prod(shape)
        t = torch.arange(n).view(shape)
        for s in range(0, n, 3):
            for e in range(s + 1, n + 1, 5):
                got = torch.cat([t[index].reshape(-1) for index, _ in blocks(shape, s, e)])
                assert torch.equal(got, torch.arange(s, e)), (shape, s, e)


@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize("kwargs", [{}, dict(lr=0.05, weight_decay=0.1, d=1.5), dict(maximize=True, eps=(1e-3, 1e-2))])
def test_adafactor_on_pieces_is_torchs_adafactor(world, kwargs):
    params0, grads = _problem(world)
    want = whole_run(lambda ps: torch.optim.Adafactor(ps, **kwargs), params0, grads)
    got = partitioned_run(lambda ps: Adafactor(ps, **kwargs), params0, grads, world)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("world", [0, 1, 2, 3, 5])  # 0: our SM3 on whole tensors, no partition
@pytest.mark.parametrize("kwargs", [{}, dict(lr=0.05, momentum=0.9), dict(eps=1e-3)])
def test_sm3_on_pieces_is_the_papers_sm3(world, kwargs):
    from zeroengine.optim.sm3 import SM3

    params0, grads = _problem(10 + world)
    grads[0][0][2].zero_()  # a zero row at the first step: 0/0 must give 0
    want = whole_run(lambda ps: ReferenceSM3(ps, **kwargs), params0, grads)
    if world == 0:
        got = whole_run(lambda ps: SM3(ps, **kwargs), params0, grads)
    else:
        got = partitioned_run(lambda ps: SM3(ps, **kwargs), params0, grads, world)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_adafactor_on_whole_tensors_is_torchs():
    params0, grads = _problem(7)
    want = whole_run(lambda ps: torch.optim.Adafactor(ps, lr=0.03), params0, grads)
    got = whole_run(lambda ps: Adafactor(ps, lr=0.03), params0, grads)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_adafactor_steps_parameters_of_any_float_dtype(dtype):
    """Its statistics are fp32 whatever the parameter's dtype (the 1-D second moment as well as the factored
    ones); each step then is torch's Adafactor on the values widened to fp64, rounded once more at the add."""
    torch.manual_seed(0)
    values = [torch.randn(6, 5), torch.randn(7), torch.randn(())]
    grads = [torch.randn_like(v) for v in values]
    ours = [torch.nn.Parameter(v.to(dtype)) for v in values]
    wide = [torch.nn.Parameter(p.detach().double()) for p in ours]
    eps1 = torch.finfo(dtype).eps  # torch takes eps1 from the parameter's dtype, as ours does
    opt, ref = Adafactor(ours, lr=0.03), torch.optim.Adafactor(wide, lr=0.03, eps=(eps1, 1e-3))
    for p, w, g in zip(ours, wide, grads):
        p.grad, w.grad = g.to(dtype), g.to(dtype).double()
    opt.step()
    ref.step()
    for p, w in zip(ours, wide):
        assert p.dtype == dtype
        # fp32 statistics and one rounding of the update to the parameter's dtype (fp64: fp32's precision)
        tolerance = 1e-5 if dtype == torch.float64 else 2 * torch.finfo(dtype).eps
        torch.testing.assert_close(p.double(), w.detach(), rtol=tolerance, atol=tolerance)
