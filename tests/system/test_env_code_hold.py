"""A sandbox's env code held off during a fork (gym_fork/system/env_code_hold.py): its
signal handlers wait (recorded, then run in order by the source; dropped by a clone),
the collector is off, and everything is as it was after."""

from __future__ import annotations

import gc
import os
import signal
import threading

from gym_fork.system import env_code_hold


def _pending_blocked() -> int:
    with open("/proc/thread-self/status") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    return int(fields["SigBlk"].strip(), 16)


def test_a_held_handler_runs_after_the_release_in_order_and_all_is_put_back():
    ran: list[int] = []
    previous = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGUSR2)}
    signal.signal(signal.SIGUSR1, lambda n, _f: ran.append(n))
    signal.signal(signal.SIGUSR2, lambda n, _f: ran.append(n))
    mask_before, collecting = _pending_blocked(), gc.isenabled()
    try:
        env_code_hold.hold()
        assert env_code_hold.held() and not gc.isenabled()
        # What another thread's delivery does: the handler runs in the main thread.
        signal.getsignal(signal.SIGUSR2)(signal.SIGUSR2, None)
        signal.getsignal(signal.SIGUSR1)(signal.SIGUSR1, None)
        os.kill(os.getpid(), signal.SIGUSR1)  # blocked here: pending until the release
        assert ran == []
        env_code_hold.release()
        assert ran[:2] == [signal.SIGUSR2, signal.SIGUSR1]
        assert ran.count(signal.SIGUSR1) == 2  # the pending one too, once unblocked
        assert not env_code_hold.held()
        assert gc.isenabled() == collecting and _pending_blocked() == mask_before
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def test_a_clone_drops_what_its_source_held():
    ran: list[int] = []
    previous = signal.getsignal(signal.SIGUSR1)
    handler = lambda n, _f: ran.append(n)  # noqa: E731
    signal.signal(signal.SIGUSR1, handler)
    try:
        env_code_hold.hold()
        signal.getsignal(signal.SIGUSR1)(signal.SIGUSR1, None)
        env_code_hold.release(replay=False)
        assert ran == [] and signal.getsignal(signal.SIGUSR1) is handler
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_a_hold_outside_the_main_thread_holds_nothing():
    seen: list[bool] = []

    def other() -> None:
        env_code_hold.hold()
        seen.append(env_code_hold.held())
        env_code_hold.release()

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert seen == [False] and gc.isenabled()
