"""The slab layout of every space type: fixed-size leaves and their trees.

Each fixed-size leaf of a space (Box, Discrete, MultiDiscrete, MultiBinary, Text) is an
``(rows, *shape)`` array bound at an aligned offset of a shared region; Dict and Tuple
spaces are trees of leaves. Spaces with variable-size values (Graph, Sequence, OneOf)
have no layout (``slab_node`` returns None): their values travel in ring records. One
layout function per space type (``slab_node``, a ``functools.singledispatch``): a custom
space registers its own. The slabs built on these layouts are ``slab.py``'s.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
from gymnasium import spaces

from gym_fork.transport import text_codes

ALIGN = 64


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class ArrayLeaf:
    """A Box/Discrete/MultiDiscrete/MultiBinary leaf: one ``(n, *shape)`` array.

    ``array`` is None until :meth:`bind` (a batch layout is never bound) and after the
    slab is closed; a leaf is read and written only while bound."""

    def __init__(self, space: spaces.Space, n: int) -> None:
        if space.shape is None:
            raise TypeError(f"{space} has no fixed shape: it has no array layout")
        self.space = space
        self.shape = tuple(space.shape)
        self.dtype = np.dtype(space.dtype)
        self.nbytes = n * int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
        self.n = n
        self.array: np.ndarray | None = None

    def bind(self, buffer, offset: int) -> int:
        self.array = np.ndarray((self.n, *self.shape), self.dtype, buffer=buffer, offset=offset)
        return offset + align(self.nbytes)

    def write(self, index: int, value: Any) -> None:
        value = np.asarray(value)
        if value.shape != self.shape:
            raise ValueError(f"expected shape {self.shape} for {self.space}, got {value.shape}")
        assert self.array is not None  # bound
        self.array[index] = value

    def read(self, index: int) -> Any:
        assert self.array is not None  # bound
        row = self.array[index]
        return row.copy() if self.shape else row

    def accepts(self, values: Any) -> bool:
        """True if ``values`` is already a batch of exactly this dtype and shape."""
        return (
            type(values) is np.ndarray
            and values.shape == (self.n, *self.shape)
            and values.dtype == self.dtype
        )

    def gather(self, parts: list[ArrayLeaf], out: np.ndarray | None) -> np.ndarray:
        """The rows of ``parts`` (same-space leaves) as one batch (into ``out``)."""
        arrays = bound_arrays(parts)
        if len(arrays) == 1 and out is None:
            return arrays[0].copy()
        return np.concatenate(arrays, out=out)

    def scatter(self, parts: list[ArrayLeaf], values: Any, bounds: list[int]) -> None:
        """Write batch ``values`` over ``parts``: rows bounds[k]:bounds[k+1] to part k."""
        values = np.asarray(values)
        for array, start, end in zip(bound_arrays(parts), bounds, bounds[1:], strict=False):
            np.copyto(array, values[start:end], casting="unsafe")


def bound_arrays(parts: Sequence[ArrayLeaf]) -> list[np.ndarray]:
    """The arrays of bound leaves (the slabs' own, never a batch layout)."""
    arrays = [p.array for p in parts if p.array is not None]
    if len(arrays) != len(parts):
        raise ValueError("a slab leaf is not mapped (its slab is closed)")
    return arrays


class _TextLeaf:
    """A Text leaf: ``(n, max_length)`` int32 charset indices, padded with charset_length."""

    def __init__(self, space: spaces.Text, n: int) -> None:
        self.space = space
        self.n = n
        self.nbytes = n * space.max_length * 4
        self.array: np.ndarray | None = None

    def bind(self, buffer, offset: int) -> int:
        shape = (self.n, self.space.max_length)
        self.array = np.ndarray(shape, np.int32, buffer=buffer, offset=offset)
        return offset + align(self.nbytes)

    def write(self, index: int, value: str) -> None:
        if not isinstance(value, str) or len(value) > self.space.max_length:
            raise ValueError(f"expected a str of at most {self.space.max_length} characters")
        pad = len(self.space.character_list)
        codes = text_codes.encode(self.space, value)
        assert self.array is not None  # bound
        self.array[index, : len(codes)] = codes
        self.array[index, len(codes) :] = pad

    def read(self, index: int) -> str:
        assert self.array is not None  # bound
        return text_codes.decode(self.space, self.array[index])

    def batch(self) -> tuple[str, ...]:
        return tuple(self.read(i) for i in range(self.n))

    def accepts(self, values: Any) -> bool:
        return False

    def gather(self, parts: list[_TextLeaf], out: Any) -> tuple[str, ...]:
        return tuple(text for p in parts for text in p.batch())

    def scatter(self, parts: list[_TextLeaf], values: Any, bounds: list[int]) -> None:
        values = tuple(values)
        for part, start, end in zip(parts, bounds, bounds[1:], strict=False):
            for row, value in enumerate(values[start:end]):
                part.write(row, value)


class _DictNode:
    def __init__(self, space: spaces.Dict, children: dict[str, Any]) -> None:
        self.space = space
        self.children = children

    def bind(self, buffer, offset: int) -> int:
        for child in self.children.values():
            offset = child.bind(buffer, offset)
        return offset

    @property
    def nbytes(self) -> int:
        return sum(align(c.nbytes) for c in self.children.values())

    def write(self, index: int, value: Any) -> None:
        if set(value.keys()) != set(self.children):
            raise ValueError(f"expected keys {sorted(self.children)}, got {sorted(value.keys())}")
        for key, child in self.children.items():
            child.write(index, value[key])

    def accepts(self, values: Any) -> bool:
        return (
            type(values) is dict
            and values.keys() == self.children.keys()
            and all(c.accepts(values[k]) for k, c in self.children.items())
        )

    def read(self, index: int) -> dict[str, Any]:
        return {key: child.read(index) for key, child in self.children.items()}

    def gather(self, parts: list[_DictNode], out: Any) -> dict[str, Any]:
        return {
            key: child.gather([p.children[key] for p in parts], None if out is None else out[key])
            for key, child in self.children.items()
        }

    def scatter(self, parts: list[_DictNode], values: Any, bounds: list[int]) -> None:
        for key, child in self.children.items():
            child.scatter([p.children[key] for p in parts], values[key], bounds)


class _TupleNode:
    def __init__(self, space: spaces.Tuple, children: list[Any]) -> None:
        self.space = space
        self.children = children

    def bind(self, buffer, offset: int) -> int:
        for child in self.children:
            offset = child.bind(buffer, offset)
        return offset

    @property
    def nbytes(self) -> int:
        return sum(align(c.nbytes) for c in self.children)

    def write(self, index: int, value: Any) -> None:
        if len(value) != len(self.children):
            raise ValueError(f"expected a tuple of {len(self.children)}, got {len(value)}")
        for child, item in zip(self.children, value, strict=True):
            child.write(index, item)

    def accepts(self, values: Any) -> bool:
        return (
            type(values) is tuple
            and len(values) == len(self.children)
            and all(c.accepts(v) for c, v in zip(self.children, values, strict=True))
        )

    def read(self, index: int) -> tuple[Any, ...]:
        return tuple(child.read(index) for child in self.children)

    def gather(self, parts: list[_TupleNode], out: Any) -> tuple[Any, ...]:
        return tuple(
            child.gather([p.children[k] for p in parts], None if out is None else out[k])
            for k, child in enumerate(self.children)
        )

    def scatter(self, parts: list[_TupleNode], values: Any, bounds: list[int]) -> None:
        for k, child in enumerate(self.children):
            child.scatter([p.children[k] for p in parts], values[k], bounds)


def leaf_values(node, values: Any) -> list[tuple[Any, Any]]:
    """(leaf, the part of the batch ``values`` that belongs to it) for every leaf."""
    if isinstance(node, _DictNode):
        return [pair for k, c in node.children.items() for pair in leaf_values(c, values[k])]
    if isinstance(node, _TupleNode):
        return [
            pair for c, v in zip(node.children, values, strict=True) for pair in leaf_values(c, v)
        ]
    return [(node, values)]


def leaves(node) -> list:
    """The leaves of a slab layout tree (each has ``.space`` and ``.array``)."""
    if node is None:
        return []
    if isinstance(node, _DictNode):
        return [leaf for child in node.children.values() for leaf in leaves(child)]
    if isinstance(node, _TupleNode):
        return [leaf for child in node.children for leaf in leaves(child)]
    return [node]


@functools.singledispatch
def async_shares(space: spaces.Space) -> bool:
    """True if AsyncVectorEnv(shared_memory=True) accepts ``space`` (Gymnasium 1.x rules)."""
    return False


@async_shares.register(spaces.Box)
@async_shares.register(spaces.Discrete)
@async_shares.register(spaces.MultiDiscrete)
@async_shares.register(spaces.MultiBinary)
@async_shares.register(spaces.Text)
def _(space: spaces.Space) -> bool:
    return True


@async_shares.register
def _(space: spaces.Dict) -> bool:
    return all(async_shares(s) for s in space.spaces.values())


@async_shares.register(spaces.Tuple)
@async_shares.register(spaces.OneOf)
def _(space: spaces.Tuple | spaces.OneOf) -> bool:
    return all(async_shares(s) for s in space.spaces)


@functools.singledispatch
def slab_node(space: spaces.Space, n: int):
    """The slab layout tree of ``space`` batched ``n`` times, or None if it has none.

    Register a layout for a custom space with ``@slab_node.register(MySpace)``
    returning an object with the leaf interface (see ``ArrayLeaf``)."""
    return None


@slab_node.register(spaces.Box)
@slab_node.register(spaces.Discrete)
@slab_node.register(spaces.MultiDiscrete)
@slab_node.register(spaces.MultiBinary)
def _(space: spaces.Space, n: int):
    return ArrayLeaf(space, n)


@slab_node.register
def _(space: spaces.Text, n: int):
    return _TextLeaf(space, n)


@slab_node.register
def _(space: spaces.Dict, n: int):
    children = {k: slab_node(s, n) for k, s in space.spaces.items()}
    return None if any(c is None for c in children.values()) else _DictNode(space, children)


@slab_node.register
def _(space: spaces.Tuple, n: int):
    items = [slab_node(s, n) for s in space.spaces]
    return None if any(c is None for c in items) else _TupleNode(space, items)


def unbind(node) -> None:
    if node is None:
        return
    if isinstance(node, _DictNode):
        for child in node.children.values():
            unbind(child)
    elif isinstance(node, _TupleNode):
        for child in node.children:
            unbind(child)
    else:
        node.array = None
