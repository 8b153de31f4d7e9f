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


def test_a_lone_surrogate_of_the_charset_goes_both_ways():
    space = spaces.Text(8, min_length=0, charset="ab\ud800")
    codes = text_codes.encode(space, "a\ud800b")
    assert codes.tolist() == _per_character(space, "a\ud800b")
    assert text_codes.decode(space, codes) == "a\ud800b"


T = spaces.Text(4, min_length=0, charset="abc")
HONEST = [
    (T, "abc"),
    (spaces.Dict({"t": T, "n": spaces.Discrete(3)}), {"t": "ab", "n": 2}),
    (spaces.Tuple([T, spaces.Discrete(2)]), ("c", 1)),
    (spaces.Tuple([T, spaces.Discrete(2)]), np.array(["c", 1], dtype=object)),
    (spaces.Tuple([T, spaces.Discrete(2)]), ["c", 1]),  # a tuple as the ring brings it
    (spaces.Sequence(T), ("a", "bb", "")),
    (spaces.Sequence(T, stack=True), ("a", "bb")),
    (spaces.Sequence(spaces.Tuple([T, spaces.Discrete(2)]), stack=True), (("a", "b"), [0, 1])),
    (spaces.OneOf([spaces.Discrete(2), T]), (1, "cab")),
    (spaces.OneOf([spaces.Discrete(2), T]), [np.int64(1), "cab"]),
]


@pytest.mark.parametrize(("space", "value"), HONEST)
def test_what_the_space_holds_fits(space, value):
    assert text_codes.has_text(space)
    assert text_codes.misfit(space, value) is None


@pytest.mark.parametrize(
    ("space", "value", "problem"),
    [
        (T, "abcd" + "a", "5 characters"),
        (T, b"ab", "expected a str"),
        (T, "abz", "'z' is not in its charset"),
        (spaces.Dict({"t": T}), {"u": "a"}, "no entry 't'"),
        (spaces.Dict({"t": T}), {"t": 5}, "['t']: expected a str"),
        (spaces.Tuple([T, T]), ("a",), "expected 2 entries"),
        (spaces.Sequence(T), "zzz", "expected a tuple"),
        (spaces.Sequence(T), ("a", "z"), "[1]: the character 'z'"),
        (spaces.Sequence(T, stack=True), ("a", "z"), "[1]: the character 'z'"),
        (spaces.OneOf([spaces.Discrete(2), T]), (1, "zz"), "[1]: the character 'z'"),
        (spaces.OneOf([spaces.Discrete(2), T]), (5, "a"), "no subspace 5"),
        (spaces.OneOf([spaces.Discrete(2), T]), "a", "expected (index, value)"),
    ],
)
def test_what_does_not_fit_is_named(space, value, problem):
    assert problem in (text_codes.misfit(space, value) or "")
