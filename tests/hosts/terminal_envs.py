"""Envs for tests/hosts/test_terminal_safety.py (importable by reference: env_fns are
pickled): a hostile env that writes terminal escape sequences to its stdout and stderr
and into the strings it sends (exception type names, messages), then crashes or hangs."""

from __future__ import annotations

import os
import sys
import time

import gymnasium as gym
import numpy as np

# Retitle the terminal, erase the line and return to its start (to print a fake one),
# write the clipboard (OSC 52), reverse what follows (bidi override), a C1 CSI.
HOSTILE = "\x1b]0;owned\x07\x1b[2K\rfake prompt$ \x1b]52;c;b3duZWQ=\x07\u202eevil\u202c\x9b1m"
# What the controller must show instead, as repr() shows those characters.
ESCAPED = (
    "\\x1b]0;owned\\x07\\x1b[2K\\rfake prompt$ \\x1b]52;c;b3duZWQ=\\x07\\u202eevil\\u202c\\x9b1m"
)
# What must never reach a terminal raw (the controller's own warnings may be coloured).
RAW_CONTROLS = ("\x1b]", "\x1b[2K", "\r", "\x07", "\u202e", "\x9b")
# What write_split writes, as bytes and as a terminal must show it.
SPLIT_RAW = "<split \u202ex\x1b]0;owned\x07 split>".encode()
SPLIT_ESCAPED = "<split \\u202ex\\x1b]0;owned\\x07 split>"

RAISE, EXIT, HANG, ECHO = 0, 1, 2, 3


def write_hostile() -> None:
    """The hostile text on both streams, each a line of its own."""
    for stream in (sys.stdout, sys.stderr):
        stream.write(HOSTILE + "\n")
        stream.flush()


def write_split() -> None:
    """A bidi override and an ESC each split across two writes (and so, most likely,
    two reads by the controller), between markers."""
    for fd in (1, 2):
        os.write(fd, b"<split " + "\u202e".encode()[:2])
        time.sleep(0.05)
        os.write(fd, "\u202e".encode()[2:] + b"x\x1b")
        time.sleep(0.05)
        os.write(fd, b"]0;owned\x07 split>\n")


def build_hostile() -> HostileTerminalEnv:
    """An env_fn that writes the hostile text as it builds (in the warm parent, under
    from_parent; in the throw-away sandbox of the pre-import otherwise)."""
    write_hostile()
    return HostileTerminalEnv()


class HostileError(ValueError):
    """A ValueError whose name and message carry escape sequences."""


HostileError.__name__ = HostileError.__qualname__ = "Hostile\x1b]0;owned\x07Error"


class HostileTerminalEnv(gym.Env):
    """Writes escape sequences, then does what the action says: raise, exit, hang, or
    (ECHO) also write escapes split across two writes, and go on."""

    observation_space = gym.spaces.Box(0, 1, (1,), np.float32)
    action_space = gym.spaces.Discrete(4)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(1, np.float32), {}

    def step(self, action):
        write_hostile()
        if action == ECHO:
            write_split()
            return np.zeros(1, np.float32), 0.0, False, False, {}
        if action == RAISE:
            raise HostileError(HOSTILE)
        if action == EXIT:
            os._exit(3)
        time.sleep(60)  # HANG: the vector env's timeout kills it
        return np.zeros(1, np.float32), 0.0, False, False, {}
