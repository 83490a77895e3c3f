"""A stage-0 DeepSpeed checkpoint names its optimizer's parameters by position only (torch numbers them group
after group): with several param groups, zeroengine's reader deals the module's parameters into the groups by
the shapes of their state, and accepts only a unique fit (checkpoint/deepspeed/reader.py)."""
import pytest

from zeroengine.checkpoint.deepspeed.reader import _split_by_shapes
from zeroengine.checkpoint.files import CheckpointError

NAMES = ["a.w", "a.b", "n.w", "n.b", "b.w", "b.b"]
SHAPES = {"a.w": [16, 8], "a.b": [16], "n.w": [16], "n.b": [16], "b.w": [5, 16], "b.b": [5]}


def test_decay_and_no_decay_groups_are_told_apart():
    split = _split_by_shapes(NAMES, SHAPES, [[[16, 8], [5, 16]], [[16], [16], [16], [5]]], "ckpt")
    assert split == [["a.w", "b.w"], ["a.b", "n.w", "n.b", "b.b"]]


def test_an_ambiguous_or_impossible_fit_is_refused():
    with pytest.raises(CheckpointError, match="several assignments fit"):
        _split_by_shapes(NAMES, SHAPES, [[[16, 8], [16], [5, 16]], [[16], [16], [5]]], "ckpt")
    with pytest.raises(CheckpointError, match="no assignment fits"):
        _split_by_shapes(NAMES, SHAPES, [[[16, 8], [7]], [[16], [16], [16], [5]]], "ckpt")


def test_thousands_of_parameters_deal_without_recursion():
    names = [f"l{i}.{k}" for i in range(1500) for k in ("w", "b")]
    shapes = {n: [64, 64] if n.endswith("w") else [64] for n in names}
    matrices, vectors = _split_by_shapes(names, shapes, [[[64, 64]] * 1500, [[64]] * 1500], "ckpt")
    assert matrices == names[0::2] and vectors == names[1::2]
