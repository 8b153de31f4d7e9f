"""A sandbox's env code held off during a fork (gym_fork/system/env_code_hold.py): its
signals wait (their handlers run once it is released), the collector is off, and all is
as it was after; a process another thread forks meanwhile is not held."""

from __future__ import annotations

import gc
import os
import signal
import threading

from gym_fork.system import env_code_hold


def _blocked() -> int:
    with open("/proc/thread-self/status") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    return int(fields["SigBlk"].strip(), 16)


def test_a_signal_during_the_hold_runs_its_handler_after_and_all_is_put_back():
    ran: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda n, _f: ran.append(n))
    mask_before, collecting = _blocked(), gc.isenabled()
    try:
        env_code_hold.hold()
        env_code_hold.hold()  # once is all: one release ends it
        assert env_code_hold.held() and not gc.isenabled()
        # To this thread (a process-directed signal may go to another thread of pytest's,
        # whose handler would run in this one at once: what a threaded source does).
        signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)
        for _ in range(100):  # bytecodes: no handler runs while held
            pass
        assert ran == []
        env_code_hold.release()  # pending, delivered to this thread as it is unblocked
        for _ in range(100):
            pass
        assert ran == [signal.SIGUSR1]
        assert not env_code_hold.held()
        assert gc.isenabled() == collecting and _blocked() == mask_before
    finally:
        signal.signal(signal.SIGUSR1, previous)


def _forked_child_state(fork_from_thread: bool) -> bytes:
    """Fork while held (from the holding thread or another); the child's word on its
    hold and its collector."""
    read_end, write_end = os.pipe()
    pids: list[int] = []

    def fork() -> None:
        pid = os.fork()
        if pid == 0:
            os.write(write_end, b"%d%d" % (env_code_hold.held(), gc.isenabled()))
            os._exit(0)
        pids.append(pid)

    env_code_hold.hold()
    try:
        if fork_from_thread:
            thread = threading.Thread(target=fork)
            thread.start()
            thread.join()
        else:
            fork()
    finally:
        env_code_hold.release()
    os.waitpid(pids[0], 0)
    os.close(write_end)
    try:
        return os.read(read_end, 2)
    finally:
        os.close(read_end)


def test_a_process_another_thread_forks_during_the_hold_is_not_held():
    """An env's thread running a subprocess while its source forks: the child gets its
    collector back (it would run with it off for good), while a fork of the holding
    thread (a clone) stays held until its own set-up is done."""
    assert gc.isenabled()
    assert _forked_child_state(fork_from_thread=True) == b"01"
    assert _forked_child_state(fork_from_thread=False) == b"10"
