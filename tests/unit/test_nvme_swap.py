"""The NVMe swap of optimizer state (zeroengine/offload/nvme), one process: streamed through every pool size and
pipeline setting, the masters and Adam's moments step exactly as they do in memory, and nothing of them stays
in host memory between steps; the swap folder's lifecycle and its refusals."""
import errno
import os
import subprocess
from types import SimpleNamespace

import pytest
import torch

from zeroengine.config import ConfigError
from zeroengine.offload.nvme import OptimizerSwapper, SwapFolder
from zeroengine.offload.nvme.optimizer_swap import aligned_numel
from zeroengine.offload.nvme.swap_folder import PREFIX
from zeroengine.ops.adam import CPUAdam

AIO = {"block_size": 4096, "queue_depth": 4, "intra_op_parallelism": 1}
# three buckets of uneven sizes, cut into pieces at uneven places (as a layout cuts a rank's chunks)
NUMELS = [1500, 4100, 700]
CUTS = [[0, 600, 1500], [0, 1, 2048, 4000], [0, 700]]  # the last bucket's chunk has 100 elements of padding


def _wheres(b):
    cuts = CUTS[b]
    return [SimpleNamespace(chunk_start=lo, numel=hi - lo) for lo, hi in zip(cuts, cuts[1:])]


def _masters(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) for n in NUMELS]


def _grads(step):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(n, generator=g) for n in NUMELS]


def _in_memory_run(steps):
    """The reference: the same pieces and CPU Adam, everything in memory."""
    chunks = _masters()
    pieces = [[torch.nn.Parameter(c[w.chunk_start:w.chunk_start + w.numel]) for w in _wheres(b)]
              for b, c in enumerate(chunks)]
    opt = CPUAdam([p for ps in pieces for p in ps], lr=1e-2, weight_decay=0.01)
    for step in range(steps):
        for b, grad in enumerate(_grads(step)):
            for w, p in zip(_wheres(b), pieces[b]):
                p.grad = grad[w.chunk_start:w.chunk_start + w.numel]
            opt.step()
            for p in pieces[b]:
                p.grad = None
    return chunks, opt, pieces


def _swapped_run(tmp_path, steps, buffer_count, pipeline_read, pipeline_write, checkpoint_after=None):
    chunks, pieces = [], []
    opt = None
    folder = SwapFolder(str(tmp_path), "zero_optimization.offload_optimizer.nvme_path")
    for b, master in enumerate(_masters()):
        chunks.append(master.clone())
        pieces.append([torch.nn.Parameter(chunks[b][w.chunk_start:w.chunk_start + w.numel]) for w in _wheres(b)])
    opt = CPUAdam([p for ps in pieces for p in ps], lr=1e-2, weight_decay=0.01)
    swapper = OptimizerSwapper(opt, chunks, pieces, {b: _wheres(b) for b in range(3)},
                               {b: n for b, n in enumerate(NUMELS)}, [0, 1, 2], folder, AIO, buffer_count,
                               pipeline_read, pipeline_write, pin=False)
    for b in range(3):
        swapper.store_initial(b)
    assert all(c.numel() == 0 for c in chunks) and all(p.numel() == 0 for ps in pieces for p in ps)
    order = [0, 1, 2]
    for step in range(steps):
        grads = _grads(step)
        swapper.start(order)
        for i, b in enumerate(order):
            swapper.bring_in(i)
            for w, p in zip(_wheres(b), pieces[b]):
                p.grad = grads[b][w.chunk_start:w.chunk_start + w.numel]
            opt.step()
            for p in pieces[b]:
                p.grad = None
            swapper.send_out(i)
        swapper.finish()
        # between steps no master or moment is in host memory: everything points at nothing
        assert all(c.numel() == 0 for c in chunks)
        assert all(v.numel() == 0 for s in opt.state.values() for v in s.values() if v.dim() > 0)
        if checkpoint_after == step:
            swapper.materialize_all()  # a save reads every value, then gives the memory back
            swapper.release_all(write=False)
    return swapper, chunks, opt, pieces, folder


@pytest.mark.parametrize("buffer_count,pipeline_read,pipeline_write", [
    (1, False, False), (1, True, True), (2, True, False), (2, True, True), (3, True, True), (4, False, True),
    (4, True, False), (5, True, True)])
def test_every_pool_size_and_pipeline_steps_exactly_as_in_memory(tmp_path, buffer_count, pipeline_read,
                                                                  pipeline_write):
    steps = 3
    ref_chunks, ref_opt, ref_pieces = _in_memory_run(steps)
    swapper, chunks, opt, pieces, folder = _swapped_run(tmp_path, steps, buffer_count, pipeline_read,
                                                        pipeline_write, checkpoint_after=1)
    swapper.materialize_all()
    for b in range(3):
        real = sum(w.numel for w in _wheres(b))
        assert torch.equal(chunks[b][:real], ref_chunks[b][:real]), b
        for p, ref in zip(pieces[b], ref_pieces[b]):
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(opt.state[p][key], ref_opt.state[ref][key]), (b, key)
            assert opt.state[p]["step"] == ref_opt.state[ref]["step"]
    assert sorted(os.listdir(folder.path)) == ["masters.swp", "state1.swp", "state2.swp"]
    # the files: every bucket at an aligned offset, in each of the three files
    per_file = sum(aligned_numel(n) for n in NUMELS) * 4
    assert all(os.path.getsize(os.path.join(folder.path, f)) == per_file for f in os.listdir(folder.path))
    nvme = swapper.nvme_bytes()
    assert nvme == {"master_params": 4 * sum(NUMELS), "optimizer_states": 2 * 4 * sum(w.numel for b in range(3)
                                                                                   for w in _wheres(b))}
    # the pool: buffer_count slots of the largest bucket's three regions
    assert [t.numel() for t in swapper.pool_tensors()] == [3 * aligned_numel(max(NUMELS))] * buffer_count
    swapper.release_all(write=False)
    swapper.close()
    assert not os.path.exists(folder.path)


def test_reads_run_ahead_only_with_pipeline_read(tmp_path, monkeypatch):
    """pipeline_read: bucket i+1's read is in flight while bucket i steps (buffer_count 4 with pipeline_write
    reads two ahead); without it, each read starts when its bucket's turn comes."""
    for pipeline_read, expected in ((True, [[0, 1, 2], [0, 1, 2], [0, 1, 2]]), (False, [[0], [0, 1], [0, 1, 2]])):
        swapper, chunks, opt, pieces, folder = _swapped_run(tmp_path, 1, 4, pipeline_read, True)
        issued = []
        real_read = swapper._read
        monkeypatch.setattr(swapper, "_read", lambda slot, b: issued.append(b) or real_read(slot, b))
        swapper.start([0, 1, 2])
        seen = []
        for i in range(3):
            swapper.bring_in(i)
            seen.append(list(issued))
            swapper.send_out(i)
        swapper.finish()
        assert seen == expected, pipeline_read
        swapper.close()


def test_the_folder_is_checked_and_made_per_process(tmp_path):
    key = "zero_optimization.offload_optimizer.nvme_path"
    with pytest.raises(ConfigError, match=f"{key}: .*missing does not exist or is not a folder"):
        SwapFolder(str(tmp_path / "missing"), key)
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="is not a folder"):
        SwapFolder(str(tmp_path / "file"), key)
    a, b = SwapFolder(str(tmp_path), key), SwapFolder(str(tmp_path), key)
    assert a.path != b.path and os.path.basename(a.path).startswith(PREFIX) and os.path.isdir(a.path)
    a.remove()
    assert not os.path.exists(a.path) and os.path.isdir(b.path)
    b.remove()


def test_a_dead_processes_folder_is_removed_and_a_live_ones_kept(tmp_path):
    import socket

    gone_pid = _a_pid_that_is_gone()
    host = socket.gethostname()
    stale = tmp_path / f"{PREFIX}{host}-{gone_pid}-abcd"
    live = tmp_path / f"{PREFIX}{host}-{os.getpid()}-ef01"
    other_host = tmp_path / f"{PREFIX}elsewhere-{gone_pid}-0000"
    for d in (stale, live, other_host):
        d.mkdir()
        (d / "masters.swp").write_bytes(b"x")
    folder = SwapFolder(str(tmp_path), "k")
    assert not stale.exists() and live.exists() and other_host.exists()
    folder.remove()


def _a_pid_that_is_gone() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_drive_too_small_names_the_path_and_the_bytes(tmp_path, monkeypatch):
    folder = SwapFolder(str(tmp_path), "zero_optimization.offload_optimizer.nvme_path")

    def no_room(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", no_room)
    with pytest.raises(ConfigError) as err:
        folder.reserve("masters.swp", 123456789)
    text = str(err.value)
    assert text.startswith("zero_optimization.offload_optimizer.nvme_path:") and folder.path in text
    assert "masters.swp needs 123456789 bytes" in text and "are free" in text
    folder.remove()


@pytest.fixture
def small_mount(tmp_path):
    """A 256 KiB tmpfs (skips where this machine does not let the tests mount one)."""
    where = tmp_path / "small"
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(where)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield where
    subprocess.run(["umount", str(where)], check=False)


def test_a_real_small_drive_and_a_read_only_one_are_refused_before_anything_runs(small_mount):
    folder = SwapFolder(str(small_mount), "k")
    folder.reserve("masters.swp", 64 * 1024)  # fits
    with pytest.raises(ConfigError, match=r"too small: the swap file state1.swp needs 1048576 bytes \(1114112 in "
                                          r"all for this process\)"):
        folder.reserve("state1.swp", 1 << 20)
    folder.remove()
    subprocess.run(["mount", "-o", "remount,ro", str(small_mount)], check=True)
    with pytest.raises(ConfigError, match="is not writable"):
        SwapFolder(str(small_mount), "k")


def _initialize_refusals(rank, world, cases):
    """``initialize`` with each (path, offload block) of ``cases`` in turn; the ConfigError text of each."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "tests"))
    from parity import base_config, make_model

    import zeroengine

    errors = []
    for path, key in cases:
        cfg = base_config(2, 1, world, 0.0, stage=3)
        cfg["zero_optimization"][key] = {"device": "nvme", "nvme_path": path}
        try:
            zeroengine.initialize(model=make_model(), config=cfg)
            errors.append(None)
        except ConfigError as err:
            errors.append(str(err))
    return errors


def test_initialize_refuses_a_missing_folder_and_a_small_drive_naming_the_key(tmp_path, small_mount):
    from zeroengine.testing import run_distributed

    missing, small, params = run_distributed(_initialize_refusals, 1, [
        (str(tmp_path / "nowhere"), "offload_optimizer"), (str(small_mount), "offload_optimizer"),
        (str(tmp_path / "nowhere"), "offload_param")])[0]
    assert missing.startswith("zero_optimization.offload_optimizer.nvme_path: ") and "does not exist" in missing
    # the tiny model's optimizer files take about 1.5 MB: more than the 256 KiB drive holds
    assert small.startswith("zero_optimization.offload_optimizer.nvme_path: the drive of ") and "too small" in small
    assert os.listdir(small_mount) == []  # the refused run's folder is gone
    assert params.startswith("zero_optimization.offload_param.nvme_path: ")
