"""Stage 3's fetch policy: prefetch along the recorded module order, max live elements, reuse distance,
persistent small parameters. Counted through the buffers' FetchStats; numbers must not change."""
import functools

import torch
from parity import base_config, global_batches, make_model, reference_run

import zeroengine
from zeroengine.testing import run_distributed
from zeroengine.zero import GatheredParameters, is_partitioned

STEPS = 4
WORLD = 2


def _train(rank, world, zero_extra):
    cfg = base_config(2, 1, world, 0.5, stage=3)
    cfg["zero_optimization"].update(zero_extra)
    engine, opt, _, _ = zeroengine.initialize(model=make_model(), config=cfg)
    per_step = []
    for i, step in enumerate(global_batches(STEPS, 1, world, 2)):
        if i == 1:
            opt.reset_fetch_stats()  # the first pass records the trace; count the ones that replay it
        x, y = step[0][rank]
        engine.backward(engine(x, y))
        engine.step()
        per_step.append(opt.fetch_stats()["on_demand"])
    stats = opt.fetch_stats()
    buffer = opt.flat_params
    units = [(b.padded_numel, b.index in buffer.persistent) for b in buffer.layout.buckets]
    bucket_of = buffer.layout.bucket_of_param()
    persistent_whole = [p.data.numel() == p.numel() and type(p) is torch.nn.Parameter and is_partitioned(p)
                        for i, p in enumerate(buffer.params) if bucket_of[i] in buffer.persistent]
    breakdown = engine.memory_breakdown()
    spare_numel = sum(t.numel() for t in buffer.spare_tensors())  # released memory kept for the next gathers
    with GatheredParameters(list(engine.module.parameters())):
        state = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    return (stats, units, persistent_whole, breakdown["params"], buffer.layout.shard_numel,
            (spare_numel, breakdown["buffers"]), state)


@functools.lru_cache(maxsize=None)
def _run(**zero_extra):
    """One 2-rank run per distinct config, shared by the tests below (each costs seconds here)."""
    return run_distributed(_train, WORLD, zero_extra)


@functools.lru_cache(maxsize=1)
def _reference():
    return reference_run(STEPS, 1, WORLD, micro=2, clip=0.5)[1]


def _check_parity(results, ref):
    for *_, state in results:
        for name, want in ref.items():
            torch.testing.assert_close(state[name], want, atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")


def test_prefetch_leaves_one_blocking_gather_per_pass_and_keeps_the_numbers():
    ref = _reference()
    ahead = _run()  # defaults: 5e7 elements ahead
    none = _run(stage3_prefetch_bucket_size=0)
    _check_parity(ahead, ref)
    _check_parity(none, ref)
    passes = STEPS - 1
    for stats, *_ in ahead:
        assert stats["trace_state"] == "replaying" and stats["trace_recordings"] == 1
        # only the first module of each pass waits for a gather it issued itself
        assert stats["on_demand"] == passes, stats
        assert stats["prefetched"] > 0
    for stats, *_ in none:
        assert stats["prefetched"] == 0
        assert stats["on_demand"] >= 16 * passes  # every module of the tiny GPT, at least once per pass
    # the same elements are gathered either way: prefetch moves gathers earlier, it adds none
    assert ahead[0][0]["gathered_numel"] == none[0][0]["gathered_numel"]


def test_max_live_parameters_bounds_the_gathered_elements():
    ref = _reference()
    free = _run()
    largest = max(n for n, _ in free[0][1])
    limit = 3 * largest
    bounded = _run(stage3_max_live_parameters=limit)
    _check_parity(bounded, ref)
    assert free[0][0]["peak_live_numel"] > limit  # without the bound, more is alive at once
    for stats, *_, (spare_numel, buffers_bytes), _ in bounded:
        assert stats["peak_live_numel"] <= limit, (stats["peak_live_numel"], limit)
        assert stats["prefetched"] > 0  # it still prefetches within the bound
        # released memory is kept for reuse (CPU, torch >= 2.13), within what was alive at once, and reported
        if hasattr(torch.UntypedStorage, "_swap_data_ptr_"):
            assert 0 < spare_numel <= stats["peak_live_numel"] <= limit, (spare_numel, stats["peak_live_numel"])
            assert buffers_bytes >= 4 * spare_numel


def test_reuse_distance_keeps_parameters_gathered_between_forward_and_backward():
    ahead = {"stage3_prefetch_bucket_size": 4096}  # about one module ahead, so prefetch alone keeps little alive
    keep = _run(**ahead)  # default distance 1e9: everything is reused
    drop = _run(**ahead, stage3_max_reuse_distance=0)
    passes = STEPS - 1
    total = sum(n for n, _ in keep[0][1])
    # kept from its forward to its backward, each unit is gathered exactly once per pass
    assert keep[0][0]["gathered_numel"] == passes * total
    # released after forward, most are gathered again for backward
    assert drop[0][0]["gathered_numel"] > 1.5 * passes * total
    assert keep[0][0]["peak_live_numel"] > drop[0][0]["peak_live_numel"]


def test_small_parameters_persist_whole_and_are_never_gathered_by_modules():
    ref = _reference()
    results = _run(stage3_param_persistence_threshold=200)
    _check_parity(results, ref)
    passes = STEPS - 1
    for stats, units, whole, params_bytes, shard_numel, _, _ in results:
        persistent = sum(n for n, p in units if p)
        partitioned = sum(n for n, p in units if not p)
        assert persistent > 0 and whole and all(whole)  # LayerNorms and biases: full on every rank
        # per step: each partitioned unit once (forward..backward), each persistent one only in the
        # refresh after the optimizer step (all ranks then hold the updated full value)
        assert stats["gathered_numel"] == passes * (partitioned + persistent)
        assert params_bytes == 4 * (shard_numel + persistent)


def _two_forwards(rank, world):
    engine, opt, _, _ = zeroengine.initialize(model=make_model(), config=base_config(2, 1, world, 0.5, stage=3))
    for i, step in enumerate(global_batches(STEPS, 1, world, 2)):
        if i == 1:
            opt.reset_fetch_stats()
        x, y = step[0][rank]
        # DPO-style: two forwards (here the micro-batch's two halves), then one backward of their combination
        loss = 0.5 * (engine(x[:1], y[:1]) + engine(x[1:], y[1:]))
        engine.backward(loss)
        engine.step()
    stats = opt.fetch_stats()  # before GatheredParameters' own gathers
    with GatheredParameters(list(engine.module.parameters())):
        state = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    return stats, state


def test_two_forwards_before_one_backward_record_one_pass_and_prefetch_it():
    # Before, the second forward ended the pass: the trace was re-recorded every step and the backward
    # gathered every module on demand.
    results = run_distributed(_two_forwards, WORLD)
    _check_parity([(stats, state) for stats, state in results], _reference())
    passes = STEPS - 1
    for stats, _ in results:
        assert stats["trace_state"] == "replaying" and stats["trace_recordings"] == 1, stats
        assert stats["on_demand"] == passes, stats  # only the first module of each pass waits
