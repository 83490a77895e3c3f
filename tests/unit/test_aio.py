"""The async I/O op (ops/csrc/aio/async_io_cpu.cpp) against its Python reference (zeroengine.ops.aio): tensors
written and read back at offsets, in pieces smaller than a request, aligned (O_DIRECT) or not; many requests and
one wait; errors that name the file; DeepSpeed's aio_handle API through the alias."""
import os

import pytest
import torch

from zeroengine.ops.aio import ALIGNMENT, AsyncIOHandle, aligned_empty

IMPLS = ["cpp", "python"]


@pytest.fixture(scope="module", params=IMPLS)
def impl(request):
    return request.param


def _handle(impl, block_size=8192, queue_depth=4, threads=2):
    return AsyncIOHandle(block_size, queue_depth, False, False, threads, impl=impl)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_tensors_written_at_offsets_read_back_equal(tmp_path, impl, dtype):
    handle = _handle(impl)
    assert handle.backend == impl
    g = torch.Generator().manual_seed(0)
    a = (torch.randn(10_001, generator=g) * 100).to(dtype)  # not a whole number of blocks
    b = (torch.randn(3_000, generator=g) * 100).to(dtype)
    path = tmp_path / "swap.bin"
    assert handle.async_pwrite(a, path) == 0
    assert handle.async_pwrite(b, str(path), file_offset=a.numel() * a.element_size()) == 0
    assert handle.wait() == 2
    assert os.path.getsize(path) == (a.numel() + b.numel()) * a.element_size()
    back_a, back_b = torch.empty_like(a), torch.empty_like(b)
    handle.async_pread(back_b, path, a.numel() * a.element_size())
    handle.async_pread(back_a, path)
    assert handle.wait() == 2
    assert torch.equal(back_a, a) and torch.equal(back_b, b)


def test_aligned_buffers_and_offsets_take_the_direct_path_and_agree(tmp_path, impl):
    handle = _handle(impl, block_size=1 << 16)
    data = aligned_empty(3 * (1 << 16) // 4, torch.float32)
    assert data.data_ptr() % ALIGNMENT == 0 and handle.is_pinned(data)
    data.copy_(torch.arange(data.numel(), dtype=torch.float32))
    path = tmp_path / "aligned.bin"
    assert handle.sync_pwrite(data, path, file_offset=ALIGNMENT) == 1
    back = handle.new_cpu_locked_tensor(data.numel(), data)
    assert handle.sync_pread(back, path, ALIGNMENT) == 1
    assert torch.equal(back, data)
    assert torch.equal(torch.from_file(str(path), size=data.numel() + ALIGNMENT // 4, dtype=torch.float32)[1024:],
                       data)  # what is on disk, read the plain way


def test_the_op_and_the_reference_write_the_same_bytes(tmp_path):
    data = torch.randn(50_000, generator=torch.Generator().manual_seed(1))
    for impl in IMPLS:
        _handle(impl).sync_pwrite(data, tmp_path / f"{impl}.bin", file_offset=100)
    assert (tmp_path / "cpp.bin").read_bytes() == (tmp_path / "python.bin").read_bytes()


def test_errors_name_the_file(tmp_path, impl):
    handle = _handle(impl)
    missing = tmp_path / "nowhere" / "x.bin"
    with pytest.raises(RuntimeError, match=rf"aio: cannot open {missing} for reading: No such file"):
        handle.async_pread(torch.empty(4), missing)
    with pytest.raises(RuntimeError, match=rf"aio: cannot open {missing} for writing"):
        handle.async_pwrite(torch.empty(4), missing)
    short = tmp_path / "short.bin"
    short.write_bytes(b"\0" * 10)
    with pytest.raises(RuntimeError, match=rf"aio: {short} has 10 bytes; reading 16 at offset 2 needs 18"):
        handle.async_pread(torch.empty(4), short, 2)
    with pytest.raises(RuntimeError, match="must be contiguous"):
        handle.async_pwrite(torch.empty(4, 4).t(), short)
    assert handle.wait() == 0  # nothing was queued by the refused calls


def test_deepspeed_api_through_the_alias(tmp_path, monkeypatch):
    from zeroengine.integrations.ds_compat.ops.op_builder import AsyncIOBuilder

    op = AsyncIOBuilder().load()
    handle = op.aio_handle(1 << 20, 8, False, True, 2)  # DeepSpeed's positional order
    assert (handle.get_block_size(), handle.get_queue_depth(), handle.get_single_submit(),
            handle.get_overlap_events(), handle.get_intra_op_parallelism()) == (1 << 20, 8, False, True, 2)
    data = torch.arange(1000, dtype=torch.float32)
    assert handle.pwrite(data, str(tmp_path / "d.bin"), False, False) == 1  # (buffer, filename, validate, async)
    back = torch.empty_like(data)
    assert handle.pread(back, str(tmp_path / "d.bin"), False, True) == 0 and handle.wait() == 1
    assert torch.equal(back, data)
    assert handle.read(back, str(tmp_path / "d.bin"), False) == 1 and handle.free_cpu_locked_tensor(back)
