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
    points = np.frombuffer(value.encode("utf-32-le", "surrogatepass"), np.uint32)
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
    return chars[codes].tobytes().decode("utf-32-le", "surrogatepass")


def has_text(space: spaces.Space) -> bool:
    """Whether ``space`` is a Text space or holds one (in a Dict, Tuple, OneOf or
    Sequence)."""
    if isinstance(space, spaces.Text):
        return True
    if isinstance(space, spaces.Dict):
        return any(has_text(child) for child in space.spaces.values())
    if isinstance(space, spaces.Tuple | spaces.OneOf):
        return any(has_text(child) for child in space.spaces)
    if isinstance(space, spaces.Sequence):
        return has_text(space.feature_space)
    return False


def misfit(space: spaces.Space, value: Any) -> str | None:
    """What is wrong with the Text parts of ``value`` for ``space``, or None: each must be
    a str of at most ``max_length`` characters of its charset, what a slab row holds.
    Other leaves are not looked at (as AsyncVectorEnv looks at none); nor is
    ``min_length`` (as a Box's bounds are not). For the values of untrusted sandboxes."""
    if isinstance(space, spaces.Text):
        if not isinstance(value, str):
            return f"expected a str, got {type(value).__name__}"
        if len(value) > space.max_length:
            return f"a str of {len(value)} characters (at most {space.max_length})"
        if value and not space.character_set.issuperset(value):
            bad = next(c for c in value if c not in space.character_set)
            return f"the character {bad!a} is not in its charset"
        return None
    if isinstance(space, spaces.Dict):
        if not isinstance(value, Mapping):
            return f"expected a dict, got {type(value).__name__}"
        children = [(repr(k), child, value.get(k, _MISSING)) for k, child in space.spaces.items()]
    elif isinstance(space, spaces.OneOf):
        index = value[0] if isinstance(value, tuple | list) and len(value) == 2 else None
        if not isinstance(index, int | np.integer) or isinstance(index, bool):
            return "expected (index, value)"
        if not 0 <= index < len(space.spaces):
            return f"no subspace {index}"
        children = [(str(index), space.spaces[int(index)], value[1])]
    elif isinstance(space, spaces.Tuple | spaces.Sequence):
        items = value.tolist() if isinstance(value, np.ndarray) and value.dtype == object else value
        if not isinstance(items, tuple | list):
            if isinstance(space, spaces.Sequence) and space.stack:
                return None  # a stacked batch of the feature's leaves: not looked at
            return f"expected a tuple, got {type(value).__name__}"
        if isinstance(space, spaces.Sequence):
            feature = space.feature_space
            if space.stack and not isinstance(feature, spaces.Text):
                return None  # each field stacked: a batch, not one value each
            kids = [feature] * len(items)
        else:
            kids = list(space.spaces)
        if len(kids) != len(items):
            return f"expected {len(kids)} entries, got {len(items)}"
        children = [
            (str(k), child, item) for k, (child, item) in enumerate(zip(kids, items, strict=True))
        ]
    else:
        return None
    for name, child, item in children:
        found = f"no entry {name}" if item is _MISSING else misfit(child, item)
        if found:
            return f"[{name}]: {found}"
    return None


_MISSING = object()
