"""Operation codes shared by the controller and the worker loop.

A request is ``[op, seq, argument]``; a reply is ``[op, seq, result, errors]`` where
``errors`` is None or a list of ``[index, pickled_exception, type_name, message,
traceback]``, one per failing sub-env. ``seq`` lets the controller drop the reply of
a call it stopped waiting for (a timed-out ``step_wait``).
"""

HELLO = 0
ATTACH = 1
RESET = 2
STEP = 3
CALL = 4
SETATTR = 5
CLOSE = 6
PING = 7
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
    PING: "ping",
    FORK: "fork",
    REBIND: "rebind",
}

# Calls that must go through their own method, as AsyncVectorEnv refuses them too.
RESERVED_CALLS = ("reset", "step", "close", "_setattr", "_check_spaces")
