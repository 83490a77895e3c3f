"""Pure shard maths of zero/layout.py."""
import itertools

import pytest

from zeroengine.zero.layout import build_layout


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("bucket", [1, 10, 1000])
def test_every_element_is_owned_by_exactly_one_rank(world, bucket):
    numels = [7, 1, 33, 16, 5, 100]
    layout = build_layout(numels, world, bucket, align=4)
    owned = {}
    for b in layout.buckets:
        assert b.padded_numel % (world * 4) == 0 and b.padded_numel >= b.numel
        for rank in range(world):
            for slot, lo, hi, chunk_start in b.pieces_in_chunk(rank):
                assert b.chunk_range(rank)[0] + chunk_start == slot.flat_start + lo
                for e in range(lo, hi):
                    assert (slot.index, e) not in owned
                    owned[(slot.index, e)] = rank
    assert len(owned) == sum(numels)
    assert layout.total_numel == sum(b.padded_numel for b in layout.buckets)
    assert layout.shard_numel * world == layout.total_numel


def test_buckets_respect_the_size_limit_and_keep_order():
    layout = build_layout([4, 4, 4, 20, 4], world=2, bucket_numel=8, align=1)
    assert [[s.index for s in b.slots] for b in layout.buckets] == [[0, 1], [2], [3], [4]]
    starts = [b.flat_start for b in layout.buckets]
    assert starts == sorted(starts)
    flat = list(itertools.chain.from_iterable(b.slots for b in layout.buckets))
    assert all(a.flat_end <= b.flat_start for a, b in zip(flat, flat[1:]))


def test_padding_is_bounded_per_bucket():
    world, align = 4, 16
    layout = build_layout([1000, 3, 77777], world, 50_000, align)
    for b in layout.buckets:
        assert b.padded_numel - b.numel < world * align
    assert layout.param_numel == 1000 + 3 + 77777


def test_bad_arguments():
    with pytest.raises(ValueError):
        build_layout([1], 0, 10)
    with pytest.raises(ValueError):
        build_layout([1], 2, 0)


def test_segments_never_share_a_bucket():
    layout = build_layout([4, 4, 4, 4], world=2, bucket_numel=100, align=1, segments=[7, 7, 9, 9])
    assert [[s.index for s in b.slots] for b in layout.buckets] == [[0, 1], [2, 3]]
    with pytest.raises(ValueError):
        build_layout([4], 2, 10, segments=[1, 2])
