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


SGD = {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-3}}


def cpu_and_nvme(rank, world, stage, dtype, path, extra, param=None, zero=None, optimizer=None):
    """The same run with CPU offload and with NVMe offload (``extra``: offload_optimizer keys; ``param``:
    offload_param keys, to offload the parameters to NVMe as well; ``zero``: other zero_optimization keys;
    ``optimizer``: the config's optimizer block instead of AdamW)."""
    states = 1 if optimizer is not None else 2  # (SGD with momentum: one buffer; Adam: two moments)
    batches = global_batches(STEPS, 2, world, 2)
    out = {}
    for device in ("cpu", "nvme"):
        cfg = base_config(2, 2, world, 0.5, dtype=dtype, stage=stage)
        cfg["zero_optimization"].update(zero or {})
        if optimizer is not None:
            cfg["optimizer"] = optimizer
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        if param is not None:
            cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
        if device == "nvme":
            _nvme(cfg, path, **extra)
            if param is not None:
                cfg["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": path, **param}
        model = make_model()
        if param is not None:  # a frozen parameter: stage 3 keeps it in a buffer (and a swap file) of its own
            model.wpe.weight.requires_grad_(False)
        engine, _, _, _ = zeroengine.initialize(model=model, config=cfg)
        swapper = engine.optimizer.swapper
        losses = _edit_and_train(engine, rank, world, batches)
        breakdown = engine.memory_breakdown()
        if device == "nvme":
            host = [b for b in engine.optimizer.layout.buckets if engine.optimizer.on_host(b.index)]
            masters = 4 * sum(b.chunk_numel for b in host)
            state_bytes = states * 4 * sum(w.numel for b in host for w in b.pieces_in_chunk(engine.optimizer.rank))
            # the masters and both moments are in the files only; the host holds the pool
            params = sum(buffer.swap.drive_bytes() for buffer in (engine.optimizer.flat_params,
                                                                   getattr(engine.optimizer, "frozen_params", None))
                         if getattr(buffer, "swap", None) is not None)
            assert breakdown["nvme"] == masters + state_bytes + params and (params > 0) == (param is not None)
            if "ratio" not in extra:  # (partial offload: the resident buckets' masters and state are in memory)
                assert breakdown["master_params"] == masters and breakdown["optimizer_states"] == state_bytes
            assert all(engine.optimizer.chunks[b.index].numel() == 0 for b in host)
            pool = sum(t.untyped_storage().nbytes() for t in swapper.pool_tensors())
            assert len(swapper.pool_tensors()) == extra.get("buffer_count", 4) and pool > 0
            assert sorted(os.listdir(swapper.folder.path)) == ["masters.swp"] + [f"state{k}.swp"
                                                                               for k in range(1, states + 1)]
            folder = swapper.folder.path
            if param is not None:
                _check_parameters_on_the_drive(engine, param, breakdown)
        else:
            assert swapper is None and breakdown["nvme"] == 0
        out[device] = (losses, full_state(engine), breakdown)
        engine.destroy()
    assert not os.path.exists(folder)  # destroy() removes the swap folder
    return out


def _check_parameters_on_the_drive(engine, param, breakdown):
    """offload_param "nvme": the chunks beyond max_in_cpu are in the swap file only, the reads went through the
    pool (buffer_count buffers at most), and the trainable and frozen buffers' files are in memory_breakdown."""
    buffers = [engine.optimizer.flat_params, engine.optimizer.frozen_params]
    drive = kept = 0
    for buffer in buffers:
        swap = buffer.swap
        in_memory = sum(b.chunk_numel for b in buffer.layout.buckets if not buffer.on_drive(b))
        assert buffer.shard.numel() == in_memory
        kept += in_memory
        assert len(swap.pool_tensors()) <= param.get("buffer_count", 5)
        assert (swap.stats["read_bytes"] > 0) == (swap.drive_bytes() > 0)
        assert os.listdir(swap.folder.path) == (["params.swp"] if swap.drive_bytes() else [])
        drive += swap.drive_bytes()
    assert drive > 0 and kept <= param["max_in_cpu"]  # max_in_cpu is shared by the trainable and frozen buffers
    if param.get("buffer_count") == 1:  # prefetches in flight wait for the one read buffer
        assert engine.optimizer.flat_params.swap.stats["waits_for_a_buffer"] > 0


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
    (2, "bf16", {"ratio": 0.5, "pipeline_read": True}),  # partial: the rest steps beside the parameters
])
def test_16bit_equals_cpu_offload_bitwise(tmp_path, stage, dtype, extra):
    """(Partial offload equals full offload bitwise in bf16: test_offload_copy_out.)"""
    for result in run_distributed(cpu_and_nvme, 2, stage, dtype, str(tmp_path), extra):
        _assert_identical(result["cpu"], result["nvme"])


@pytest.mark.parametrize("dtype,param,zero", [
    ("fp32", {"max_in_cpu": 0}, {}),  # every chunk on the drive
    ("bf16", {"max_in_cpu": 0, "buffer_count": 1}, {}),  # prefetches share one read buffer
    ("fp32", {"max_in_cpu": 3000, "buffer_count": 2}, {"stage3_param_persistence_threshold": 100}),
])
def test_parameters_on_nvme_too_equal_cpu_offload_bitwise(tmp_path, dtype, param, zero):
    """Both offloads on NVMe at stage 3 (some chunks kept in memory by max_in_cpu, small parameters persistent
    in the last case), a frozen parameter included."""
    extra = {"pipeline_read": True, "pipeline_write": True}
    for result in run_distributed(cpu_and_nvme, 2, 3, dtype, str(tmp_path), extra, param, zero):
        _assert_identical(result["cpu"], result["nvme"])


def save_nvme_run(rank, world, stage, save_dir, path):
    cfg = _nvme(config(world, stage), path, pipeline_read=True)
    cfg["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": path, "max_in_cpu": 0}
    engine, _, _, _ = zeroengine.initialize(model=make_model(), config=cfg)
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


@pytest.mark.parametrize("stage,param", [(2, None), (3, {"max_in_cpu": 0})])
def test_sgd_with_momentum_equals_cpu_offload_bitwise(tmp_path, stage, param):
    """An optimizer other than Adam (one state buffer, no moments): a gradient or update off by a constant factor,
    which Adam's normalisation would hide, shows here."""
    ref_losses, _ = reference_run(STEPS, 2, 2, micro=2, clip=0.5,
                                  make_optimizer=lambda params: torch.optim.SGD(params, **SGD["params"]))
    for result in run_distributed(cpu_and_nvme, 2, stage, "fp32", str(tmp_path), {"pipeline_read": True}, param,
                                  None, SGD):
        _assert_identical(result["cpu"], result["nvme"])
        if param is None:  # before the edit, against torch's SGD in one process (param runs freeze wpe)
            torch.testing.assert_close(torch.tensor(result["nvme"][0][:2]), torch.tensor(ref_losses[:2]),
                                       atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def nvme_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("nvme_ckpt")
    (root / "swap").mkdir()
    save_dir = str(root / "run")
    return root, save_dir, run_distributed(save_nvme_run, 2, 3, save_dir, str(root / "swap"))[0]


@pytest.mark.parametrize("world,stage,nvme", [(1, 2, True), (2, 3, False)])
def test_a_checkpoint_of_an_nvme_run_resumes_elsewhere_exactly(nvme_checkpoint, world, stage, nvme):
    """Saved at stage 3 on two ranks with parameters and optimizer state on NVMe; resumed on one rank at stage 2
    with the optimizer on NVMe, and on two at stage 3 without offload: the same weights, and training goes on
    as the uninterrupted run."""
    root, save_dir, (saved, losses, final) = nvme_checkpoint
    for loaded, got_losses, got_final in run_distributed(load_into, world, stage, save_dir,
                                                         str(root / "swap") if nvme else None):
        for name, value in saved.items():
            assert torch.equal(loaded[name], value), name
        torch.testing.assert_close(torch.tensor(got_losses), torch.tensor(losses), atol=1e-6, rtol=0)
        for name, value in final.items():
            torch.testing.assert_close(got_final[name], value, atol=1e-6, rtol=0)


def built_on_the_drive(rank, world, dtype, path):
    """The same model built under zero.Init with its slices in host memory and on the drive, then trained."""
    import gc

    batches = global_batches(3, 1, world, 2)
    out = {}
    for remote in ("cpu", "nvme"):
        cfg = base_config(2, 1, world, 0.5, dtype=dtype, stage=3)
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
        if remote == "nvme":
            cfg["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": path, "max_in_cpu": 0}
        with zeroengine.zero.Init(config=cfg, remote_device=remote) as init:
            model = make_model()
        slices = [zeroengine.zero.param_guard.info_of(p).init_shard for p in model.parameters()]
        if remote == "nvme":  # nothing of the slices in memory: a region of init.swp each
            mine = [d for d in os.listdir(path) if f"-{os.getpid()}-" in d]  # this rank's swap folders
            assert [os.listdir(os.path.join(path, d)) for d in mine] == [["init.swp"]]
            assert all(s.nbytes == 0 and s.shard.numel() == 0 and s.region is not None for s in slices)
        del slices
        engine, _, _, _ = zeroengine.initialize(model=model, config=cfg)
        gc.collect()
        left = sorted(f for d in os.listdir(path) if f"-{os.getpid()}-" in d for f in os.listdir(os.path.join(path, d)))
        out[remote] = (engine_losses(engine, batches, rank, world), full_state(engine), init.peak_bytes, left)
        engine.destroy()
    return out


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_zero_init_builds_the_model_onto_the_drive(tmp_path, dtype):
    """zero.Init(remote_device="nvme"): every slice goes to a swap file as it is made (bf16 also spills the fp32
    pieces kept for the masters); initialize() re-cuts them onto the parameter swap, the Init files go, and
    training is bit-identical to building in host memory."""
    for result in run_distributed(built_on_the_drive, 2, dtype, str(tmp_path)):
        _assert_identical(result["cpu"][:2], result["nvme"][:2])
        assert result["nvme"][2] <= result["cpu"][2]  # Init's own peak: the slices are not counted
        assert result["nvme"][3] == ["params.swp"] and result["cpu"][3] == []
