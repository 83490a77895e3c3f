"""The watchdog's heartbeats and hang reports, with two ranks' watchdogs sharing one in-process store.

(Through the launcher, with real ranks and the backend's own timeout: tests/distributed/test_named_hangs.py.)"""
import os
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from zeroengine.comm.watchdog import FAILED, FINISHED, Heartbeat, Ticket, Watchdog, describe_hang


def _pair(tmp_path, heartbeat_s=0.05):
    store = dist.HashStore()
    files = [open(tmp_path / f"stack{r}.txt", "w+") for r in range(2)]
    dogs = [Watchdog(store, r, timeout_s=1.0, generation=1, heartbeat_s=heartbeat_s, stack_file=files[r]).start()
            for r in range(2)]
    return dogs, files


def _issue(dog, n, group="world", op="all_reduce"):
    return [dog.issue(group, op, "float32", 10) for _ in range(n)][-1]


def _stop(dogs, files):
    for dog in dogs:
        dog.stop()
    for f in files:
        f.close()


def test_a_rank_stuck_in_its_own_code_is_named_and_prints_its_stack(tmp_path):
    dogs, files = _pair(tmp_path)
    _issue(dogs[1], 2)  # rank 1 left its second collective and went on with its own code
    dogs[1].unblock()
    ticket = _issue(dogs[0], 3)
    dogs[0].block(ticket)  # rank 0 waits in the third
    time.sleep(0.2)  # both heartbeats posted
    report = dogs[0].report(ticket, members=[0, 1])
    _stop(dogs, files)
    assert "hang report from rank 0" in report and "#2 all_reduce(float32[10]) in group world" in report
    assert "rank 1: stuck in its own code" in report and "its last collective: #1 all_reduce" in report
    stack1 = (tmp_path / "stack1.txt").read_text()
    assert "rank 1's Python stack (asked for by rank 0's hang report)" in stack1
    assert "test_a_rank_stuck_in_its_own_code_is_named_and_prints_its_stack" in stack1  # this test's frame
    assert "rank 0's Python stack (its own hang report follows)" in (tmp_path / "stack0.txt").read_text()


def test_a_rank_that_left_early_is_named_as_such(tmp_path):
    dogs, files = _pair(tmp_path)
    _issue(dogs[1], 2)
    dogs[1].stop(FINISHED)
    ticket = _issue(dogs[0], 3)
    dogs[0].block(ticket)
    started = time.monotonic()
    report = dogs[0].report(ticket, members=[0, 1])
    assert time.monotonic() - started < 1.0  # a finished rank prints no stack: not waited for
    _stop(dogs, files)
    assert "rank 1: left early: its script ended" in report and "after 2 collective(s) in this group" in report


def test_a_different_collective_at_the_same_number_is_named_with_what_it_was(tmp_path):
    dogs, files = _pair(tmp_path)
    _issue(dogs[1], 2)
    theirs = dogs[1].issue("world", "broadcast", "int64", 4)
    dogs[1].block(theirs)
    ticket = _issue(dogs[0], 3)
    dogs[0].block(ticket)
    time.sleep(0.2)
    report = dogs[0].report(ticket, members=[0, 1])
    _stop(dogs, files)
    assert "rank 1: issued a different collective as #2: #2 broadcast(int64[4]) in group world" in report


def test_a_rank_waiting_in_another_group_and_a_failed_rank_are_told_apart():
    now = time.time()
    ticket = Ticket("world", 5, "all_gather", "bfloat16", 64)
    elsewhere = Ticket("0-2", 1, "all_to_all", "float32", 8, "experts of layer 3")
    beats = {
        0: Heartbeat(0, "waiting", {"world": 6}, ticket, ticket, now - 30),
        1: Heartbeat(1, "waiting", {"world": 5, "0-2": 2}, elsewhere, elsewhere, now - 31),
        2: Heartbeat(2, FAILED, {"world": 5}, Ticket("world", 4, "all_reduce"), None, now - 29,
                     "ValueError: loss is NaN"),
        3: Heartbeat(3, "waiting", {"world": 6}, ticket, ticket, now - 30),  # arrived: not listed
        4: None,
    }
    report = describe_hang(0, ticket, 30.0, beats, now=now)
    assert ("rank 1: waiting for 31 s in another collective: #1 all_to_all(float32[8]) for experts of layer 3 in "
            "group 0-2") in report
    assert "rank 2: failed 29 s ago (ValueError: loss is NaN)" in report
    assert "rank 3" not in report
    assert "rank 4: never posted a heartbeat" in report


def test_every_rank_arrived_says_so():
    ticket = Ticket("world", 0, "barrier")
    beats = {r: Heartbeat(r, "waiting", {"world": 1}, ticket, ticket, time.time()) for r in range(2)}
    assert "every rank of the group reached it" in describe_hang(0, ticket, 5.0, beats)


def test_a_receive_matches_its_send_and_names_a_sender_that_never_sent(tmp_path):
    dogs, files = _pair(tmp_path)
    sent = dogs[1].issue(dogs[1].pair_name(1, 0), "send", "float32", 16)
    received = dogs[0].issue(dogs[0].pair_name(1, 0), "recv", "float32", 16)
    assert received.same_call(sent)
    waiting = dogs[0].issue(dogs[0].pair_name(1, 0), "recv", "float32", 16)  # a second message never sent
    dogs[0].block(waiting)
    time.sleep(0.2)
    report = dogs[0].report(waiting, members=None, timed_out=False)
    _stop(dogs, files)
    assert "failure report from rank 0" in report and "#1 recv(float32[16]) in group p2p:1->0" in report
    assert "rank 1: gone: its connection closed" in report and "said: running its own code" in report


def test_heartbeats_round_trip_through_the_store_encoding():
    beat = Heartbeat(3, "waiting", {"world": 7, "p2p:1->3": 2}, Ticket("world", 6, "all_reduce", "float32", 5),
                     Ticket("world", 6, "all_reduce", "float32", 5), 12.5)
    assert Heartbeat.decode(beat.encode()) == beat


def test_a_wait_the_backend_never_ends_is_reported_and_ends_the_process():
    """Where the backend never times out (a silent one), the watchdog's thread ends the wait itself."""
    code = (
        "import time, torch.distributed as dist\n"
        "from zeroengine.comm import watchdog as w\n"
        "w.SILENT_BACKEND_GRACE_S = 0.2\n"
        "store = dist.HashStore()\n"
        "peer = w.Watchdog(store, 1, 0.3, 1, heartbeat_s=0.05).start()\n"
        "me = w.Watchdog(store, 0, 0.3, 1, heartbeat_s=0.05, silent_backend=True).start()\n"
        "me._members['world'] = [0, 1]\n"
        "me.block(me.issue('world', 'all_reduce', 'float32', 3))\n"
        "time.sleep(30)\n"
        "print('not reached')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONFAULTHANDLER": "0"})
    assert done.returncode == 1, done.stderr
    assert "not reached" not in done.stdout
    assert "hang report from rank 0" in done.stderr and "rank 1: stuck in its own code" in done.stderr


@pytest.mark.parametrize("value", ["0", "false", "off"])
def test_the_watchdog_can_be_turned_off(monkeypatch, value):
    from zeroengine.comm.watchdog import watchdog_requested

    monkeypatch.setenv("ZEROENGINE_WATCHDOG", value)
    assert not watchdog_requested()
    monkeypatch.setenv("ZEROENGINE_WATCHDOG", "1")
    assert watchdog_requested()


class _SlowStore:
    """A store whose every call takes a while, as one across a loaded network does: the watchdog's thread is
    then mostly inside a store call when something stops it."""

    def __init__(self, delay_s: float):
        self.inner, self.delay_s = dist.HashStore(), delay_s

    def set(self, key, value):
        time.sleep(self.delay_s)
        self.inner.set(key, value)

    def check(self, keys):
        time.sleep(self.delay_s)
        return self.inner.check(keys)

    def get(self, key):
        time.sleep(self.delay_s)
        return self.inner.get(key)


def test_stop_returns_once_the_thread_has_left_the_store():
    """A daemon thread still inside a store call (GIL released) when the interpreter finalizes aborts the process
    after the script has ended ("terminate called without an active exception", seen on accelerate's loop, which
    destroys its group itself): stop() waits for the thread to leave."""
    dog = Watchdog(_SlowStore(0.2), 0, timeout_s=1.0, generation=1, heartbeat_s=0.01).start()
    time.sleep(0.3)  # the thread is now in its loop of store calls
    dog.stop()
    assert not dog._thread.is_alive()


def test_exit_stops_the_watchdog_of_a_group_the_script_destroyed_itself(monkeypatch):
    from zeroengine.comm import backend

    dog = Watchdog(_SlowStore(0.2), 0, timeout_s=1.0, generation=1, heartbeat_s=0.01).start()
    monkeypatch.setattr(backend.state, "watchdog", dog)
    monkeypatch.setattr(backend.dist, "is_initialized", lambda: False)  # (as after accelerate's end_training)
    time.sleep(0.3)
    backend._ExitTeardown().run()
    assert not dog._thread.is_alive() and backend.state.watchdog is None
