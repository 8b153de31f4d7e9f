"""msgpack encoding of the values that cross a ring: headers, infos, call results.

msgpack carries dicts, lists, str, bytes, ints, floats, bools and None natively. Types
it would silently change are tagged with ext types so that a value decodes to what was
encoded: tuples stay tuples, Graph values stay GraphInstances, numpy arrays and scalars
keep dtype and shape (their bytes travel raw, not element by element). Anything else
falls back to cloudpickle (which an untrusted peer's reader refuses); a value that cannot
be pickled either raises :class:`EncodeError` naming its type.
"""

from __future__ import annotations

import struct
from typing import Any

import cloudpickle
import msgpack
import numpy as np
from gymnasium.spaces import GraphInstance

from gym_fork.errors import EncodeError

EXT_NDARRAY = 1
EXT_TUPLE = 2
EXT_NPSCALAR = 3
EXT_PICKLE = 4
EXT_GRAPH = 5

_META = struct.Struct("<I")


def _default(obj: Any) -> msgpack.ExtType:
    if type(obj) is tuple:
        return msgpack.ExtType(EXT_TUPLE, pack(list(obj)))
    if type(obj) is GraphInstance:  # a Graph space's value: plain arrays, no pickle
        return msgpack.ExtType(EXT_GRAPH, pack([obj.nodes, obj.edges, obj.edge_links]))
    if isinstance(obj, np.ndarray) and obj.dtype.hasobject is False:
        meta = msgpack.packb((obj.dtype.str, obj.shape))
        data = np.ascontiguousarray(obj).tobytes()
        return msgpack.ExtType(EXT_NDARRAY, _META.pack(len(meta)) + meta + data)
    if isinstance(obj, np.generic) and obj.dtype.hasobject is False:
        return msgpack.ExtType(EXT_NPSCALAR, obj.dtype.str.encode() + b"\0" + obj.tobytes())
    try:
        return msgpack.ExtType(EXT_PICKLE, cloudpickle.dumps(obj))
    except Exception as exc:
        raise EncodeError(
            f"cannot send a value of type {type(obj).__qualname__} across the ring: "
            f"msgpack does not carry it and pickling failed ({exc})"
        ) from exc


def _ext_hook(code: int, data: bytes) -> Any:
    if code == EXT_TUPLE:
        return tuple(unpack(data))
    if code == EXT_GRAPH:
        return GraphInstance(*unpack(data, allow_pickle=False))
    if code == EXT_NDARRAY:
        (meta_len,) = _META.unpack_from(data)
        dtype, shape = msgpack.unpackb(data[4 : 4 + meta_len])
        raw = data[4 + meta_len :]
        return np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape).copy()
    if code == EXT_NPSCALAR:
        dtype, _, raw = data.partition(b"\0")
        return np.frombuffer(raw, dtype=np.dtype(dtype.decode()))[0]
    if code == EXT_PICKLE:
        return cloudpickle.loads(data)
    return msgpack.ExtType(code, data)


class RefusedPickle:
    """What a pickled value decodes to where pickles are not loaded."""

    __slots__ = ("nbytes",)

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes

    def __repr__(self) -> str:
        return f"<refused pickle of {self.nbytes} bytes>"


def _no_pickle_hook(refused: list[int]):
    def hook(code: int, data: bytes) -> Any:
        if code == EXT_PICKLE:
            refused.append(len(data))
            return RefusedPickle(len(data))
        if code == EXT_TUPLE:
            return tuple(unpack(data, allow_pickle=False, refused=refused))
        return _ext_hook(code, data)

    return hook


# Hot-path records with a fixed shape, encoded without a msgpack call: a request with no
# argument, [op, seq, None], and a reply with nothing to say, [op, seq, [None, None], None]
# (a step whose results are all in the slab). ``seq`` is a uint64 (0xcf), which every
# msgpack reader decodes to the same int as its shortest form.
_BARE_REQUEST = struct.Struct(">BBBQB")
_EMPTY_REPLY = struct.Struct(">BBBQBBBB")


def pack_bare_request(op: int, seq: int) -> bytes:
    """``pack([op, seq, None])``, faster (0 <= op < 128, 0 <= seq < 2**64)."""
    if not (0 <= op < 128 and 0 <= seq < 1 << 64):
        return pack([op, seq, None])
    return _BARE_REQUEST.pack(0x93, op, 0xCF, seq, 0xC0)


def pack_empty_reply(op: int, seq: int) -> bytes:
    """``pack([op, seq, [None, None], None])``, faster (same bounds)."""
    if not (0 <= op < 128 and 0 <= seq < 1 << 64):
        return pack([op, seq, [None, None], None])
    return _EMPTY_REPLY.pack(0x94, op, 0xCF, seq, 0x92, 0xC0, 0xC0, 0xC0)


def pack(value: Any) -> bytes:
    """Encode ``value`` (see the module docstring for what survives exactly)."""
    return msgpack.packb(value, default=_default, strict_types=True, use_bin_type=True)


def unpack(data, *, allow_pickle: bool = True, refused: list[int] | None = None) -> Any:
    """Decode bytes produced by :func:`pack`. With ``allow_pickle=False`` a pickled
    value is not loaded: it decodes to a :class:`RefusedPickle` and its size is
    appended to ``refused``, for the caller to refuse the record."""
    hook = _ext_hook if allow_pickle else _no_pickle_hook([] if refused is None else refused)
    return msgpack.unpackb(data, ext_hook=hook, raw=False, strict_map_key=False)
