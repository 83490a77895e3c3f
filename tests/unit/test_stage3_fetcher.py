"""Stage 3's fetch policy without processes: the Fetcher fed fetch events, over fake buffers that record what
they are asked to gather, prefetch and release (zeroengine/zero/fetcher.py)."""
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from zeroengine.zero.fetcher import Fetcher, FetchPolicy, Unit
from zeroengine.zero.prefetch import FetchEvent

NUMEL = 10  # every fake unit's size, in elements


@dataclass(frozen=True)
class FakeBucket:
    index: int
    padded_numel: int = NUMEL


class FakeBuffer:
    """A partitioned buffer's fetch interface: records each call, counts live elements."""

    order_check = None
    order_tag = 0

    def __init__(self):
        self.persistent = frozenset()
        self.stats = SimpleNamespace(live_numel=0)
        self.state: dict[int, str] = {}  # bucket -> "in flight" | "gathered"
        self.calls: list[tuple[str, int]] = []

    def is_fetched(self, bucket):
        return bucket.index in self.state

    def fetch_async(self, bucket, label=""):
        if bucket.index not in self.state:
            self.state[bucket.index] = "in flight"
            self.stats.live_numel += bucket.padded_numel
            self.calls.append(("prefetch", bucket.index))

    def gather(self, bucket, label=""):
        if bucket.index not in self.state:
            self.stats.live_numel += bucket.padded_numel
            self.calls.append(("gather", bucket.index))
        self.state[bucket.index] = "gathered"

    def release(self, bucket):
        if bucket.index in self.state:
            del self.state[bucket.index]
            self.stats.live_numel -= bucket.padded_numel
            self.calls.append(("release", bucket.index))


def fetcher(n_units: int, **policy) -> tuple[Fetcher, FakeBuffer]:
    buffer = FakeBuffer()
    return Fetcher([Unit(buffer, FakeBucket(i), True) for i in range(n_units)], FetchPolicy(**policy)), buffer


def forward(f: Fetcher, u: int, module: str | None = None) -> None:
    """A module call using unit ``u``: its fetch event, the call, its end."""
    f.need(FetchEvent(module or f"m{u}", "forward", (u,)))
    f.acquire((u,))
    f.release_use((u,))


def backward(f: Fetcher, u: int) -> None:
    f.need(FetchEvent(f"m{u}", "backward", (u,)))
    f.bucket_grads_ready(u)


def one_pass(f: Fetcher, order=(0, 1, 2, 3)) -> None:
    f.begin_pass(grad_enabled=True)
    for u in order:
        forward(f, u)
    for u in reversed(order):
        backward(f, u)
    f.end_pass()


def test_a_recording_pass_gathers_each_unit_on_demand_and_releases_it_after_use():
    f, buf = fetcher(3)
    f.begin_pass(grad_enabled=True)
    for u in range(3):
        forward(f, u)
    assert buf.calls == [("gather", 0), ("release", 0), ("gather", 1), ("release", 1), ("gather", 2),
                         ("release", 2)]
    assert buf.stats.live_numel == 0


def test_a_replayed_pass_prefetches_what_comes_next_within_the_prefetch_budget():
    f, buf = fetcher(4, prefetch_numel=2 * NUMEL)
    one_pass(f)  # records the order
    buf.calls.clear()
    f.begin_pass(grad_enabled=True)
    f.need(FetchEvent("m0", "forward", (0,)))
    # unit 0 now, units 1 and 2 ahead (2 units' worth of prefetch budget), not 3
    assert buf.calls == [("gather", 0), ("prefetch", 1), ("prefetch", 2)]
    assert f.prefetched == {1, 2}


def test_max_live_parameters_bounds_the_prefetch():
    f, buf = fetcher(4, prefetch_numel=10 * NUMEL, max_live_numel=2 * NUMEL)
    one_pass(f)
    buf.calls.clear()
    f.begin_pass(grad_enabled=True)
    f.need(FetchEvent("m0", "forward", (0,)))
    assert buf.calls == [("gather", 0), ("prefetch", 1)] and buf.stats.live_numel == 2 * NUMEL


def test_a_unit_used_again_within_the_reuse_distance_is_kept_and_others_released():
    f, buf = fetcher(2, prefetch_numel=0, max_reuse_distance=15)
    one_pass(f, order=(0, 1))  # replayed below: forward 0, forward 1, backward 1, backward 0
    buf.calls.clear()
    f.begin_pass(grad_enabled=True)
    forward(f, 0)  # next use of unit 0: backward 0, 20 elements of fetches away (> 15): released
    forward(f, 1)  # next use of unit 1: the very next event: kept
    assert buf.calls == [("gather", 0), ("release", 0), ("gather", 1)] and f.kept == {1}
    backward(f, 1)  # found gathered: no new gather; its gradients are then ready and it has no further use
    assert buf.calls[-1] == ("release", 1) and f.kept == set()


def test_leaving_the_recorded_order_releases_what_was_fetched_ahead_for_it():
    f, buf = fetcher(4, prefetch_numel=10 * NUMEL)
    one_pass(f)
    f.begin_pass(grad_enabled=True)
    forward(f, 0)  # prefetches 1, 2, 3; keeps 0 for its backward
    buf.calls.clear()
    f.need(FetchEvent("m3", "forward", (3,)))  # the trace has m1 here
    assert sorted(buf.calls) == [("release", 0), ("release", 1), ("release", 2)]  # unit 3 is needed: kept
    assert f.trace.divergences == 1 and not f.trace.replaying and f.prefetched == set()


def test_the_end_of_a_pass_releases_everything_and_a_new_order_is_recorded_after_a_departure():
    f, buf = fetcher(4, prefetch_numel=10 * NUMEL)
    one_pass(f)
    f.begin_pass(grad_enabled=True)
    forward(f, 0)
    f.end_pass()  # the pass ended early: left over events count as a departure
    assert buf.state == {} and buf.stats.live_numel == 0
    assert f.trace.state.value == "recording"


def test_a_hold_keeps_its_units_and_releases_only_those_it_gathered():
    f, buf = fetcher(3)
    f.begin_pass(grad_enabled=True)
    f.need(FetchEvent("m0", "forward", (0,)))
    f.acquire((0,))  # unit 0 is in use by a running call
    with f.holding((0, 1)):
        assert buf.state.keys() == {0, 1} and set(f.running_units()) == {0, 1}
    assert buf.state.keys() == {0}  # unit 1 was gathered by the hold: released; unit 0 belongs to the call
    assert f.running_units() == (0,)


def test_regrouping_is_refused_while_a_pass_is_running():
    f, _ = fetcher(2)
    f.begin_pass(grad_enabled=True)
    with pytest.raises(RuntimeError, match="between training steps"):
        f.forget_order()


class CountingBuffer(FakeBuffer):
    def __init__(self):
        super().__init__()
        self.looks = 0

    def is_fetched(self, bucket):
        self.looks += 1
        return super().is_fetched(bucket)


def test_prefetching_looks_at_each_event_of_a_pass_a_bounded_number_of_times():
    """A budget larger than the model: every event ahead is gathered at the first one, and later events must
    not rescan the gathered window (it was quadratic: 48 units, ~1,200 looks per pass instead of ~200)."""
    n = 48
    buffer = CountingBuffer()
    f = Fetcher([Unit(buffer, FakeBucket(i), True) for i in range(n)], FetchPolicy(prefetch_numel=10**9))
    one_pass(f, order=tuple(range(n)))
    buffer.looks = 0
    buffer.calls.clear()
    one_pass(f, order=tuple(range(n)))
    assert [c for c in buffer.calls if c[0] == "gather"] == [("gather", 0)]  # the rest came prefetched
    assert buffer.looks <= 6 * n


def test_a_unit_released_before_its_next_use_is_prefetched_again_for_it():
    """Unit 0 is released after its forward (its backward is further than max_reuse_distance); prefetching,
    which had looked past that backward already, looks again from there and gathers it ahead of use."""
    f, buf = fetcher(3, prefetch_numel=10**6, max_reuse_distance=15)
    one_pass(f, order=(0, 1, 2))  # replayed: f0 f1 f2 b2 b1 b0
    buf.calls.clear()
    f.begin_pass(grad_enabled=True)
    forward(f, 0)  # gathers 0, prefetches 1 and 2, releases 0 (next use: 40 elements away)
    assert buf.calls == [("gather", 0), ("prefetch", 1), ("prefetch", 2), ("release", 0)]
    forward(f, 1)  # the next event's prefetch brings unit 0 back ahead of its backward
    assert ("prefetch", 0) in buf.calls[4:]
    for u in (2,):
        forward(f, u)
    for u in (2, 1, 0):
        backward(f, u)
    f.end_pass()
    assert [c for c in buf.calls if c[0] == "gather"] == [("gather", 0)]
