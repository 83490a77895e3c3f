"""comm.scratch: the staging buffers of gloo's all-to-all based reduce-scatter / all-gather are reused, not
re-allocated per call, and the pool stays bounded."""
import torch

from zeroengine.comm.scratch import _KEEP_PER_SIZE, ScratchPool


def test_a_buffer_given_back_is_the_one_taken_next_for_the_same_size_and_dtype():
    pool = ScratchPool()
    first = pool.take(1024, torch.float32, torch.device("cpu"))
    pool.give_back(first)
    assert pool.take(1024, torch.float32, torch.device("cpu")).data_ptr() == first.data_ptr()
    pool.give_back(first)
    other = pool.take(1024, torch.bfloat16, torch.device("cpu"))  # another dtype: a buffer of its own
    assert other.data_ptr() != first.data_ptr() and other.dtype == torch.bfloat16


def test_idle_buffers_are_bounded_per_size():
    pool = ScratchPool()
    taken = [pool.take(256, torch.float32, torch.device("cpu")) for _ in range(_KEEP_PER_SIZE + 3)]
    for t in taken:
        pool.give_back(t)
    assert pool.held_bytes() == _KEEP_PER_SIZE * 256 * 4
    pool.clear()
    assert pool.held_bytes() == 0
