"""zeroengine.buffer_pool: the bounded best-fit pool behind gloo's collective temporaries (comm.scratch) and the
gradient stores' bucket buffers. Given-back buffers serve later requests of any dtype as views, the smallest
that fits; what stays idle is bounded in count, keeping the largest."""
import threading

import torch

from zeroengine.buffer_pool import BufferPool
from zeroengine.comm.scratch import SCRATCH_KEEP, scratch

CPU = torch.device("cpu")


def test_a_given_back_buffer_serves_the_next_request_that_fits():
    pool = BufferPool(keep=4)
    first = pool.take(1024, torch.float32, CPU)
    pool.give(first)
    again = pool.take(1024, torch.float32, CPU)
    assert again.data_ptr() == first.data_ptr() and again.shape == (1024,)
    pool.give(again)
    smaller = pool.take(100, torch.bfloat16, CPU)  # another dtype and size: a view of the same buffer
    assert smaller.data_ptr() == first.data_ptr() and smaller.dtype == torch.bfloat16 and smaller.numel() == 100
    assert pool.tensors() == []  # it is in use: nothing idle
    larger = pool.take(2048, torch.float32, CPU)  # nothing idle fits: a new buffer
    assert larger.data_ptr() != first.data_ptr()


def test_the_smallest_idle_buffer_that_fits_is_taken():
    pool = BufferPool(keep=4)
    small, large = pool.take(100, torch.float32, CPU), pool.take(1000, torch.float32, CPU)
    pool.give(large)
    pool.give(small)
    assert pool.take(50, torch.float32, CPU).data_ptr() == small.data_ptr()
    assert pool.take(50, torch.float32, CPU).data_ptr() == large.data_ptr()


def test_zeroed_requests_are_zero_even_from_a_used_buffer():
    pool = BufferPool(keep=1)
    used = pool.take(64, torch.float32, CPU)
    used.fill_(7.0)
    pool.give(used)
    assert torch.count_nonzero(pool.take(32, torch.float16, CPU, zeroed=True)) == 0


def test_idle_buffers_are_bounded_and_the_largest_stay():
    pool = BufferPool(keep=3)
    taken = [pool.take(n, torch.float32, CPU) for n in (10, 500, 20, 400, 30, 300)]
    for t in taken:
        pool.give(t)
    assert sorted(t.nbytes for t in pool.tensors()) == [300 * 4, 400 * 4, 500 * 4]
    assert pool.held_bytes() == (300 + 400 + 500) * 4
    pool.clear()
    assert pool.held_bytes() == 0


def test_buffers_are_given_back_from_other_threads():
    pool = BufferPool(keep=SCRATCH_KEEP)
    taken = [pool.take(256, torch.float32, CPU) for _ in range(SCRATCH_KEEP + 4)]
    threads = [threading.Thread(target=pool.give, args=(t,)) for t in taken]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(pool.tensors()) == SCRATCH_KEEP
    assert scratch.keep == SCRATCH_KEEP
