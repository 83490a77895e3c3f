"""Pipeline schedules and stage partitioning: pure functions, checked against hand counts and the textbook bubble."""
import pytest
import torch

from zeroengine.pipe.partition import balanced_parts, layer_weights
from zeroengine.pipe.schedule import gpipe, max_in_flight, one_f_one_b, schedule_for, simulate
from zeroengine.pipe.spec import LayerSpec, TiedLayerSpec


def test_1f1b_order_on_each_stage():
    assert one_f_one_b(0, 3, 4) == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("B", 2), ("B", 3)]
    assert one_f_one_b(2, 3, 4) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2), ("F", 3), ("B", 3)]
    # fewer micro-batches than stages: all forwards first
    assert one_f_one_b(0, 4, 2) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,micro", [(2, 4), (4, 4), (4, 8), (8, 16), (3, 1)])
def test_every_micro_batch_runs_once_each_way(name, stages, micro):
    for s in range(stages):
        order = schedule_for(name, s, stages, micro)
        assert sorted(order) == sorted([("F", i) for i in range(micro)] + [("B", i) for i in range(micro)])
        assert all(order.index(("F", i)) < order.index(("B", i)) for i in range(micro))


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,micro", [(2, 4), (4, 4), (4, 8), (8, 16)])
def test_bubble_is_the_textbook_fraction(name, stages, micro):
    """Equal pass times (backward = 2 forwards): idle share (p-1)/(m+p-1), for both schedules."""
    sim = simulate(name, stages, micro, forward_time=1.0, backward_time=2.0)
    assert sim["bubble"] == pytest.approx((stages - 1) / (micro + stages - 1))


def test_activations_held():
    assert [max_in_flight(gpipe(s, 4, 8)) for s in range(4)] == [8, 8, 8, 8]
    assert [max_in_flight(one_f_one_b(s, 4, 8)) for s in range(4)] == [4, 3, 2, 1]


def test_unknown_schedule():
    with pytest.raises(ValueError, match="'interleaved' is not one of"):
        schedule_for("interleaved", 0, 2, 4)


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
