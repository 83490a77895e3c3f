"""Stage 3's fetch policy: which units to gather, prefetch, keep and release, decided from fetch events alone.

:class:`Stage3Hooks` turns module calls into *fetch events* (a module about to run its forward or its
backward, and the units it needs) and uses of units (a module's forward holds its units until it returns);
the :class:`Fetcher` decides what that means for memory and communication, along the recorded order
(:mod:`zeroengine.zero.prefetch`):

* an event's units are gathered before it returns (waiting for their prefetch, or on demand after freeing
  kept and prefetched units that are not needed now, to stay under ``stage3_max_live_parameters``);
* on the recorded order, the units of the events ahead are gathered asynchronously, up to
  ``stage3_prefetch_bucket_size`` elements ahead;
* a unit no call uses any more is kept gathered when its next use is at most ``stage3_max_reuse_distance``
  elements of fetches away, else released;
* a pass's end releases everything, and compares the pass across ranks (:mod:`.gather_order`).

It never sees a module, a hook or a process group: a unit is a (buffer, bucket) whose buffer gathers,
prefetches and releases it, so it is tested with fake buffers (tests/unit/test_stage3_fetcher.py).
"""
from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass

from zeroengine.progress import get_logger

from .gather_order import Stage3DivergenceError
from .layout import Bucket
from .prefetch import ExecutionTrace, FetchEvent

_log = get_logger()


@dataclass(frozen=True)
class Unit:
    """What one fetch gathers: a bucket of a partitioned buffer (trainable parameters in the optimizer's
    buffer, frozen ones in a buffer of their own)."""

    buffer: object  # a PartitionedParamBuffer, or anything with its gather/fetch_async/release/is_fetched
    bucket: Bucket
    trainable: bool

    @property
    def numel(self) -> int:
        return self.bucket.padded_numel

    @property
    def persistent(self) -> bool:
        return self.bucket.index in self.buffer.persistent


@dataclass(frozen=True)
class FetchPolicy:
    """The stage-3 tuning keys, in elements (DeepSpeed's units)."""

    prefetch_numel: int = 50_000_000
    max_live_numel: int = 1_000_000_000
    max_reuse_distance: int = 1_000_000_000

    @classmethod
    def from_config(cls, zero_config) -> "FetchPolicy":
        return cls(int(zero_config.stage3_prefetch_bucket_size), int(zero_config.stage3_max_live_parameters),
                   int(zero_config.stage3_max_reuse_distance))


class UnitSet(set):
    """A set of unit indices that keeps the elements its units hold (``numel``), so the prefetch budget is
    read in O(1) rather than summed over everything fetched ahead at every event."""

    def __init__(self, unit_numel: list[int]):
        super().__init__()
        self.unit_numel = unit_numel
        self.numel = 0

    def add(self, u: int) -> None:
        if u not in self:
            super().add(u)
            self.numel += self.unit_numel[u]

    def discard(self, u: int) -> None:
        if u in self:
            super().discard(u)
            self.numel -= self.unit_numel[u]

    def clear(self) -> None:
        super().clear()
        self.numel = 0


class Fetcher:
    def __init__(self, units: list[Unit], policy: FetchPolicy = FetchPolicy()):
        self.units = units
        self.policy = policy
        self.trace = ExecutionTrace([u.numel for u in units])
        self.in_use: dict[int, int] = defaultdict(int)  # unit -> module calls running with it
        self.prefetched = UnitSet([u.numel for u in units])  # fetched ahead, not yet asked for
        self.kept: set[int] = set()  # kept gathered after use (reuse distance)
        # Trace events before this index (and from the cursor on) have every unit gathered or on its way, so
        # prefetching resumes here instead of rescanning the window at every event (a release before a unit's
        # next use moves it back: _release).
        self.scanned = 0
        self.order_check = units[0].buffer.order_check if units else None  # one check shared by the buffers

    # -- passes ----------------------------------------------------------------------------
    def begin_pass(self, grad_enabled: bool) -> None:
        """The model's forward starts a pass."""
        self.trace.begin_pass(grad_enabled)
        self.scanned = 0
        if self.order_check is not None:
            self.order_check.begin_pass(self.trace.replaying)

    def continue_pass(self) -> bool:
        """Another forward of the model with grad on, before this pass's backward: True when it joins the pass
        (DPO's two forwards), False when a new pass must begin."""
        was_replaying = self.trace.replaying
        if not self.trace.continue_pass():
            return False
        if was_replaying and not self.trace.replaying:
            self.release_idle(tuple(self.prefetched | self.kept))  # fetched for the old order
        return True

    def forget_uses(self) -> None:
        """Module calls counted as running are not (a forward raised before their post-hooks)."""
        self.in_use.clear()

    def end_pass(self, completed: bool = True) -> None:
        """End of backward (or a forward nobody backpropagated): anything still gathered is freed. A pass
        ``completed`` on this rank is compared with the other ranks' (see :mod:`.gather_order`); one that
        raised here is not (the others may never arrive)."""
        self.trace.end_pass()
        self.release_idle(range(len(self.units)))
        self.prefetched.clear()
        self.kept.clear()
        if self.order_check is not None:
            try:
                self.order_check.end_pass(completed)
            except Stage3DivergenceError:
                self.trace.forget()  # every rank records the order afresh (they raise alike)
                raise

    def forget_order(self) -> None:
        """The fetch events change (stage 3 regrouped its hooks): record the order again. Between passes."""
        if self.trace.in_pass or any(self.in_use.values()):
            raise RuntimeError("stage 3 can regroup its fetches only between training steps")
        self.trace.forget()

    # -- events and uses -------------------------------------------------------------------
    def need(self, event: FetchEvent) -> None:
        """``event``'s units are gathered when this returns; on the recorded order, what follows is prefetched.
        Every rank is at the same event, or all raise (:mod:`.gather_order`)."""
        if self.order_check is None:
            self._fetch(event)
            return
        first = self.units[event.units[0]]
        with self.order_check.event(event.module, event.phase, (first.buffer.order_tag, first.bucket.index),
                                    event.units):
            self._fetch(event)

    def acquire(self, units: tuple[int, ...]) -> None:
        """A module call starts using ``units`` (after :meth:`need`)."""
        for u in units:
            self.in_use[u] += 1

    def release_use(self, units: tuple[int, ...]) -> None:
        """A module call is done with ``units``: one nobody uses any more is kept (reused soon) or released."""
        for u in units:
            self.in_use[u] -= 1
            if self.in_use[u] == 0:
                self._release_or_keep(u)

    def bucket_grads_ready(self, u: int) -> None:
        """Every gradient of trainable unit ``u`` exists: no backward computation needs it after that."""
        if self.in_use[u] == 0:
            # Usually the unit's last use in the pass; not when the recorded pass backpropagates through its
            # module again (two forwards before one backward), and then it is kept as after a forward.
            self._release_or_keep(u)

    def release_idle(self, units, keep: tuple[int, ...] = ()) -> None:
        """Release those of ``units`` no call uses (and not in ``keep``)."""
        for u in units:
            if u not in keep and self.in_use[u] == 0:
                self._release(u)

    # -- activation checkpointing ----------------------------------------------------------
    def running_units(self) -> tuple[int, ...]:
        """Units of the calls running now (a checkpointed segment's enclosing modules)."""
        return tuple(u for u, n in self.in_use.items() if n > 0)

    @contextlib.contextmanager
    def holding(self, units: tuple[int, ...]):
        """Keep ``units`` gathered for the block (a segment's recompute and its inner backward). Only units
        the hold had to gather are released after it: one already gathered belongs to whoever gathered it
        (a backward still needs it for a gradient the segment does not produce, e.g. a position embedding
        its module added before the segment)."""
        gathered_here = []
        for u in units:
            if self._gather_now(u, units, "activation checkpoint recompute"):
                gathered_here.append(u)
            self.in_use[u] += 1
        try:
            yield
        finally:
            for u in units:
                self.in_use[u] -= 1
            for u in gathered_here:
                if self.in_use[u] == 0:
                    self._release_or_keep(u)

    # -- decisions -------------------------------------------------------------------------
    def _fetch(self, event: FetchEvent) -> None:
        was_replaying = self.trace.replaying
        expected = self.trace.expected()
        on_trace = self.trace.observe(event)
        if was_replaying and not on_trace:
            # Left the trace: what was fetched ahead for the old order is not needed.
            self.release_idle(tuple(self.prefetched | self.kept), keep=event.units)
            self._report_departure(event, expected)
        label = f"module {event.module} ({event.phase})"
        for u in event.units:
            self._gather_now(u, event.units, label)
            self.prefetched.discard(u)
            self.kept.discard(u)
        if on_trace:
            self._prefetch()

    def _report_departure(self, event: FetchEvent, expected: FetchEvent | None) -> None:
        """Say where this rank left the recorded order, before its next gather: when the other ranks did not
        leave it too, that gather pairs with a different one of theirs. The end of the pass names a wrong
        pairing; one of different sizes aborts the process first (gloo) or hangs (NCCL), and then this line
        is what names the module."""
        if self.order_check is None or self.order_check.per_event:
            return  # no peers, or the check compares this event before anything is gathered
        wanted = f"module {expected.module} ({expected.phase})" if expected else "the end of the pass"
        _log.warning(f"rank {self.order_check.rank}: stage 3 left its recorded parameter-fetch order at module "
                     f"{event.module} ({event.phase}), where the trace has {wanted}; this pass gathers on demand "
                     "from here (a change every rank makes is fine; a rank that alone runs other modules "
                     "desynchronises the gathers: ZEROENGINE_STAGE3_ORDER_CHECK=event names it before they pair)")

    def _gather_now(self, u: int, keep: tuple[int, ...], label: str) -> bool:
        """Make unit ``u`` gathered (waiting for its prefetch, or gathering it on demand after making room
        under max_live, sparing ``keep``); True when it was not fetched before."""
        unit = self.units[u]
        fetched = unit.buffer.is_fetched(unit.bucket)
        if not fetched:
            self._make_room(unit.numel, keep=keep)
        unit.buffer.gather(unit.bucket, label)
        return not fetched

    def _prefetch(self) -> None:
        ahead = self.prefetched.numel
        events = self.trace.events
        i = max(self.trace.cursor, self.scanned)
        while i < len(events):
            event = events[i]
            for u in event.units:
                unit = self.units[u]
                if unit.buffer.is_fetched(unit.bucket):
                    continue
                if ahead + unit.numel > self.policy.prefetch_numel or \
                        self._live() + unit.numel > self.policy.max_live_numel:
                    self.scanned = i
                    return
                unit.buffer.fetch_async(unit.bucket, f"module {event.module} ({event.phase})")
                self.prefetched.add(u)
                ahead += unit.numel
            i += 1
        self.scanned = i

    def _live(self) -> int:
        return self.units[0].buffer.stats.live_numel  # one FetchStats shared by the buffers

    def _make_room(self, numel: int, keep: tuple[int, ...]) -> None:
        """Free kept, then prefetched, units (not needed now) until ``numel`` more fits under max_live."""
        for pool in (self.kept, self.prefetched):
            for u in sorted(pool):
                if self._live() + numel <= self.policy.max_live_numel:
                    return
                if u not in keep and self.in_use[u] == 0:
                    self._release(u)

    def _release_or_keep(self, u: int) -> None:
        distance = self.trace.reuse_distance(u)
        if distance is not None and distance <= self.policy.max_reuse_distance and \
                self._live() <= self.policy.max_live_numel:
            self.kept.add(u)
            return
        self._release(u)

    def _release(self, u: int) -> None:
        unit = self.units[u]
        unit.buffer.release(unit.bucket)
        self.prefetched.discard(u)
        self.kept.discard(u)
        use = self.trace.next_use(u)
        if use is not None and use < self.scanned:
            self.scanned = use  # needed again within what prefetching looked at: look again from there
