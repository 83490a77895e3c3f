"""Optimizer offload to NVMe (``offload_optimizer.device: "nvme"``) in gloo worlds.

The swap moves bytes, never changes them: every run here is bit-identical to the same run with CPU offload
(the same C++ Adam on the same masters), which test_zero_parity checks against one process; fp32 is also
checked against the single-process reference directly. Between steps no master or moment is in host memory,
memory_breakdown() says where they are, and checkpoints of an NVMe run load anywhere.
"""
import os

import pytest
import torch
from parity import base_config, engine_losses, global_batches, reference_run
from test_checkpoint_reshard import SAVE_AT, config, full_state, make_model, train

import zeroengine
from zeroengine.testing import run_distributed
from zeroengine.zero import GatheredParameters

STEPS = 4


def _nvme(cfg, path, **extra):
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": path, **extra}
    return cfg


def _edit_and_train(engine, rank, world, batches):
    """Train, then edit a weight inside a modifying GatheredParameters (the masters must follow), train on."""
    losses = engine_losses(engine, batches[:2], rank, world)
    with GatheredParameters([engine.module.wpe.weight], modifier_rank=0):
        if rank == 0:
            engine.module.wpe.weight.data.mul_(0.5)
    return losses + engine_losses(engine, batches[2:], rank, world)


def cpu_and_nvme(rank, world, stage, dtype, path, extra):
    batches = global_batches(STEPS, 2, world, 2)
    out = {}
    for device in ("cpu", "nvme"):
        cfg = base_config(2, 2, world, 0.5, dtype=dtype, stage=stage)
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        if device == "nvme":
            _nvme(cfg, path, **extra)
        engine, _, _, _ = zeroengine.initialize(model=make_model(), config=cfg)
        swapper = engine.optimizer.swapper
        losses = _edit_and_train(engine, rank, world, batches)
        breakdown = engine.memory_breakdown()
        if device == "nvme":
            host = [b for b in engine.optimizer.layout.buckets if engine.optimizer.on_host(b.index)]
            masters = 4 * sum(b.chunk_numel for b in host)
            states = 2 * 4 * sum(w.numel for b in host for w in b.pieces_in_chunk(engine.optimizer.rank))
            # the masters and both moments are in the files only; the host holds the pool
            assert breakdown["nvme"] == masters + states
            assert breakdown["master_params"] == masters and breakdown["optimizer_states"] == states
            assert all(c.numel() == 0 for c in engine.optimizer.chunks)
            pool = sum(t.untyped_storage().nbytes() for t in swapper.pool_tensors())
            assert len(swapper.pool_tensors()) == extra.get("buffer_count", 4) and pool > 0
            assert sorted(os.listdir(swapper.folder.path)) == ["masters.swp", "state1.swp", "state2.swp"]
            folder = swapper.folder.path
        else:
            assert swapper is None and breakdown["nvme"] == 0
        out[device] = (losses, full_state(engine), breakdown)
        engine.destroy()
    assert not os.path.exists(folder)  # destroy() removes the swap folder
    return out


def _assert_identical(cpu, nvme):
    assert cpu[0] == nvme[0]
    for name, value in cpu[1].items():
        assert torch.equal(nvme[1][name], value), name


@pytest.mark.parametrize("stage,world", [(2, 2), (3, 2), (1, 4)])
def test_fp32_matches_one_process_and_cpu_offload_bitwise(tmp_path, stage, world):
    ref_losses, ref_params = reference_run(STEPS, 2, world, micro=2, clip=0.5)
    extra = {"pipeline_read": True, "pipeline_write": True} if stage == 3 else {}
    for result in run_distributed(cpu_and_nvme, world, stage, "fp32", str(tmp_path), extra):
        _assert_identical(result["cpu"], result["nvme"])
        # before the edit, against the plain single-process run (the edit halves wpe from then on)
        torch.testing.assert_close(torch.tensor(result["nvme"][0][:2]), torch.tensor(ref_losses[:2]), atol=1e-5,
                                   rtol=0)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("stage,dtype,extra", [
    (2, "bf16", {"buffer_count": 2, "pipeline_read": True, "pipeline_write": True}),
    (3, "bf16", {"buffer_count": 1}),
    (3, "fp16", {"buffer_count": 3, "pipeline_read": True}),
])
def test_16bit_equals_cpu_offload_bitwise(tmp_path, stage, dtype, extra):
    for result in run_distributed(cpu_and_nvme, 2, stage, dtype, str(tmp_path), extra):
        _assert_identical(result["cpu"], result["nvme"])


def save_nvme_run(rank, world, stage, save_dir, path):
    engine, _, _, _ = zeroengine.initialize(model=make_model(), config=_nvme(config(world, stage), path,
                                                                             pipeline_read=True))
    train(engine, rank, world, 0, SAVE_AT)
    engine.save_checkpoint(save_dir, tag="nvme")
    swapper = engine.optimizer.swapper
    assert swapper.materialized == {} and all(c.numel() == 0 for c in engine.optimizer.chunks)
    saved = full_state(engine)
    losses = train(engine, rank, world, SAVE_AT, 3)
    return saved, losses, full_state(engine)


def load_into(rank, world, stage, save_dir, path):
    cfg = config(world, stage)
    if path is not None:
        _nvme(cfg, path)
    engine, _, _, _ = zeroengine.initialize(model=make_model(seed=7), config=cfg)
    engine.load_checkpoint(save_dir)
    if path is not None:
        assert engine.optimizer.swapper.materialized == {}
        assert all(c.numel() == 0 for c in engine.optimizer.chunks)
    loaded = full_state(engine)
    return loaded, train(engine, rank, world, SAVE_AT, 3), full_state(engine)


@pytest.fixture(scope="module")
def nvme_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("nvme_ckpt")
    (root / "swap").mkdir()
    save_dir = str(root / "run")
    return root, save_dir, run_distributed(save_nvme_run, 2, 3, save_dir, str(root / "swap"))[0]


@pytest.mark.parametrize("world,stage,nvme", [(1, 2, True), (2, 3, False)])
def test_a_checkpoint_of_an_nvme_run_resumes_elsewhere_exactly(nvme_checkpoint, world, stage, nvme):
    """Saved at stage 3 on two ranks with the state on NVMe; resumed on one rank at stage 2 with NVMe again, and
    on two at stage 3 without offload: the same weights, and training goes on as the uninterrupted run."""
    root, save_dir, (saved, losses, final) = nvme_checkpoint
    for loaded, got_losses, got_final in run_distributed(load_into, world, stage, save_dir,
                                                         str(root / "swap") if nvme else None):
        for name, value in saved.items():
            assert torch.equal(loaded[name], value), name
        torch.testing.assert_close(torch.tensor(got_losses), torch.tensor(losses), atol=1e-6, rtol=0)
        for name, value in final.items():
            torch.testing.assert_close(got_final[name], value, atol=1e-6, rtol=0)
