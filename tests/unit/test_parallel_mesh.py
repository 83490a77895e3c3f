"""The process mesh's rank layout, tensor splits and their checkpoint names, and the memory divisors: pure functions."""
import pytest
import torch

from zeroengine.checkpoint import tensor_split as ts
from zeroengine.env_report import main as ze_report
from zeroengine.estimate import estimate_memory
from zeroengine.parallel.mesh import _axis_members, build_mesh, describe_layout
from zeroengine.tensor_parallel.layers import TensorSplit


def test_ranks_follow_megatrons_order():
    pp, dp, tp = 2, 3, 2
    members = _axis_members(pp, dp, tp)
    assert members["tensor"][0] == [0, 1] and members["data"][0] == [0, 2, 4] and members["pipe"][0] == [0, 6]
    for axis in ("data", "tensor", "pipe"):  # each axis's groups cover the world once
        assert sorted(r for g in members[axis] for r in g) == list(range(pp * dp * tp))
    assert members["model"][1] == [2, 3, 8, 9]  # tensor × pipe at data index 1


def test_a_world_of_one_is_its_own_mesh():
    mesh = build_mesh()
    assert (mesh.pp, mesh.dp, mesh.tp, mesh.coords()) == (1, 1, 1, (0, 0, 0)) and not mesh.model_parallel


def test_describe_layout_and_its_errors():
    text = describe_layout(8, pp=2, tp=2)
    assert "pipeline 2 × data 2 × tensor 2" in text and "[0, 4]" in text
    with pytest.raises(ValueError, match="must divide the world size"):
        describe_layout(6, tp=4)


def test_ze_report_prints_the_mesh(capsys):
    assert ze_report(["--world", "4", "--tp", "2"]) == 0
    assert "tensor groups of 2: [0, 1], [2, 3]" in capsys.readouterr().out


@pytest.mark.parametrize("dim,blocks", [(0, 1), (1, 1), (1, 3), (0, 3)])
@pytest.mark.parametrize("parts", [1, 2, 4])
def test_tensor_split_round_trips(dim, blocks, parts):
    full = torch.arange(12 * 24, dtype=torch.float32).view(12, 24)
    split = TensorSplit(dim, parts, 0, blocks, tuple(full.shape))
    pieces = [split.shard(full, rank=r) for r in range(parts)]
    assert torch.equal(split.merge(pieces), full)
    if blocks == 3:  # each piece holds its slice of every block (whole heads of q, k and v)
        thirds = full.chunk(3, dim=dim)
        assert torch.equal(pieces[0].chunk(3, dim=dim)[0], thirds[0].chunk(parts, dim=dim)[0])


def test_checkpoint_names_of_pieces():
    split = TensorSplit(0, 2, 1, 1, (4, 4))
    name = ts.piece_name("h.0.attn.c_attn.weight", split)
    assert name == "h.0.attn.c_attn.weight@tp1/2" and ts.base_name(name) == "h.0.attn.c_attn.weight"
    params = {"w@tp0/2": {"shape": [2, 4], "split": split.as_dict()}, "w@tp1/2": {"shape": [2, 4]}, "b": {"shape": [4]}}
    assert ts.stored_pieces(params, "w") == ["w@tp0/2", "w@tp1/2"] and ts.stored_pieces(params, "b") == ["b"]
    assert ts.stored_pieces({"w@tp1/2": {}}, "w") is None  # an incomplete set is not a parameter


def test_estimate_divides_by_tensor_and_pipeline_sizes():
    psi = 1_200_000
    whole = estimate_memory(psi, 2, 1, dtype=torch.bfloat16)
    split = estimate_memory(psi, 2, 1, dtype=torch.bfloat16, tensor_parallel_size=2, pipeline_parallel_size=3)
    assert split["total"] == pytest.approx(whole["total"] / 6)
    assert split["total"] == pytest.approx(4 * psi / 6 + 12 * psi / 12)  # 4Ψ/(TP) + 12Ψ/(TPN)
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        estimate_memory(psi, 2, 1, tensor_parallel_size=0)
