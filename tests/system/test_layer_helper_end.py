"""The controller's end of the layer helper (gym_fork/system/layer_helper.py) under a
Ctrl-C, a close from another thread, a fork of the controller, and an answer a fork
does not wait for."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import threading
import time

import pytest

from gym_fork.system import layer_helper
from tests.helpers import wait_until

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the layer helper runs as root")


@pytest.fixture
def helper():
    started = layer_helper.LayerHelper(1 << 20)
    pidfd = os.pidfd_open(os.getpid())
    try:
        yield started, pidfd
    finally:
        os.close(pidfd)
        if started.process is not None:
            with contextlib.suppress(ProcessLookupError):  # stopped by a test, or killed
                os.kill(started.process.pid, signal.SIGCONT)
        started.close()


def test_a_ctrl_c_as_a_request_is_sent_misfiles_no_answer(helper, ctrl_c, monkeypatch):
    """The request went out, then the Ctrl-C: it is recorded all the same (and its
    answer dropped), so the next answers are filed under their own requests; a request
    sent and not recorded would have its answer filed under the next one, and the
    helper broken by an answer 'nobody asked for'."""
    started, pidfd = helper
    send_fds = socket.send_fds

    def sent_then_ctrl_c(*args):
        sent = send_fds(*args)
        ctrl_c()
        return sent

    monkeypatch.setattr(socket, "send_fds", sent_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        started.ask_wrote_since(pidfd, 0)
    monkeypatch.setattr(socket, "send_fds", send_fds)
    later = [started.ask_wrote_since(pidfd, 0) for _ in range(3)]
    for number in later:
        started.wrote_since(number)
    assert wait_until(lambda: not started._unanswered, timeout=10)
    assert not started.broken
    assert not started._answers and not started._abandoned


def test_close_releases_a_thread_waiting_for_an_answer(helper):
    """A freeze waited for in another thread while the host closes: it fails at once
    (LayerLost: the helper was on it), not at its deadline (10 s)."""
    started, pidfd = helper
    assert started.process is not None
    os.kill(started.process.pid, signal.SIGSTOP)  # it answers nothing
    outcome: list[BaseException] = []

    def wait_for_a_freeze():
        try:
            started.freeze(pidfd, 0, 1 << 20, "/nowhere")
        except BaseException as exc:
            outcome.append(exc)

    waiter = threading.Thread(target=wait_for_a_freeze)
    waiter.start()
    assert wait_until(lambda: started._unanswered, timeout=10)
    began = time.monotonic()
    started.close()
    waiter.join(layer_helper.ANSWER_WAIT_S)
    assert not waiter.is_alive() and time.monotonic() - began < layer_helper.ANSWER_WAIT_S / 2
    assert isinstance(outcome[0], layer_helper.LayerLost), outcome
    assert started.sock.fileno() == -1  # closed, by its one reader


def test_a_forked_child_of_the_controller_leaves_its_helper_alone(helper):
    """A fork of the controller (a user's multiprocessing worker) inherits the helper's
    end without its answers' thread: there it asks nothing and its close neither shuts
    the shared socket down nor ends the helper; the controller's end works on."""
    started, pidfd = helper
    child = os.fork()
    if child == 0:  # pragma: no cover - the child
        code = 1
        try:
            code = 0 if started.broken else 2
            started.close()
            try:
                started.ask_wrote_since(pidfd, 0)
                code = 3
            except RuntimeError:
                pass
        finally:
            os._exit(code)
    _pid, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert started.alive() and not started.broken
    started.wrote_since(started.ask_wrote_since(pidfd, 0))
    assert not started.broken


def test_a_ctrl_c_as_a_wait_lets_go_of_the_lock_comes_out_as_itself(helper, monkeypatch):
    """A Ctrl-C right after a condition's wait released the lock, before it took it
    back: the KeyboardInterrupt comes out (not a RuntimeError about a lock not held,
    which the check's caller would take for an answer), and the helper works on."""
    started, pidfd = helper
    assert started.process is not None
    os.kill(started.process.pid, signal.SIGSTOP)  # the check waits
    number = started.ask_wrote_since(pidfd, 0)
    release = started._filed._release_save

    def released_then_ctrl_c(*args):
        release(*args)
        monkeypatch.setattr(started._filed, "_release_save", release)
        raise KeyboardInterrupt

    monkeypatch.setattr(started._filed, "_release_save", released_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        started.wrote_since(number)
    assert not started._asking._is_owned()
    os.kill(started.process.pid, signal.SIGCONT)
    started.wrote_since(started.ask_wrote_since(pidfd, 0))
    assert not started.broken


def test_a_signal_held_by_a_request_is_handled_once_the_lock_is_free(helper, monkeypatch):
    """A user's handler of a held signal may close the env: it runs with the helper's
    lock free (else the answers' thread could not file anything meanwhile)."""
    started, pidfd = helper
    owned = []
    previous = signal.signal(signal.SIGHUP, lambda *_: owned.append(started._asking._is_owned()))
    send_fds = socket.send_fds

    def sent_then_hangup(*args):
        sent = send_fds(*args)
        os.kill(os.getpid(), signal.SIGHUP)
        return sent

    try:
        monkeypatch.setattr(socket, "send_fds", sent_then_hangup)
        number = started.ask_wrote_since(pidfd, 0)
        monkeypatch.setattr(socket, "send_fds", send_fds)
    finally:
        signal.signal(signal.SIGHUP, previous)
    assert owned == [False]
    started.wrote_since(number)


def test_a_check_not_waited_for_is_forgotten_and_its_answer_dropped(helper):
    """A fork does not wait for its check's answer (its freeze is asked at once, and
    follows the check in the helper): ``wrote_since(wait=False)`` says "look" at once,
    the late answer is dropped when it comes, and the answers after it are filed under
    their own requests. An answer already there is taken."""
    started, pidfd = helper
    assert started.process is not None
    os.kill(started.process.pid, signal.SIGSTOP)  # the check waits
    number = started.ask_wrote_since(pidfd, 0)
    began = time.monotonic()
    assert started.wrote_since(number, wait=False) is True
    assert time.monotonic() - began < 1.0
    assert number in started._abandoned
    os.kill(started.process.pid, signal.SIGCONT)
    later = started.ask_wrote_since(pidfd, 0)
    assert wait_until(lambda: later in started._answers, timeout=10)
    assert not started._abandoned  # the late answer came first, and was dropped
    started.wrote_since(later, wait=False)
    assert later not in started._answers and not started.broken


def test_a_helper_the_controller_ends_may_have_begun_any_request_not_answered(helper):
    """Ended by the controller (a deadline, a close), the helper may have sent answers
    the answers' thread has not filed yet: any request still unanswered may have been
    begun (a freeze among them is LayerLost: its source is not forked again), not
    only the oldest (a freeze queued behind a check, taken for never begun, left its
    source on a layer no one held; a cold review's reproduction)."""
    started, pidfd = helper
    assert started.process is not None
    os.kill(started.process.pid, signal.SIGSTOP)
    numbers = [started.ask_wrote_since(pidfd, 0) for _ in range(2)]
    started.close()
    assert started.maybe_begun == frozenset(numbers)


def test_a_helper_that_ends_by_itself_was_on_its_oldest_unanswered_request(helper):
    """Its EOF comes after every answer it sent: the oldest unanswered request is the
    one it was on, and the requests behind it were never begun."""
    started, pidfd = helper
    assert started.process is not None
    os.kill(started.process.pid, signal.SIGSTOP)
    numbers = [started.ask_wrote_since(pidfd, 0) for _ in range(2)]
    os.kill(started.process.pid, signal.SIGKILL)
    assert wait_until(lambda: started.broken, timeout=10)
    assert started.maybe_begun == frozenset(numbers[:1])


def test_the_answers_a_helper_sent_before_it_ended_with_requests_unread_are_filed(
    monkeypatch,
):
    """A helper that ends with requests unread makes the kernel report ECONNRESET to the
    reader first, before what the helper had sent: the reader reads on, so an answer it
    sent (a freeze's new layer) is filed, and only the request it never answered counts
    as maybe begun. The test plays the helper on its end of the socket."""
    from gym_fork.system.linux import ProcessWatch

    reader_may_read = threading.Event()
    recv_fds = socket.recv_fds

    def held_back(sock, *args):
        reader_may_read.wait(10)
        return recv_fds(sock, *args)

    monkeypatch.setattr(socket, "recv_fds", held_back)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    stand_in = subprocess.Popen(["sleep", "30"])
    started = layer_helper.LayerHelper(1 << 20, (ours, ProcessWatch(stand_in.pid)))
    pidfd = os.pidfd_open(os.getpid())
    try:
        answered, unread = (started.ask_wrote_since(pidfd, 0) for _ in range(2))
        assert b'"check"' in theirs.recv(4096)  # the first request; the second stays unread
        socket.send_fds(theirs, [b'{"writes": false}'], [])
        theirs.close()  # requests unread: the reader's next recv says ECONNRESET first
        stand_in.kill()
        reader_may_read.set()
        assert wait_until(lambda: started.broken, timeout=10)
        assert started.wrote_since(answered) is False  # filed: not lost to the reset
        assert started.maybe_begun == frozenset([unread])
    finally:
        reader_may_read.set()
        os.close(pidfd)
        started.close()
        stand_in.wait()
