"""A Text space's characters as the int32 codes its slab rows hold, both ways, in numpy.

A row of a Text leaf (``layout.py``) holds each character's index in the space's
``character_list``, then padding (the charset's length). Per character in Python, a
1,024-character row took ~90 us to read (every padded entry visited) and as long to
write: per sub-env and step of a Text env, and per branch of a fork. Here a row is
read with one mask and one lookup (the codes kept are those of a character: what a
sandbox wrote is not trusted, and anything else in its row is not text), and a str is
written from its code points through a lookup table. Charsets whose characters are
not single code points, or reach past :data:`MAX_TABLE`, fall back to the per-character
way.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import numpy as np
from gymnasium import spaces

MAX_TABLE = 1 << 17  # code points a lookup table covers (512 KiB of int32 at most)


@functools.lru_cache(maxsize=64)
def _tables(characters: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray] | None:
    """(the characters as a '<U1' array, code point -> index or -1), or None where a
    table does not fit them."""
    if not characters or any(len(c) != 1 for c in characters):
        return None
    top = max(ord(c) for c in characters)
    if top >= MAX_TABLE:
        return None
    index_of = np.full(top + 2, -1, np.int32)  # the last entry: any code point past top
    index_of[[ord(c) for c in characters]] = np.arange(len(characters), dtype=np.int32)
    return np.array(characters, dtype="<U1"), index_of


def encode(space: spaces.Text, value: str) -> np.ndarray:
    """The codes of ``value``'s characters (int32); a character outside the charset
    raises what ``space.character_index`` raises for it."""
    tables = _tables(tuple(space.character_list))
    if tables is None:
        return np.array([space.character_index(c) for c in value], np.int32)
    _chars, index_of = tables
    points = np.frombuffer(value.encode("utf-32-le"), np.uint32)
    codes = index_of[np.minimum(points, len(index_of) - 1)]
    if codes.size and codes.min() < 0:
        bad = value[int(np.argmax(codes < 0))]
        space.character_index(bad)  # its own error
        raise KeyError(bad)  # a charset that says otherwise: not a character of it
    return codes


def decode(space: spaces.Text, row: np.ndarray) -> str:
    """The text of a row of codes: each code of a character, in order (padding, and
    anything else a sandbox may have written, is no character)."""
    characters = space.character_list
    tables = _tables(tuple(characters))
    count = len(characters)
    if tables is None:
        return "".join(characters[c] for c in row.tolist() if 0 <= c < count)
    chars, _index_of = tables
    # One read of the row: a sandbox may rewrite it meanwhile, and a code read again
    # after the mask was taken could index past the charset.
    row = np.array(row, np.int32)
    codes = row[(row >= 0) & (row < count)]
    return chars[codes].tobytes().decode("utf-32-le")


def has_text(space: spaces.Space) -> bool:
    """Whether ``space`` is a Text space or holds one (in a Dict, Tuple or Sequence)."""
    if isinstance(space, spaces.Text):
        return True
    if isinstance(space, spaces.Dict):
        return any(has_text(child) for child in space.spaces.values())
    if isinstance(space, spaces.Tuple):
        return any(has_text(child) for child in space.spaces)
    if isinstance(space, spaces.Sequence):
        return has_text(space.feature_space)
    return False


def misfit(space: spaces.Space, value: Any) -> str | None:
    """What is wrong with the Text parts of ``value`` for ``space``, or None: each must be
    a str of at most ``max_length`` characters of its charset, what a slab row holds.
    Other leaves are not looked at (as AsyncVectorEnv looks at none); nor is
    ``min_length`` (as a Box's bounds are not)."""
    if isinstance(space, spaces.Text):
        if not isinstance(value, str):
            return f"expected a str, got {type(value).__name__}"
        if len(value) > space.max_length:
            return f"a str of {len(value)} characters (at most {space.max_length})"
        try:
            encode(space, value)
        except (KeyError, ValueError) as exc:
            bad = exc.args[0] if exc.args and isinstance(exc.args[0], str) else "?"
            return f"the character {ascii(bad)[:16]} is not in its charset"
        return None
    if isinstance(space, spaces.Dict):
        if not isinstance(value, Mapping):
            return f"expected a dict, got {type(value).__name__}"
        for key, child in space.spaces.items():
            if key not in value:
                return f"no key {key!r}"
            found = misfit(child, value[key])
            if found:
                return f"[{key!r}]: {found}"
        return None
    if isinstance(space, spaces.Tuple | spaces.Sequence):
        if not isinstance(value, tuple | list):
            return None if isinstance(space, spaces.Sequence) else "expected a tuple"
        children = (
            space.spaces if isinstance(space, spaces.Tuple) else [space.feature_space] * len(value)
        )
        if len(children) != len(value):
            return f"expected {len(children)} entries, got {len(value)}"
        for k, (child, item) in enumerate(zip(children, value, strict=True)):
            found = misfit(child, item)
            if found:
                return f"[{k}]: {found}"
    return None
