"""The process mesh's edges: a Megatron mpu that lacks what ZeRO needs, the gradient norm with an mpu that has
tensor parallelism but no model-parallel group, tensor-parallel layers built without a group, and two worlds
one after the other in one process (a notebook, back-to-back trainer.fit calls)."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.distributed as dist
from megatron_mpu import TensorMpu
from parity import ADAM_EPS, base_config

import zeroengine
from zeroengine import comm
from zeroengine.comm.groups import new_group
from zeroengine.moe.groups import expert_groups
from zeroengine.parallel import build_mesh
from zeroengine.parallel.mesh import current_mesh, use_mesh
from zeroengine.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from zeroengine.testing import free_port, run_distributed

CLIP = 0.05  # below the gradient norm: the clipping (and so the norm) shows in the weights


def _batch(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)


def _train_with_tensor_only_mpu(rank, world, stage):
    mpu = TensorMpu()
    torch.manual_seed(0)
    model = torch.nn.Sequential(ColumnParallelLinear(8, 16, group=mpu.tp), torch.nn.Tanh(),
                                RowParallelLinear(16, 8, group=mpu.tp))
    engine, *_ = zeroengine.initialize(model=model, config=base_config(2, 1, 2, CLIP, lr=1e-2, stage=stage), mpu=mpu)
    norms = []
    for step in range(2):
        x, target = _batch(step)
        rows = slice(2 * mpu.get_data_parallel_rank(), 2 * mpu.get_data_parallel_rank() + 2)
        engine.backward((engine(x[rows]) - target[rows]).pow(2).mean())
        engine.step()
        norms.append(engine.get_global_grad_norm())
    return norms


@pytest.mark.parametrize("stage", [0, 1])
def test_the_gradient_norm_with_an_mpu_lacking_a_model_group_adds_up_over_the_tensor_group(stage):
    results = run_distributed(_train_with_tensor_only_mpu, 4, stage)
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8))
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01, eps=ADAM_EPS)
    norms = []
    for step in range(2):
        x, target = _batch(step)
        (ref(x) - target).pow(2).mean().backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
    for r in results:
        assert r == pytest.approx(norms, rel=1e-5)


class NoDataGroupMpu:
    """An mpu for activation checkpointing's model-parallel group only: no data-parallel methods."""

    def get_model_parallel_group(self):
        return None

    def get_model_parallel_world_size(self):
        return 1

    def get_model_parallel_rank(self):
        return 0


class PipelineMpuWithoutModelGroup(TensorMpu):
    def get_pipeline_model_parallel_world_size(self):
        return 2

    def get_pipeline_model_parallel_group(self):
        return self.dp

    def get_pipeline_model_parallel_rank(self):
        return self.rank // 2

    def get_data_parallel_world_size(self):
        return 1

    def get_data_parallel_group(self):
        return new_group([comm.get_rank()])


def _refused_mpu(rank, world, mpu_type):
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError) as caught:
        zeroengine.initialize(model=model, config=base_config(2, 1, world, CLIP, stage=1), mpu=mpu_type())
    comm.barrier()  # (a rank returning early would close the store another still makes groups with)
    return str(caught.value)


def test_an_mpu_without_a_data_parallel_group_is_refused_naming_the_method():
    """It used to be ignored: ZeRO then averaged over the whole world."""
    for message in run_distributed(_refused_mpu, 2, NoDataGroupMpu):
        assert "the mpu lacks get_data_parallel_group" in message


def test_an_mpu_with_tensor_and_pipeline_parallelism_needs_its_model_group():
    for message in run_distributed(_refused_mpu, 4, PipelineMpuWithoutModelGroup):
        assert "the mpu lacks get_model_parallel_group" in message and "tensor × pipeline" in message


def _default_tensor_group(rank, world):
    assert current_mesh().tp == 1  # no tensor-parallel mesh yet: layers are not split
    two, four = build_mesh(tp=2), build_mesh(tp=4)
    with pytest.raises(ValueError, match=r"meshes of 2 tensor-parallel sizes \(\[2, 4\]\)"):
        ColumnParallelLinear(8, 8)
    with use_mesh(two):
        assert ColumnParallelLinear(8, 8).weight.shape == (4, 8)
    with use_mesh(four):
        layer = ColumnParallelLinear(8, 8)
        assert layer.weight.shape == (2, 8)
    # a layer split 4 ways trained on a mesh that splits 2 ways is refused, naming the parameter
    with pytest.raises(ValueError, match=r"parameter '0.weight' .* is split 4 ways, but the mesh splits tensors 2"):
        zeroengine.initialize(model=torch.nn.Sequential(layer), config={**base_config(2, 1, 2, CLIP),
                                                                        "tensor_parallel": {"autotp_size": 2}})
    comm.barrier()
    return True


def test_layers_built_without_a_group_take_the_enclosing_or_the_only_tensor_mesh():
    assert run_distributed(_default_tensor_group, 4) == [True] * 4


def _host_twin_of_the_world():
    """host_group(None) as on NCCL, where the world gets a gloo twin (gloo stands in for NCCL here)."""
    real = dist.get_backend
    dist.get_backend = lambda group=None: "nccl" if group is None else real(group)
    try:
        return comm.host_group(None)
    finally:
        dist.get_backend = real


def _two_worlds(rank, world, second_port, teardown):
    first = build_mesh(tp=2)
    first_experts = expert_groups(2)
    first_twin = _host_twin_of_the_world()
    dead = weakref.ref(first.tp_group)
    if teardown == "comm.shutdown":
        comm.shutdown()
    else:  # a framework tearing its world down itself (Lightning, accelerate)
        dist.destroy_process_group()
    del first, first_experts
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{second_port}", rank=rank, world_size=world)
    second = build_mesh(tp=2)
    gc.collect()
    assert dead() is None  # no cache keeps the first world's groups
    assert current_mesh() is second
    values = torch.ones(1)
    comm.all_reduce(values, group=second.tp_group)  # a dead group would raise here
    comm.all_reduce(values, group=expert_groups(2).ep_group)
    twin = _host_twin_of_the_world()
    assert twin is not first_twin
    comm.all_reduce(values, group=twin)
    return float(values)


@pytest.mark.parametrize("teardown", ["comm.shutdown", "destroy_process_group"])
def test_a_second_world_in_the_same_process_gets_its_own_groups(teardown):
    assert run_distributed(_two_worlds, 4, free_port(), teardown) == [16.0] * 4
