"""The init message a warm parent prepares the env_fns from, and the reply it sends when
preparing them raised (the same for every host)."""

from __future__ import annotations

import os
import sys
import traceback
from typing import Any, NoReturn

import cloudpickle

from gym_fork.errors import SandboxStartError, like_builtin
from gym_fork.hosts.base import HostConfig
from gym_fork.text_safety import escape_controls


def init_message(config: HostConfig) -> dict[str, Any]:
    """What a warm parent needs to prepare: the env_fns (cloudpickle) with the
    controller's ``sys.path``, working directory and Gymnasium registry (so that envs
    registered at run time resolve in the sandbox as they do in the caller)."""
    from gymnasium.envs.registration import registry

    try:
        payload = cloudpickle.dumps(list(config.env_fns))
    except Exception as exc:
        raise SandboxStartError(f"env_fns cannot be pickled for the sandbox: {exc}") from exc
    prepare = config.prepare
    return {
        "op": "init",
        "env_fns": payload,
        "sys_path": list(sys.path),
        "cwd": os.getcwd(),
        "registry": cloudpickle.dumps(dict(registry)),
        "prepare": None if prepare is None else cloudpickle.dumps(prepare),
        "clean_launch": config.clean_launch,
    }


def prepare_failure(exc: BaseException) -> dict[str, Any]:
    """The reply of a warm parent whose preparation raised ``exc``."""
    try:
        pickled = cloudpickle.dumps(exc)
    except Exception:
        pickled = None
    return {
        "op": "error",
        "error": f"{type(exc).__name__}: {exc}",
        "exception": pickled,
        "traceback": traceback.format_exc(),
    }


def raise_prepare_failure(reply: dict, what: str, *, trusted: bool = False) -> NoReturn:
    """Raise what the warm parent (``what``) raised while preparing the env_fns: the
    original exception with its traceback as a note (only when ``trusted``: unpickling
    runs code), or a SandboxStartError carrying the text (control characters escaped:
    the warm parent ran env code)."""
    exc = None
    if trusted and reply.get("exception") is not None:
        try:
            exc = cloudpickle.loads(reply["exception"])
        except Exception:
            exc = None
    if isinstance(exc, BaseException):
        exc.add_note(
            f"[gym_fork] raised while preparing {what}; its traceback:\n"
            + escape_controls(str(reply.get("traceback", "")))
        )
        raise exc
    error = escape_controls(str(reply.get("error"))[:2000])
    trace = escape_controls(str(reply.get("traceback", ""))[:20000])
    type_name = error.split(":", 1)[0] if ":" in error else ""
    raise like_builtin(SandboxStartError, type_name)(
        f"{what} could not prepare the env_fns: {error}\n{trace}"
    )
