"""gym_fork/transport/text_codes.py: a Text slab row's codes, both ways, as the
per-character way made them; rows a sandbox wrote are read as text, never as a crash."""

from __future__ import annotations

import numpy as np
import pytest
from gymnasium import spaces

from gym_fork.transport import text_codes

CHARSETS = [
    "abc",  # a table
    " -.0123456789:ABCDEFGHIJKLMNOPQRSTUVWXYZ_abcdefghijklmnopqrstuvwxyz\n",
    "aé€😀",  # a larger table
    "ab\U00020000",  # past MAX_TABLE: the per-character way
]


def test_which_charsets_get_a_table():
    assert [text_codes._tables(tuple(c)) is not None for c in CHARSETS] == [True, True, True, False]


def _per_character(space: spaces.Text, value: str) -> list[int]:
    return [int(space.character_index(c)) for c in value]


@pytest.mark.parametrize("charset", CHARSETS)
def test_codes_are_the_character_indices_and_read_back(charset):
    space = spaces.Text(64, min_length=0, charset=charset, seed=0)
    for _ in range(50):
        value = space.sample()
        codes = text_codes.encode(space, value)
        assert codes.dtype == np.int32 and codes.tolist() == _per_character(space, value)
        row = np.full(64, len(space.character_list), np.int32)  # padded
        row[: len(codes)] = codes
        assert text_codes.decode(space, row) == value
    assert text_codes.encode(space, "").tolist() == []


@pytest.mark.parametrize("charset", CHARSETS)
def test_a_character_outside_the_charset_raises_as_the_space_does(charset):
    space = spaces.Text(8, charset=charset)
    with pytest.raises(KeyError):
        space.character_index("Z" if "Z" not in charset else "#")
    with pytest.raises(KeyError):
        text_codes.encode(space, charset[0] + ("Z" if "Z" not in charset else "#"))


@pytest.mark.parametrize("charset", CHARSETS)
def test_a_row_a_sandbox_filled_with_anything_reads_as_its_characters_only(charset):
    space = spaces.Text(8, charset=charset)
    count = len(space.character_list)
    row = np.array([0, -1, count, 1, -(2**31), 2**31 - 1, count - 1, -count], np.int32)
    chars = space.character_list
    assert text_codes.decode(space, row) == chars[0] + chars[1] + chars[count - 1]
