"""Stage 3's fetch policy: record the order modules ask for their parameters, then gather ahead of it.

Note: the recorded trace.
A *pass* is one forward with autograd on plus the backward that follows it
(or, without a backward, until the next forward). On the first pass every
fetch event (module name, phase, the units it needs) is recorded. On later
passes each event is checked against the trace at the cursor:

* it matches: the units of the events ahead are gathered asynchronously, up
  to ``stage3_prefetch_bucket_size`` elements ahead and never more than
  ``stage3_max_live_parameters`` elements gathered at once; after a module's
  forward, a unit whose next use is at most ``stage3_max_reuse_distance``
  elements of fetches away is kept gathered instead of released;
* it does not (a module skipped, another path taken, a different call
  count): the rest of the pass runs on demand (every module gathers what it
  needs when it runs, as on the first pass), prefetched units nobody asked
  for are released, and the next pass records the trace again.

Every decision depends only on the trace and the events so far, so ranks
that run the same modules issue the same collectives in the same order.
Passes under ``torch.no_grad`` (evaluation) neither record nor replay.

Several forwards of the model before one backward (DPO's chosen and rejected
batches, contrastive pairs) make one pass: the model's forward marks its
start in the trace (:data:`FORWARD_MARK`), so the pass records and replays as
a whole. Without a backward the pass ends after :data:`MAX_FORWARDS_PER_PASS`
forwards (a loop of forwards with grad on and no backward, e.g. evaluation
without ``no_grad``, keeps a bounded trace).
"""
from __future__ import annotations

import enum
from bisect import bisect_left
from dataclasses import dataclass


@dataclass(frozen=True)
class FetchEvent:
    module: str
    phase: str  # "forward" | "backward"
    units: tuple[int, ...]


# The model's second, third, ... forward within one pass (an event with no units: nothing to fetch).
FORWARD_MARK = FetchEvent("<model forward>", "forward", ())
MAX_FORWARDS_PER_PASS = 8


class TraceState(enum.Enum):
    RECORDING = "recording"
    REPLAYING = "replaying"
    DIVERGED = "diverged"  # this pass left the trace: on demand until the pass ends, then record again
    OFF = "off"  # a no-grad pass: on demand


class ExecutionTrace:
    def __init__(self, unit_numel: list[int]):
        self.unit_numel = unit_numel
        self.events: list[FetchEvent] = []
        self.state = TraceState.RECORDING
        self.cursor = 0
        self.in_pass = False
        self.recordings = 0  # how many traces were recorded (1 when the order never changed)
        self.divergences = 0
        self._recording: list[FetchEvent] = []
        self._uses: dict[int, list[int]] = {}
        self._numel_before: list[int] = []

    # -- pass boundaries ---------------------------------------------------------
    def begin_pass(self, grad_enabled: bool) -> None:
        if self.in_pass:
            self.end_pass()
        self.in_pass = True
        self.cursor = 0
        self.forwards = 1
        if not grad_enabled:
            self.state = TraceState.OFF
        elif self.events and self.state in (TraceState.REPLAYING, TraceState.OFF):
            self.state = TraceState.REPLAYING
        else:
            self.state = TraceState.RECORDING
            self._recording = []

    def continue_pass(self) -> bool:
        """Another forward of the model with grad on, before this pass's backward: True when it joins the
        pass (its start goes into the trace as :data:`FORWARD_MARK`), False when a new pass must begin."""
        if not self.in_pass or self.state is TraceState.OFF or self.forwards >= MAX_FORWARDS_PER_PASS:
            return False
        self.forwards += 1
        self.observe(FORWARD_MARK)
        return True

    def end_pass(self) -> None:
        if not self.in_pass:
            return
        self.in_pass = False
        if self.state is TraceState.RECORDING and self._recording:
            self._freeze(self._recording)
            self.state = TraceState.REPLAYING
        elif self.state is TraceState.REPLAYING and self.cursor != len(self.events):
            self._diverge()  # the pass ended early: events left over
        if self.state is TraceState.DIVERGED:
            self.events = []
            self.state = TraceState.RECORDING

    def forget(self) -> None:
        """Drop the recorded order: the next pass records it again."""
        self.in_pass = False
        self.events = []
        self.state = TraceState.RECORDING

    # -- events --------------------------------------------------------------------
    def observe(self, event: FetchEvent) -> bool:
        """Advance past ``event``; True when it is on the trace (prefetch may look ahead)."""
        if self.state is TraceState.RECORDING:
            if self.in_pass:
                self._recording.append(event)
            return False
        if self.state is not TraceState.REPLAYING:
            return False
        if self.cursor < len(self.events) and self.events[self.cursor] == event:
            self.cursor += 1
            return True
        self._diverge()
        return False

    def _diverge(self) -> None:
        self.state = TraceState.DIVERGED
        self.divergences += 1

    @property
    def replaying(self) -> bool:
        return self.state is TraceState.REPLAYING

    def expected(self) -> FetchEvent | None:
        """The event the trace has next, while replaying (None at its end, or when not replaying)."""
        if self.state is TraceState.REPLAYING and self.cursor < len(self.events):
            return self.events[self.cursor]
        return None

    def next_use(self, unit: int) -> int | None:
        """The index of the next event (from the cursor on) that needs ``unit``, while replaying (None: not
        used again in this pass, or not replaying)."""
        if not self.replaying:
            return None
        uses = self._uses.get(unit, ())
        i = bisect_left(uses, self.cursor)
        return uses[i] if i < len(uses) else None

    def reuse_distance(self, unit: int) -> int | None:
        """Elements fetched from now until ``unit``'s next use in this pass (None: not used again)."""
        use = self.next_use(unit)
        if use is None:
            return None
        return self._numel_before[use] - self._numel_before[self.cursor]

    def _freeze(self, events: list[FetchEvent]) -> None:
        self.events = list(events)
        self.recordings += 1
        # uses[u]: the events that need unit u, in order; numel_before[i]: elements the events before i
        # fetch (a reuse distance is a difference of two of these).
        self._uses = {}
        for i, e in enumerate(events):
            for u in e.units:
                self._uses.setdefault(u, []).append(i)
        self._numel_before = [0]
        for e in events:
            self._numel_before.append(self._numel_before[-1] + sum(self.unit_numel[u] for u in e.units))
