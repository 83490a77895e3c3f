"""Pipeline schedules and stage partitioning: pure functions, checked against hand counts and the textbook bubble."""
import pytest
import torch

from zeroengine.pipe.partition import balanced_parts, layer_weights
from zeroengine.pipe.schedule import gpipe, interleaved, max_in_flight, one_f_one_b, schedule_for, simulate
from zeroengine.pipe.spec import LayerSpec, TiedLayerSpec


def ops(order):
    """An order written as "F0 F1 B0 ...", or with chunks as "F0.1" (chunk 0, micro-batch 1)."""
    chunked = any(c for _, c, _ in order)
    return " ".join(f"{op}{c}.{i}" if chunked else f"{op}{i}" for op, c, i in order)


def test_1f1b_order_on_each_stage():
    assert ops(one_f_one_b(0, 3, 4)) == "F0 F1 F2 B0 F3 B1 B2 B3"
    assert ops(one_f_one_b(2, 3, 4)) == "F0 B0 F1 B1 F2 B2 F3 B3"
    # fewer micro-batches than stages: all forwards first
    assert ops(one_f_one_b(0, 4, 2)) == "F0 F1 B0 B1"


def test_interleaved_order_on_each_stage():
    """2 stages, 2 chunks, 4 micro-batches: groups of p=2 micro-batches per chunk; stage 0 warms up
    2(p-s-1) + (v-1)p = 4 chunk-passes, the last stage 2; backwards take the chunks last to first."""
    assert ops(interleaved(0, 2, 4, 2)) == \
        "F0.0 F0.1 F1.0 F1.1 F0.2 B1.0 F0.3 B1.1 F1.2 B0.0 F1.3 B0.1 B1.2 B1.3 B0.2 B0.3"
    assert ops(interleaved(1, 2, 4, 2)) == \
        "F0.0 F0.1 F1.0 B1.0 F1.1 B1.1 F0.2 B0.0 F0.3 B0.1 F1.2 B1.2 F1.3 B1.3 B0.2 B0.3"
    with pytest.raises(ValueError, match="multiple of the pipeline stages"):
        interleaved(0, 2, 3, 2)


@pytest.mark.parametrize("name,chunks", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3)])
@pytest.mark.parametrize("stages,micro", [(2, 4), (4, 4), (4, 8), (8, 16), (3, 1)])
def test_every_micro_batch_runs_once_each_way(name, stages, micro, chunks):
    if chunks > 1 and micro % stages:  # no order to check: the interleaved schedule refuses it, on every stage
        for s in range(stages):
            with pytest.raises(ValueError, match="multiple of the pipeline stages"):
                schedule_for(name, s, stages, micro, chunks)
        return
    for s in range(stages):
        order = schedule_for(name, s, stages, micro, chunks)
        passes = [(c, i) for c in range(chunks) for i in range(micro)]
        assert sorted(order) == sorted([("F", *p) for p in passes] + [("B", *p) for p in passes])
        assert all(order.index(("F", *p)) < order.index(("B", *p)) for p in passes)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,micro", [(2, 4), (4, 4), (4, 8), (8, 16)])
def test_bubble_is_the_textbook_fraction(name, stages, micro):
    """Equal pass times (backward = 2 forwards): idle share (p-1)/(m+p-1), for both schedules."""
    sim = simulate(name, stages, micro, forward_time=1.0, backward_time=2.0)
    assert sim["bubble"] == pytest.approx((stages - 1) / (micro + stages - 1))


@pytest.mark.parametrize("stages,micro,chunks", [(2, 4, 2), (2, 8, 2), (4, 8, 2), (4, 8, 4), (4, 16, 2), (8, 16, 2)])
def test_interleaved_bubble_is_divided_by_the_chunks(stages, micro, chunks):
    """Fill and drain shrink v-fold with v chunks per stage: (p-1)/(v·m+p-1); the replay deadlocks if any
    stage's order waits on a pass that its neighbour has not run yet."""
    sim = simulate("interleaved", stages, micro, chunks=chunks)
    assert sim["bubble"] == pytest.approx((stages - 1) / (chunks * micro + stages - 1))
    assert sim["bubble"] < simulate("1f1b", stages, micro)["bubble"]


def test_activations_held():
    assert [max_in_flight(gpipe(s, 4, 8)) for s in range(4)] == [8, 8, 8, 8]
    assert [max_in_flight(one_f_one_b(s, 4, 8)) for s in range(4)] == [4, 3, 2, 1]
    # chunk-passes (1/v of a stage each): the warm-up plus one, 2(p-s-1) + (v-1)p + 1
    assert [max_in_flight(interleaved(s, 4, 8, 2)) for s in range(4)] == [11, 9, 7, 5]


def test_unknown_and_mismatched_schedules():
    with pytest.raises(ValueError, match="'zigzag' is not one of"):
        schedule_for("zigzag", 0, 2, 4)
    with pytest.raises(ValueError, match="virtual_stages > 1"):
        schedule_for("interleaved", 0, 2, 4)
    with pytest.raises(ValueError, match="gpipe schedule runs one model chunk"):
        schedule_for("gpipe", 0, 2, 4, chunks=2)
    assert schedule_for("1f1b", 0, 2, 4, chunks=2) == interleaved(0, 2, 4, 2)


def test_balanced_parts():
    assert balanced_parts([1] * 8, 4) == [0, 2, 4, 6, 8]
    assert balanced_parts([10, 1, 1, 1, 1, 10], 2) == [0, 3, 6]
    assert balanced_parts([5, 1, 1, 1, 1, 1, 1, 1, 1, 1], 2) == [0, 3, 10]  # 7 and 7
    with pytest.raises(ValueError, match="cannot split 2 layer"):
        balanced_parts([1, 1], 3)


class Block(torch.nn.Linear):
    pass


def test_partition_methods():
    specs = [TiedLayerSpec("e", torch.nn.Embedding, 100, 8), LayerSpec(Block, 8, 8), LayerSpec(Block, 8, 8),
             torch.nn.ReLU(), LayerSpec(torch.nn.Linear, 8, 8, bias=False)]
    count = [800, 72, 72, 0, 64]
    assert layer_weights("uniform", specs, count.__getitem__) == [1.0] * 5
    assert layer_weights("parameters", specs, count.__getitem__) == [800.0, 72.0, 72.0, 0.0, 64.0]
    assert layer_weights("type:block", specs, count.__getitem__) == [0.0, 1.0, 1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="no layer's class name matches"):
        layer_weights("type:Attention", specs, count.__getitem__)
    with pytest.raises(ValueError, match="is not one of"):
        layer_weights("best", specs, count.__getitem__)
