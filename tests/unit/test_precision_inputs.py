"""Inputs of forward under 16-bit training: as DeepSpeed, cast to fp16 only with fp16.auto_cast (inside
lists, tuples and dicts too), never under bf16, so float targets are not rounded behind the user's back."""
from collections import namedtuple

import torch

from zeroengine.precision.policy import PrecisionPolicy

Pair = namedtuple("Pair", "x y")


def test_without_auto_cast_inputs_reach_the_model_as_given():
    target = torch.tensor([1000.3])
    for dtype in (torch.float16, torch.bfloat16):
        assert PrecisionPolicy(dtype).cast_input(target) is target


def test_auto_cast_casts_floating_tensors_everywhere_and_leaves_the_rest():
    policy = PrecisionPolicy(torch.float16, auto_cast=True)
    ids = torch.arange(3)
    out = policy.cast_input({"x": [torch.ones(2), (torch.zeros(1), ids)], "pair": Pair(torch.ones(1), 3), "s": "a"})
    assert out["x"][0].dtype == torch.float16 and out["x"][1][0].dtype == torch.float16
    assert out["x"][1][1] is ids and out["s"] == "a"
    assert isinstance(out["pair"], Pair) and out["pair"].x.dtype == torch.float16 and out["pair"].y == 3


class Recorder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1))
        self.seen = []

    def forward(self, x, target):
        self.seen.append((x.dtype, target.dtype, target.item()))
        return ((x.to(self.w.dtype) * self.w).float().sum() - target.float()).pow(2).sum()


def test_the_engine_passes_fp32_targets_through_unless_auto_cast():
    import zeroengine
    for auto_cast, expected in ((False, (torch.float32, torch.float32, 1000.2999877929688)),
                                (True, (torch.float16, torch.float16, 1000.5))):
        model = Recorder()
        engine, _, _, _ = zeroengine.initialize(model=model, config={
            "train_batch_size": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.0}},
            "fp16": {"enabled": True, "auto_cast": auto_cast}})
        engine(torch.ones(1), torch.tensor([1000.3]))
        assert model.seen[-1] == expected
