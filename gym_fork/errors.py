"""Typed errors raised by gym_fork, each with a stable ``code``."""

from __future__ import annotations

import builtins
import functools
import multiprocessing
from typing import Any, TypeVar, cast


class GymForkError(Exception):
    """Base class of every error gym_fork raises on its own behalf."""

    code = "gym_fork"


class TransportError(GymForkError):
    """A ring record was corrupt, torn, oversize or out of sequence.

    ``worker`` names the sandbox whose ring misbehaved; ``reason`` is the ring's
    own diagnosis (``magic``, ``length``, ``sequence``, ``counters``, ``too_big``).
    Where the controller killed the sandbox for it, ``indices`` are its sub-envs.
    """

    code = "transport"
    indices: list[int]  # set only where the sandbox was killed for it

    def __init__(self, message: str, *, worker: str | None = None, reason: str = "") -> None:
        super().__init__(message)
        self.worker = worker
        self.reason = reason


class PeerGone(TransportError):
    """The other end of a ring died (its ``alive`` check failed) while this side waited
    for it; ``reason`` is ``"peer_gone"``."""

    code = "peer_gone"

    def __init__(self, message: str, *, worker: str | None = None) -> None:
        super().__init__(message, worker=worker, reason="peer_gone")


class PickleRefused(TransportError):
    """A record from an untrusted sandbox held a pickle; it was not loaded (loading a
    pickle runs code). The record was read whole: the channel stays in step."""

    code = "pickle_refused"

    def __init__(self, message: str, *, worker: str | None = None) -> None:
        super().__init__(message, worker=worker, reason="pickle")


class ControlMessageError(TransportError, EOFError):
    """A control-socket message broke its framing (too long, too many or missing fds,
    undecodable). Also an ``EOFError``: the connection is unusable after it."""

    code = "control_message"


class RingTimeout(GymForkError):
    """Nothing arrived on (or no space freed in) a ring before the deadline."""

    code = "ring_timeout"


class SandboxStartError(GymForkError):
    """A warm parent or worker sandbox could not be started."""

    code = "sandbox_start"


class IsolationMissing(SandboxStartError):
    """``isolation="strict"``: the sandboxes lack a layer; ``missing`` says which, why."""

    code = "isolation_missing"

    def __init__(self, message: str, *, missing: dict[str, str]) -> None:
        super().__init__(message)
        self.missing = dict(missing)


class SubEnvCrashed(GymForkError):
    """A sub-environment's sandbox died (signal, exit or kill) while serving a call.

    ``indices`` are the sub-env indices that lived in the dead sandbox; ``exitcode``
    is negative for a signal, as in :mod:`subprocess`.
    """

    code = "subenv_crashed"

    def __init__(self, message: str, *, indices: list[int], pid: int | None, exitcode=None):
        super().__init__(message)
        self.indices = indices
        self.pid = pid
        self.exitcode = exitcode


class SubEnvTimeout(SubEnvCrashed, multiprocessing.TimeoutError, TimeoutError):
    """Sub-envs did not answer within the vector env's ``timeout`` and were killed.

    Also a ``multiprocessing.TimeoutError`` (what AsyncVectorEnv's waits raise) and a
    builtin ``TimeoutError``.
    """

    code = "subenv_timeout"


class SubEnvStopped(SubEnvCrashed):
    """A sub-env's sandbox was stopped (SIGSTOP, or held in a tracing stop) again and
    again while the controller waited for it, and was killed; ``reset()`` replaces it.

    The kernel does not say who sent the stop: ``suspects`` are the host pids of the
    other sandboxes of its tree (one warm parent, one pid namespace, one uid: each can
    signal the others); ``stops`` is how many times it was found stopped in that wait.
    """

    code = "subenv_stopped"

    def __init__(
        self,
        message: str,
        *,
        indices: list[int],
        pid: int | None,
        exitcode=None,
        suspects: list[int] | None = None,
        stops: int = 0,
    ) -> None:
        super().__init__(message, indices=indices, pid=pid, exitcode=exitcode)
        self.suspects = list(suspects or [])
        self.stops = stops


class SubEnvError(GymForkError):
    """A sub-env raised inside a sandbox whose data the controller does not unpickle:
    the original exception's type name, message and traceback travel as text."""

    code = "subenv_error"

    def __init__(self, message: str, *, index: int, type_name: str, traceback: str) -> None:
        super().__init__(message)
        self.index = index
        self.type_name = type_name
        self.remote_traceback = traceback


class BadActionError(GymForkError, ValueError, TypeError):
    """The batch of actions does not fit the vector env's action space.

    It is both a ValueError (wrong count or shape) and a TypeError (not a batch at
    all), as AsyncVectorEnv raises one or the other for these cases.
    """

    code = "bad_action"


class BadObservationError(GymForkError, ValueError):
    """A sub-environment returned an observation that does not fit its space."""

    code = "bad_observation"


class EncodeError(GymForkError, TypeError):
    """A value (an info entry, a call result) could not be encoded for the ring."""

    code = "encode"


# gym_fork's own errors that a sandbox raises on a sub-env's behalf, rebuilt by name.
_SANDBOX_ERRORS = ("BadObservationError", "BadActionError", "EncodeError")


def _known_exception(type_name: str) -> type | None:
    """The exception class ``type_name`` names among code the controller has already
    loaded: a builtin, one of gym_fork's sandbox errors or one of ``gymnasium.error``."""
    import gymnasium.error

    candidates = [getattr(builtins, type_name, None)]
    if type_name in _SANDBOX_ERRORS:
        candidates.append(globals()[type_name])
    candidates.append(getattr(gymnasium.error, type_name, None))
    for known in candidates:
        if isinstance(known, type) and issubclass(known, Exception):
            return known
    return None


_Error = TypeVar("_Error", bound=GymForkError)


def like_builtin(base: type[_Error], type_name: str, bases: tuple[str, ...] = ()) -> type[_Error]:
    """``base``, also an instance of the exception type a sandbox named, or else of the
    nearest of its ``bases`` (their names, nearest first) that is a builtin, one of
    gym_fork's ``BadObservationError``/``BadActionError``/``EncodeError`` or a
    ``gymnasium.error`` class (matched by name only), so that ``except ValueError``
    still works, without loading anything the sandbox sent. A type that cannot be mixed
    in or built from a message alone is passed over for its own nearest base
    (``UnicodeDecodeError``: ``UnicodeError``); none known gives ``base``."""
    # The class made has ``base`` among its bases (or is ``base``): still a ``base``.
    # A class is hashable; mypy does not see a type[...] as Hashable (python/mypy#11470).
    made = _like_builtin(base, type_name, bases)  # type: ignore[arg-type]
    return cast("type[_Error]", made)


@functools.cache
def _like_builtin(
    base: type[GymForkError], type_name: str, bases: tuple[str, ...]
) -> type[GymForkError]:
    for name in (type_name, *bases):
        known = _known_exception(name)
        for candidate in known.__mro__ if known is not None else ():
            if candidate is Exception:
                break
            mixed = _mixed(base, candidate, type_name)
            if mixed is not None:
                return mixed
    return base


def _base_new(cls, *args, **kwargs):
    return BaseException.__new__(cls, *args)


def _mixed(
    base: type[GymForkError], candidate: type[Any], type_name: str
) -> type[GymForkError] | None:
    """``base`` mixed with ``candidate``, or None if they cannot be. Types with a
    ``__new__`` of their own that refuses subclasses (MemoryError's free list) get
    BaseException's."""
    # str() is the message as sent (KeyError's own __str__ would quote it).
    for extra in ({}, {"__new__": _base_new}):
        try:
            mixed = type(
                f"{base.__name__}[{type_name}]",
                (base, candidate),
                {"__str__": BaseException.__str__, **extra},
            )
            probe = mixed.__new__(mixed, "probe")
            candidate.__init__(probe, "probe")
        except TypeError:  # a layout that cannot be mixed in, or more arguments needed
            continue
        return mixed
    return None
