"""gym_fork/system/held_signals.py: a Ctrl-C inside ``with held():`` comes at its end."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from gym_fork.system.held_signals import held


def test_a_ctrl_c_inside_comes_once_the_block_has_ended(ctrl_c):
    done = []
    with pytest.raises(KeyboardInterrupt), held():
        ctrl_c()
        sum(range(1000))  # the handler would have run by now, unheld
        done.append("the block ran to its end")
    assert done == ["the block ran to its end"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_nested_blocks_hold_to_the_outermost_end(ctrl_c):
    steps = []
    with pytest.raises(KeyboardInterrupt), held():
        with held():
            ctrl_c()
            steps.append("inner")
        steps.append("after the inner block")
    assert steps == ["inner", "after the inner block"]


def test_signals_come_in_order_and_the_users_handler_runs(ctrl_c):
    """A handler of the user's own runs as it would have (here it does not raise: the
    block's end does not either), for each signal that came."""
    seen = []
    previous = signal.signal(signal.SIGHUP, lambda signum, frame: seen.append(signum))
    try:
        with held():
            os.kill(os.getpid(), signal.SIGHUP)
            os.kill(os.getpid(), signal.SIGHUP)
            sum(range(1000))
            assert seen == []
        assert seen == [signal.SIGHUP, signal.SIGHUP]
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_without_a_signal_nothing_is_raised_and_the_handlers_are_back(ctrl_c):
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGALRM)}
    with held():
        pass
    assert {s: signal.getsignal(s) for s in before} == before


def test_an_ignored_or_default_signal_is_left_alone():
    """Only Python handlers are held: an ignored SIGINT stays ignored, a SIGTERM left
    to the kernel's default still ends the process at once."""
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a test runner may have its own
    try:
        with held():
            assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def test_in_another_thread_it_holds_nothing():
    """Python runs signal handlers in the main thread only: a block elsewhere must not
    (and cannot) swap them."""
    seen = []

    def other():
        with held():
            seen.append(signal.getsignal(signal.SIGINT))

    thread = threading.Thread(target=other)
    thread.start()
    thread.join(10)
    assert seen == [signal.getsignal(signal.SIGINT)]


def test_a_signal_while_the_handlers_are_put_back_leaves_nothing_held(ctrl_c, monkeypatch):
    """A Ctrl-C that lands while the block's end puts the handlers back (the real one is
    back already) raises there: later blocks hold again all the same."""
    from gym_fork.system import held_signals

    put_back = held_signals._signal.signal  # what it puts handlers back with

    def put_back_then_ctrl_c(signum, handler):
        previous = put_back(signum, handler)
        if handler is signal.default_int_handler:
            ctrl_c()
        return previous

    with pytest.raises(KeyboardInterrupt), held():
        monkeypatch.setattr(held_signals._signal, "signal", put_back_then_ctrl_c)
    monkeypatch.undo()
    assert held_signals._holding is None
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    steps = []
    with pytest.raises(KeyboardInterrupt), held():
        ctrl_c()
        sum(range(1000))
        steps.append("held again")
    assert steps == ["held again"]


def test_a_process_forked_while_a_block_holds_gets_its_handlers_back(ctrl_c):
    """A fork made by another thread while the main thread holds signals: the child
    never reaches that block's end, and must not keep a recorder that swallows them."""
    results = []

    def fork_and_check():
        child = os.fork()
        if child == 0:  # pragma: no cover - the child
            from gym_fork.system import held_signals

            ok = signal.getsignal(signal.SIGINT) is signal.default_int_handler
            os._exit(0 if ok and held_signals._holding is None else 1)
        results.append(os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]))

    with held():
        thread = threading.Thread(target=fork_and_check)
        thread.start()
        thread.join(30)
    assert results == [0]
