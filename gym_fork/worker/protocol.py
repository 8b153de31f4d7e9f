"""The records a controller and a worker exchange over a channel.

A request is ``[op, seq, argument]``; a reply is ``[op, seq, result, errors]`` where
``errors`` is None or a list of error records (:func:`error_record`), one per failing
sub-env. ``seq`` lets the controller drop the reply of a call it stopped waiting for (a
timed-out ``step_wait``).
"""

from __future__ import annotations

import traceback
from typing import Any

import cloudpickle

HELLO = 0
ATTACH = 1
RESET = 2
STEP = 3
CALL = 4
SETATTR = 5
CLOSE = 6
FORK = 8
# A microVM clone learns its new identity (branch index, seed, slab) after a restore;
# it answers with a HELLO record.
REBIND = 9

NAMES = {
    HELLO: "hello",
    ATTACH: "attach",
    RESET: "reset",
    STEP: "step",
    CALL: "call",
    SETATTR: "setattr",
    CLOSE: "close",
    FORK: "fork",
    REBIND: "rebind",
}

# Calls that must go through their own method, as AsyncVectorEnv refuses them too.
RESERVED_CALLS = ("reset", "step", "close", "_setattr", "_check_spaces")

# Bounds on the text of an error record (a sandbox's exception text is not trusted).
MAX_ERROR_TEXT = 64 * 1024
MAX_BASES = 32


def error_record(index: int, exc: BaseException) -> dict[str, Any]:
    """What a worker reports when sub-env ``index`` raised ``exc`` (inside ``except``):
    its type name, message and traceback as text, and the exception pickled for a
    controller that trusts its sandboxes (it is never unpickled otherwise)."""
    try:
        pickled = cloudpickle.dumps(exc)
    except Exception:
        pickled = None
    return {
        "index": index,
        "type": type(exc).__qualname__,
        # Its bases' names, nearest first: a controller that does not unpickle rebuilds
        # the nearest one it knows (``except ValueError`` still works).
        "bases": [t.__qualname__ for t in type(exc).__mro__[1:-1]][:MAX_BASES],
        "message": str(exc)[:MAX_ERROR_TEXT],
        "traceback": traceback.format_exc()[-MAX_ERROR_TEXT:],
        "pickled": pickled,
    }
