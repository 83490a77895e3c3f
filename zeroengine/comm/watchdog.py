"""Named hangs: which rank did not arrive at a collective, what it is doing instead, and where every rank is.

A collective that some rank never joins waits out the comm timeout, then fails on the ranks that did join
with the backend's words ("timed out"), which name nobody. So every rank keeps a heartbeat in the process
group's key-value store: how many collectives it has issued in each group, the last one, and whether it is
blocked in one, running its own code, finished its script or failed. The hot path only updates a few
attributes; a background thread posts the heartbeat when it changed (every ``ZEROENGINE_HEARTBEAT_S``,
2 s) and answers requests for stack dumps.

When a collective fails on a timeout (or, where the backend never times out, when one has waited past the
comm timeout + a grace period), the waiting rank asks every rank to print its Python stack
(:mod:`faulthandler`, all threads), reads its peers' heartbeats and names, in a *hang report*, each rank of
the group that did not arrive: stuck in its own code (its stack shows where), waiting in another collective
(which), issued a different collective as the same one (which), left early (its script ended), or failed.
The report becomes the collective's error, so the job ends non-zero and the launcher reports it.
``ZEROENGINE_WATCHDOG=0`` turns all of it off.

The store is a side channel: nothing here can itself wait on a collective.
"""
from __future__ import annotations

import faulthandler
import hashlib
import json
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass, field

RUNNING, WAITING, FINISHED, FAILED = "running", "waiting", "finished", "failed"
SILENT_BACKEND_GRACE_S = 10.0  # past the comm timeout, before a wait the backend never ends counts as hung
STOP_JOIN_S = 5.0  # how long stop() waits for the thread to leave a store call (a live store answers in ms)
EXIT_HANG = 1


def heartbeat_interval_s() -> float:
    from .handshake import seconds_from_env

    return seconds_from_env("ZEROENGINE_HEARTBEAT_S") or 2.0


def watchdog_requested() -> bool:
    return os.environ.get("ZEROENGINE_WATCHDOG", "1") not in ("0", "false", "False", "off")


@dataclass(slots=True)
class Ticket:
    """One collective as this rank issued it: the ``seq``-th (from 0) of its group."""
    group: str
    seq: int
    op: str
    dtype: str = ""
    numel: int = 0
    label: str = ""

    def describe(self) -> str:
        what = f"{self.op}({self.dtype}[{self.numel}])" if self.dtype else self.op
        label = f" for {self.label}" if self.label else ""
        return f"#{self.seq} {what}{label} in group {self.group}"

    def same_call(self, other: "Ticket") -> bool:
        """Whether ``other`` (a peer's ticket of the same number) matches: a send matches its receive."""
        if self.group.startswith("p2p:"):
            return (self.dtype, self.numel) == (other.dtype, other.numel)
        return (self.op, self.dtype, self.numel, self.label) == (other.op, other.dtype, other.numel, other.label)


@dataclass
class Heartbeat:
    rank: int
    state: str = RUNNING
    seqs: dict = field(default_factory=dict)  # group → collectives issued in it so far
    last: Ticket | None = None  # the last collective issued
    blocked_on: Ticket | None = None  # the collective this rank is blocked in (state WAITING)
    since: float = 0.0  # wall-clock time of the state's start
    note: str = ""  # FAILED: the error's first line
    posted: float = 0.0  # wall-clock time it was posted

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @staticmethod
    def decode(raw: bytes) -> "Heartbeat":
        d = json.loads(raw.decode())
        for key in ("last", "blocked_on"):
            d[key] = Ticket(**d[key]) if d[key] else None
        return Heartbeat(**d)

    def issued(self, ticket: Ticket) -> Ticket | None:
        """What this rank issued as ``ticket``'s number in its group, when its heartbeat says."""
        for mine in (self.blocked_on, self.last):
            if mine is not None and mine.group == ticket.group and mine.seq == ticket.seq:
                return mine
        return None


def _ago(t: float, now: float) -> str:
    return f"{max(0.0, now - t):.0f} s"


def describe_hang(me: int, ticket: Ticket, waited_s: float, beats: dict, now: float | None = None,
                  store_lost: bool = False, connection_lost: bool = False) -> str:
    """The hang report of rank ``me``, blocked ``waited_s`` in ``ticket``, from its group's heartbeats
    (``beats``: rank → Heartbeat, or None for a rank that never posted one). ``connection_lost``: the backend
    failed because a peer's connection closed (not a timeout), so a peer that did not arrive and said nothing
    of failing or finishing is gone, and its heartbeat is only its last word."""
    now = time.time() if now is None else now
    lines = []
    if store_lost:
        lines.append("  the store (hosted by rank 0) is gone: rank 0 has exited (left early, failed or was killed)")
    for rank in sorted(beats):
        if rank == me:
            continue
        beat = beats[rank]
        if beat is None:
            lines.append(f"  rank {rank}: never posted a heartbeat (it has not reached init_distributed, or runs "
                         "with ZEROENGINE_WATCHDOG=0)")
            continue
        done = beat.seqs.get(ticket.group, 0)
        last = f"its last collective: {beat.last.describe()}" if beat.last else "no collective issued yet"
        if done > ticket.seq:
            theirs = beat.issued(ticket)
            if theirs is not None and not theirs.same_call(ticket):
                lines.append(f"  rank {rank}: issued a different collective as #{ticket.seq}: {theirs.describe()}")
            continue  # it arrived
        if beat.state == FINISHED:
            lines.append(f"  rank {rank}: left early: its script ended {_ago(beat.since, now)} ago, after "
                         f"{done} collective(s) in this group ({last})")
        elif beat.state == FAILED:
            lines.append(f"  rank {rank}: failed {_ago(beat.since, now)} ago ({beat.note or 'see its own error'}); "
                         f"{last}")
        elif connection_lost:
            doing = (f"waiting in {beat.blocked_on.describe()}" if beat.state == WAITING and beat.blocked_on
                     else f"running its own code; {last}")
            lines.append(f"  rank {rank}: gone: its connection closed (it died, was killed, or exited without a "
                         f"word); its last heartbeat ({_ago(beat.posted, now)} ago) said: {doing}")
        elif beat.state == WAITING and beat.blocked_on is not None:
            lines.append(f"  rank {rank}: waiting for {_ago(beat.since, now)} in another collective: "
                         f"{beat.blocked_on.describe()}")
        else:
            lines.append(f"  rank {rank}: stuck in its own code (no collective) for {_ago(beat.since, now)}; "
                         f"{last}; its stack is printed above")
    kind = "failure" if connection_lost else "hang"
    head = f"zeroengine {kind} report from rank {me}: it waited {waited_s:.0f} s in collective {ticket.describe()}"
    if not lines:
        return head + "; every rank of the group reached it (the backend failed for another reason)"
    return head + "; the ranks that did not arrive:\n" + "\n".join(lines)


def group_key(ranks: list[int], world: int) -> str:
    """A name for a group that every member computes alike."""
    if len(ranks) == world:
        return "world"
    if len(ranks) <= 8:
        return "-".join(map(str, ranks))
    digest = hashlib.sha1(",".join(map(str, ranks)).encode()).hexdigest()[:8]
    return f"{ranks[0]}..{ranks[-1]}/{len(ranks)}:{digest}"


class Watchdog:
    """This rank's heartbeat and hang reports (one per process group's lifetime; see the module doc)."""

    def __init__(self, store, rank: int, timeout_s: float, generation: int, heartbeat_s: float | None = None,
                 silent_backend: bool = False, stack_file=None):
        self.store, self.rank, self.timeout_s = store, rank, timeout_s
        self.heartbeat_s = heartbeat_s or heartbeat_interval_s()
        self.silent_backend = silent_backend  # its waits never time out: the thread ends them
        self._stack_file = stack_file
        self._ns = f"ze_wd/{generation}"
        self._seqs: dict[str, int] = {}
        # id(group) → (group, its name): holding the group keeps its id from being reused
        self._groups: dict[int, tuple] = {}
        self._members: dict[str, list[int]] = {}  # a group's name → its global ranks
        self._last: Ticket | None = None
        self._blocked: tuple[Ticket, float] | None = None  # (collective, monotonic start)
        self._active_at = time.monotonic()  # the last collective issued or finished waiting
        self._terminal: tuple[str, str, float] | None = None  # (FINISHED or FAILED, note, wall-clock time)
        self._posted = None
        self._answered = False
        self._report: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"zeroengine-watchdog-{rank}", daemon=True)

    # -- the hot path: attribute updates only ----------------------------------------------------------------
    def group_name(self, group) -> str:
        """The name of process group ``group`` (None: the world), computed once per group."""
        known = self._groups.get(id(group))
        if known is not None:
            return known[1]
        import torch.distributed as dist

        world = dist.get_world_size()
        ranks = list(range(world)) if group is None or group is dist.group.WORLD else dist.get_process_group_ranks(group)
        name = group_key(ranks, world)
        self._groups[id(group)] = (group, name)
        self._members[name] = ranks
        return name

    def pair_name(self, src: int, dst: int) -> str:
        """The "group" of the messages ``src`` sends ``dst``: the k-th send matches the k-th receive."""
        name = f"p2p:{src}->{dst}"
        if name not in self._members:
            self._members[name] = [src, dst]
        return name

    def issue(self, group: str, op: str, dtype: str = "", numel: int = 0, label: str = "") -> Ticket:
        seq = self._seqs.get(group, 0)
        self._seqs[group] = seq + 1
        self._last = Ticket(group, seq, op, dtype, numel, label)
        self._active_at = time.monotonic()
        return self._last

    def block(self, ticket: Ticket) -> None:
        self._blocked = (ticket, time.monotonic())

    def unblock(self) -> None:
        self._blocked = None
        self._active_at = time.monotonic()

    # -- lifecycle --------------------------------------------------------------------------------------------
    def start(self) -> "Watchdog":
        self._post()
        self._thread.start()
        return self

    def stop(self, state: str | None = None, note: str = "") -> None:
        """End the heartbeat; ``state`` (FINISHED, FAILED) is posted first, so peers' reports can say it."""
        if state is not None and self._terminal is None:
            self._terminal = (state, note, time.time())
            self._post()
        self._stop.set()
        # Wait for the thread to leave any store call: a daemon thread still inside one (GIL released) when the
        # interpreter finalizes is unwound through C++ frames that cannot be, and the process aborts
        # ("terminate called without an active exception") after the script itself has ended well.
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(STOP_JOIN_S)

    # -- the thread -------------------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                self._post()
                self._answer_stack_request()
                if self.silent_backend:
                    self._end_silent_wait()
            except Exception:  # the store is gone (the world was torn down, or rank 0 exited): nothing to say
                return

    def heartbeat(self) -> Heartbeat:
        blocked, terminal = self._blocked, self._terminal
        if terminal is not None:
            state, note, since = terminal
        else:
            state, note = (WAITING if blocked else RUNNING), ""
            since = time.time() - (time.monotonic() - (blocked[1] if blocked else self._active_at))
        return Heartbeat(self.rank, state, dict(self._seqs), self._last, blocked[0] if blocked else None, since,
                         note)

    def _post(self) -> None:
        """Post the heartbeat when what it says has changed (the hot path never touches the store)."""
        beat = self.heartbeat()
        key = (beat.state, beat.last, beat.blocked_on)
        if key != self._posted:
            self._posted = key
            beat.posted = time.time()
            self.store.set(f"{self._ns}/hb/{self.rank}", beat.encode())

    def _answer_stack_request(self) -> None:
        if self._answered or not self.store.check([f"{self._ns}/stacks"]):
            return
        self._answered = True
        asker = self.store.get(f"{self._ns}/stacks").decode()
        self.print_stack(f"asked for by rank {asker}'s hang report")
        self.store.set(f"{self._ns}/stacks_done/{self.rank}", b"")

    def print_stack(self, why: str) -> None:
        out = self._stack_file or (sys.stderr if _has_fileno(sys.stderr) else sys.__stderr__)
        out.write(f"zeroengine: rank {self.rank}'s Python stack ({why}):\n")
        out.flush()
        faulthandler.dump_traceback(file=out, all_threads=True)
        out.flush()

    def _end_silent_wait(self) -> None:
        blocked = self._blocked
        if blocked is None or time.monotonic() - blocked[1] < self.timeout_s + SILENT_BACKEND_GRACE_S:
            return
        report = self.report(blocked[0], members=None)
        sys.__stderr__.write(report + "\n")
        sys.__stderr__.flush()
        os._exit(EXIT_HANG)

    # -- the report -------------------------------------------------------------------------------------------
    def report(self, ticket: Ticket, members: list[int] | None, timed_out: bool = True) -> str:
        """The hang report for ``ticket`` (blocked since :meth:`block`), among ``members`` (the group's global
        ranks; those it was issued to when None). Every rank is asked to print its stack first; after a timeout
        the ranks still alive are waited for (a few heartbeats) so their stacks precede the report. Not
        ``timed_out``: a peer's connection closed, so the peers that did not arrive are gone."""
        with self._lock:
            if self._report is not None:
                return self._report
            blocked = self._blocked
            waited = time.monotonic() - blocked[1] if blocked else self.timeout_s
            members = members if members is not None else self._members.get(ticket.group, [self.rank])
            store_lost = False
            beats: dict = {}
            try:
                self._post()
                self.store.set(f"{self._ns}/stacks", str(self.rank).encode())
                self._answered = True
                self.print_stack("its own hang report follows")
                beats = self._read(members)
                if timed_out:
                    self._wait_for_stacks(members, beats)
                    beats = self._read(members)
            except Exception:  # rank 0's store is gone
                store_lost = True
            self._report = describe_hang(self.rank, ticket, waited, beats, store_lost=store_lost,
                                         connection_lost=not timed_out)
            return self._report

    def _read(self, members: list[int]) -> dict:
        beats = {}
        for r in members:
            key = f"{self._ns}/hb/{r}"
            beats[r] = Heartbeat.decode(self.store.get(key)) if self.store.check([key]) else None
        return beats

    def _wait_for_stacks(self, members: list[int], beats: dict) -> None:
        alive = [r for r, b in beats.items() if r != self.rank and b is not None and b.state not in (FINISHED, FAILED)]
        keys = [f"{self._ns}/stacks_done/{r}" for r in alive]
        deadline = time.monotonic() + 2 * self.heartbeat_s + 2
        while keys and time.monotonic() < deadline:
            keys = [k for k in keys if not self.store.check([k])]
            time.sleep(0.1)


def _has_fileno(stream) -> bool:
    try:
        stream.fileno()
        return True
    except Exception:
        return False
