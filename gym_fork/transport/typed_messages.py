"""Typed control messages: a frozen dataclass per message, sent as a dict
``{"op": OP, field: value, ...}`` in a frame of gym_fork/transport/control.py (fds
attached with SCM_RIGHTS), and checked field by field when received.

A message type subclasses :class:`Message`, names itself with ``OP``, bounds its frame
with ``MAX_BYTES`` and announces its fds with ``FDS`` (plus one per True in a
``pidfds`` field, or its own :meth:`Message.fd_count`). Its fields may be ``int``,
``float``, ``bool``, ``str``, ``bytes``, ``Any``, ``X | None``, ``list[X]``,
``dict[K, V]`` and other such dataclasses. A process travels as its pidfd
(:func:`send_with_pidfds`, :func:`adopt_pidfds`): a pid alone proves nothing.

The sender may be untrusted (it runs env code). What :func:`receive` returns is
guaranteed to be an instance of one of the types the receiver asked for, of exactly
that type's fields, none missing but those with defaults, each of its annotated type
(a ``bool`` is no ``int``; lists and dicts item by item, nested dataclasses built),
with at most :data:`MAX_ITEMS` items in a list or dict and :data:`MAX_TEXT` characters
in a str, from a frame no larger than the largest ``MAX_BYTES`` of those types (a larger
one is refused before it is read), with exactly as many fds as it announces. Anything
else raises :class:`~gym_fork.errors.ControlMessageError` (a closed socket
``EOFError``) with every fd that came closed; :func:`receive_reply` turns those and a
missing answer into :class:`~gym_fork.errors.SandboxStartError`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import socket
import time
import types
import typing
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar, overload

from gym_fork.errors import ControlMessageError, SandboxStartError
from gym_fork.system.linux import NO_PID, ProcessWatch, pidfd_pids, wait_readable
from gym_fork.transport.control import recv_message, send_message

MAX_ITEMS = 4096  # items of one list or dict in a message
MAX_TEXT = 1 << 20  # characters of one str


@dataclass(frozen=True)
class Message:
    """Base of every control message; ``OP`` names it on the wire."""

    OP: ClassVar[str]
    MAX_BYTES: ClassVar[int] = 1 << 20  # the largest frame of this type a receiver reads
    FDS: ClassVar[int] = 0  # fds that come with it, besides a pidfd per True in pidfds

    def fd_count(self) -> int:
        """How many fds come with this message."""
        return self.FDS + sum(getattr(self, "pidfds", ()))

    def encode(self) -> dict[str, Any]:
        return {"op": self.OP, **dataclasses.asdict(self)}


# The types a receiver expects: what it gets is one of them (the checker narrows it).
_A = TypeVar("_A", bound=Message)
_B = TypeVar("_B", bound=Message)
_C = TypeVar("_C", bound=Message)


def send(sock: socket.socket, message: Message, fds: tuple[int, ...] | list[int] = ()) -> None:
    """Send ``message`` with ``fds`` (as many as it announces)."""
    if len(fds) != message.fd_count():
        raise ValueError(f"{message.OP}: {len(fds)} fds given, {message.fd_count()} announced")
    send_message(sock, message.encode(), fds=tuple(fds))


def send_with_pidfds(
    sock: socket.socket,
    message: Message,
    pids: list[int],
    pidfds: list[int] | None = None,
    extra: tuple[int, ...] = (),
) -> None:
    """Send ``message`` with a pidfd of each of ``pids`` (the receiver learns their pids
    in its own namespace from them); its ``pidfds`` says which came (a process already
    reaped has none). ``pidfds``: the caller's own pidfds of them, sent as they are
    (and not closed); without them each pid is opened now. ``extra``: fds sent after
    the pidfds (the message's own, which it announces)."""
    opened = [_pidfd_or_none(pid) for pid in pids] if pidfds is None else []
    fds = opened if pidfds is None else pidfds
    try:
        if "pidfds" not in {f.name for f in dataclasses.fields(message)}:
            raise TypeError(f"{message.OP} has no pidfds field")
        if len(fds) != len(pids):
            raise ValueError(f"{message.OP}: {len(fds)} pidfds for {len(pids)} processes")
        message = dataclasses.replace(message, **{"pidfds": [fd >= 0 for fd in fds]})
        send(sock, message, [fd for fd in fds if fd >= 0] + list(extra))
    finally:
        for fd in opened:
            if fd >= 0:
                os.close(fd)


def _pidfd_or_none(pid: int) -> int:
    """A new pidfd of ``pid``, -1 if there is no such process (reaped)."""
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        return -1


def adopt_pidfds(local_pids: list[int], present: list[bool], fds: list[int]) -> list[ProcessWatch]:
    """Watches of the processes a peer named as ``local_pids`` (in its pid namespace),
    from the pidfds that came with its message (``present``: its ``pidfds``, see
    :func:`send_with_pidfds`), each with the process's pid in ours. A peer that sends
    anything but a pidfd of each process is refused (SandboxStartError, every fd
    closed): a receiver never signals or inspects a pid it was merely told.

    A process reaped already (no pidfd came, or its pidfd says so) gets a watch that
    says dead with pid :data:`~gym_fork.system.linux.NO_PID`: the pid the peer named
    may be another process's in our namespace by now (or always was), and handles
    pass their watch's pid to what reads /proc (isolation, memory, GPU evidence,
    stop state)."""
    rest = list(fds)
    watches: list[ProcessWatch] = []
    try:
        if len(present) != len(local_pids):
            raise SandboxStartError(f"expected a pidfd per process, got {len(fds)}")
        for local, has_fd in zip(local_pids, present, strict=True):
            if not has_fd:  # reaped already: a watch that says dead
                watches.append(ProcessWatch(NO_PID, -1))
                continue
            fd = rest.pop(0)
            pids = pidfd_pids(fd)
            watches.append(ProcessWatch(pids[0] if pids and pids[0] > 0 else NO_PID, fd))
            if not pids or pids[-1] not in (local, -1):
                raise SandboxStartError(f"not a pidfd of process {local}")
    except BaseException:
        close_fds(rest)
        for watch in watches:
            watch.close()
        raise
    return watches


@overload
def receive(sock: socket.socket, a: type[_A], /) -> tuple[_A, list[int]]: ...
@overload
def receive(sock: socket.socket, a: type[_A], b: type[_B], /) -> tuple[_A | _B, list[int]]: ...
@overload
def receive(
    sock: socket.socket, a: type[_A], b: type[_B], c: type[_C], /
) -> tuple[_A | _B | _C, list[int]]: ...
def receive(sock: socket.socket, *expected: type[Message]) -> tuple[Message, list[int]]:
    """The next message, which must be one of ``expected``, and its fds (the caller's).
    Raises ``EOFError`` (``ControlMessageError`` for a bad message) with fds closed."""
    raw, fds = recv_message(sock, max(kind.MAX_BYTES for kind in expected))
    return decode(raw, fds, *expected), fds


@overload
def receive_reply(
    sock: socket.socket, timeout: float | None, what: str, a: type[_A], /
) -> tuple[_A, list[int]]: ...
@overload
def receive_reply(
    sock: socket.socket, timeout: float | None, what: str, a: type[_A], b: type[_B], /
) -> tuple[_A | _B, list[int]]: ...
def receive_reply(
    sock: socket.socket, timeout: float | None, what: str, *expected: type[Message]
) -> tuple[Message, list[int]]:
    """The answer to a request (``what``), whole within ``timeout`` seconds; a missing,
    dead, malformed or trickled answer raises SandboxStartError."""
    deadline = None if timeout is None else time.monotonic() + timeout
    if not wait_readable(sock.fileno(), timeout):
        raise SandboxStartError(f"{what}: no answer within {timeout} s")
    try:
        raw, fds = recv_message(sock, max(kind.MAX_BYTES for kind in expected), deadline)
        return decode(raw, fds, *expected), fds
    except ControlMessageError as exc:
        raise SandboxStartError(f"{what}: {exc}") from exc
    except (EOFError, ConnectionError) as exc:
        raise SandboxStartError(f"{what}: the other end closed the connection (died)") from exc


def close_fds(fds: list[int]) -> None:
    """Close fds that came with a message and are not kept."""
    for fd in fds:
        os.close(fd)


def decode(raw: Any, fds: list[int], *expected: type[Message]) -> Message:
    """``raw`` (a received dict) as one of ``expected``, checked field by field."""
    try:
        kinds = {kind.OP: kind for kind in expected}
        op = raw.get("op") if isinstance(raw, dict) else None
        kind = kinds.get(op) if isinstance(op, str) else None
        if kind is None:
            shown = repr(op)[:80] if isinstance(raw, dict) else f"a {type(raw).__name__}"
            raise _refuse(f"expected {' or '.join(kinds)}, got {shown}")
        fields = {k: v for k, v in raw.items() if k != "op"}
        message = _build(kind, fields, kind.OP)
        if message.fd_count() != len(fds):
            raise _refuse(f"{kind.OP}: {len(fds)} fds came, {message.fd_count()} announced")
        return message
    except BaseException:
        close_fds(fds)
        raise


def _refuse(text: str) -> ControlMessageError:
    return ControlMessageError(f"a malformed control message: {text}", reason="malformed")


@functools.cache
def _hints(kind: type) -> dict[str, Any]:
    return {f.name: typing.get_type_hints(kind)[f.name] for f in dataclasses.fields(kind)}


def prepare_decoding(*kinds: type) -> None:
    """Resolve the field types of ``kinds`` (and of the dataclasses in them) now: the
    first decode of a type evaluates its annotations (~0.7 ms), which a process about to
    fork children that receive it (the warm parent) pays once for all of them."""
    for kind in kinds:
        for hint in _hints(kind).values():
            for inner in (hint, *typing.get_args(hint)):
                if isinstance(inner, type) and dataclasses.is_dataclass(inner):
                    prepare_decoding(inner)


def _build(kind: type, fields: Any, where: str) -> Any:
    hints = _hints(kind)
    if not isinstance(fields, dict):
        raise _refuse(f"{where}: expected a dict, got {type(fields).__name__}")
    missing = dataclasses.MISSING
    required = {
        f.name
        for f in dataclasses.fields(kind)
        if f.default is missing and f.default_factory is missing
    }
    if set(fields) - set(hints) or required - set(fields):
        got = sorted(map(str, fields))[:20]
        raise _refuse(f"{where}: fields {got}, expected {sorted(hints)}")
    return kind(**{k: _check(v, hints[k], f"{where}.{k}") for k, v in fields.items()})


def _check(value: Any, hint: Any, where: str) -> Any:
    """``value`` if it is of type ``hint`` (a dataclass built from its dict), else refused."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if origin is types.UnionType or origin is typing.Union:
        for option in args:
            if option is type(None) and value is None:
                return None
        return _check(value, next(a for a in args if a is not type(None)), where)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _build(hint, value, where)
    if origin in (list, dict):
        if not isinstance(value, origin) or len(value) > MAX_ITEMS:
            raise _refuse(f"{where}: expected a {origin.__name__} of at most {MAX_ITEMS}")
        if origin is list:
            return [_check(item, args[0], f"{where}[]") for item in value]
        return {
            _check(k, args[0], f"{where} key"): _check(v, args[1], f"{where}[{k!r:.40}]")
            for k, v in value.items()
        }
    ok = isinstance(value, hint) and not (hint is int and isinstance(value, bool))
    if not ok or (hint is str and len(value) > MAX_TEXT):
        raise _refuse(f"{where}: expected {hint.__name__}, got {type(value).__name__}")
    return value
