"""msgpack encoding of the values that cross a ring: headers, infos, call results.

msgpack carries dicts, lists, str, bytes, ints, floats, bools and None natively. Types
it would silently change are tagged with ext types so that a value decodes to what was
encoded: tuples stay tuples, Graph values stay GraphInstances, numpy arrays and scalars
keep dtype and shape (their bytes travel raw, not element by element). Anything else
falls back to cloudpickle (which an untrusted peer's reader refuses); a value that cannot
be pickled either raises :class:`EncodeError` naming its type.

What a sandbox sends is decoded with a bound on the values it builds
(``unpack(..., max_objects=MAX_OBJECTS)``): a 1-byte msgpack map becomes a 64-byte dict,
so the wire bound alone let a record grow ~70x in the reader. A record that holds more
than ``MAX_OBJECTS`` values (``$GYM_FORK_MAX_DECODE_OBJECTS``, default 2**20: 60-125 MiB
of Python objects at most, dicts 73, small strs 60, empty numpy arrays 122) raises
:class:`DecodeTooBig` before any of it is built. A str, bytes or numpy array is one value
whatever its size: raw payloads are bounded by the wire bound alone. Records no longer
than the bound in bytes (every step reply) cannot hold more values and skip the check.

Whatever a record's length, decoding it cannot be driven by its content: ext values
(tuples, Graphs, plain-data values) nest at most :data:`MAX_EXT_DEPTH` deep, since each
level is a msgpack call on the C stack, and an untrusted record holds at most
:data:`MAX_CHOSEN_HASH_KEYS` dict keys whose hash its sender can choose, since a dict of
n colliding keys takes n**2 time under the GIL. Both raise :class:`DecodeTooBig`.

(Over ~450 lines as one job: the encoder and the bounded decoder of one wire format must
be read side by side, each ext type's two halves together.)
"""

from __future__ import annotations

import struct
import warnings
from typing import Any

import cloudpickle
import msgpack
import numpy as np
from gymnasium.spaces import GraphInstance

from gym_fork import knobs
from gym_fork.errors import EncodeError, TransportError
from gym_fork.transport.space_codec import (
    SpaceRefused,
    untrusted_dtype,
    value_from_data,
    value_to_data,
)

EXT_NDARRAY = 1
EXT_TUPLE = 2
EXT_NPSCALAR = 3
EXT_PICKLE = 4
EXT_GRAPH = 5
# A value space_codec carries as plain data (a Space, an EnvSpec, a numpy Generator):
# what get_attr reads most, readable where pickles are not loaded.
EXT_PLAIN = 6

_META = struct.Struct("<I")

MAX_OBJECTS_ENV = "GYM_FORK_MAX_DECODE_OBJECTS"
DEFAULT_MAX_OBJECTS = int(knobs.BY_NAME[MAX_OBJECTS_ENV].default)
# An ndarray's (dtype, shape) header: numpy has at most 64 dimensions.
_META_LIMITS = {"max_array_len": 64, "max_map_len": 0, "max_str_len": 1024, "max_bin_len": 0}


def _max_objects_from_env() -> int:
    raw = (knobs.given(MAX_OBJECTS_ENV) or "").strip()
    if not raw:
        return DEFAULT_MAX_OBJECTS
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        warnings.warn(
            f"{MAX_OBJECTS_ENV}={raw!r} is not a positive int; using {DEFAULT_MAX_OBJECTS}",
            stacklevel=2,
        )
        return DEFAULT_MAX_OBJECTS
    return value


# Read once at import (the controller's readers take it when they are made).
MAX_OBJECTS = _max_objects_from_env()


class DecodeTooBig(TransportError):
    """A record holds more values than its reader's bound (a sandbox's decode bomb);
    nothing of it was built. ``reason`` is ``"too_big"``, as for an oversize message."""

    code = "decode_too_big"

    def __init__(self, message: str, *, worker: str | None = None) -> None:
        super().__init__(message, worker=worker, reason="too_big")


def _too_big(limit: int) -> DecodeTooBig:
    return DecodeTooBig(
        f"a record holds more than the {limit} values one record may decode to (every "
        "list, dict key and value, item and scalar counts; a str, bytes or numpy array "
        "is one value). Send bulk data as numpy arrays or bytes, or set "
        f"${MAX_OBJECTS_ENV} to raise the bound"
    )


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
        plain = value_to_data(obj)
        if plain is not None:
            return msgpack.ExtType(EXT_PLAIN, pack(plain))
        return msgpack.ExtType(EXT_PICKLE, cloudpickle.dumps(obj))
    except Exception as exc:
        raise EncodeError(
            f"cannot send a value of type {type(obj).__qualname__} across the ring: "
            f"msgpack does not carry it and pickling failed ({exc})"
        ) from exc


def _plain_ext(code: int, data: bytes) -> Any:
    """An ext value that holds no other values: an array, a numpy scalar, unknown."""
    if code == EXT_NDARRAY:
        (meta_len,) = _META.unpack_from(data)
        try:
            dtype, shape = msgpack.unpackb(data[4 : 4 + meta_len], **_META_LIMITS)
        except ValueError as exc:
            raise ValueError(f"a malformed ndarray header ({type(exc).__name__})") from None
        raw = data[4 + meta_len :]
        # (the header's own bound keeps the text within 1024 characters)
        return np.frombuffer(raw, dtype=untrusted_dtype(dtype)).reshape(shape).copy()
    if code == EXT_NPSCALAR:
        dtype, _, raw = data.partition(b"\0")
        return np.frombuffer(raw, dtype=untrusted_dtype(dtype[:65].decode(), 64))[0]
    return msgpack.ExtType(code, data)


class RefusedPickle:
    """What a pickled value decodes to where pickles are not loaded."""

    __slots__ = ("nbytes",)

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes

    def __repr__(self) -> str:
        return f"<refused pickle of {self.nbytes} bytes>"


# Dict keys one record from an untrusted sandbox may hold beyond the kinds whose hashes
# it cannot choose (str and bytes hash with a per-process key, ints and floats collide
# only a dozen at a time). Tuples, numpy scalars (complex ones above all), Graph values
# and ext values can be built to share one hash: a dict of n of them takes n**2 time to
# build, under the GIL, deaf to every deadline (8000 tuple keys: 0.7 s; a 0.9 MiB reply of
# complex keys held step() 10-15 s). This many keep a record under ~0.1 s; as values they
# are not limited (a list of 200k tuples is an honest reply).
MAX_CHOSEN_HASH_KEYS = 2048
_FREE_KEYS = frozenset({str, int, bytes, bool, float, type(None)})
# Ext values nested in ext values (a tuple in a tuple in a Graph...). Each level is a
# msgpack call inside the previous one's hook, on the C stack: ~200 of them in a 1 KiB
# reply segfaulted the controller. Plain lists and maps nest in msgpack's own stack,
# which refuses past 1024 levels without recursing.
MAX_EXT_DEPTH = 16
# ext values whose payload is a msgpack record, and those that could be dict keys (an
# array cannot: unhashable; a refused pickle hashes by identity).
_NESTED_EXT = (EXT_TUPLE, EXT_GRAPH, EXT_PLAIN)
_PLAIN_EXT_CODES = (EXT_NDARRAY, EXT_PICKLE)


class _MayBeKey(Exception):
    """More values that could be chosen-hash dict keys than the budget, met in a first
    pass that did not look at keys: decode again from the start, looking."""


class _Nests(Exception):
    """An ext value holding a msgpack record, met by the flat decoder of a trusted peer:
    decode again with a :class:`_Decoder` (which bounds the depth)."""


def _flat_ext(code: int, data: bytes) -> Any:
    """The ext hook of a trusted record's first pass: values that hold no others."""
    if code == EXT_PICKLE:
        return cloudpickle.loads(data)
    if code in _NESTED_EXT:
        raise _Nests
    return _plain_ext(code, data)


def _chosen_keys_error() -> DecodeTooBig:
    return DecodeTooBig(
        f"a record holds more than {MAX_CHOSEN_HASH_KEYS} dict keys that are not str, int, "
        "bytes, float, bool or None (tuples, numpy scalars...), the most one record from an "
        "untrusted sandbox may hold: such keys can be built to share one hash, which makes "
        "decoding take quadratic time. Use str keys, or pass trusted=True to lift it"
    )


class _Decoder:
    """Decodes one record, its ext values nested at most :data:`MAX_EXT_DEPTH` deep.
    From an untrusted sandbox (``refused`` given): pickles refused (their sizes appended
    to ``refused``), chosen-hash dict keys counted.

    Records holding fewer ext values that could be keys than the budget pay nothing for
    the count (even if all of them are keys, they fit): they decode as msgpack builds
    them; one more starts the decode again with every map's keys looked at."""

    __slots__ = ("chosen_keys", "depth", "refused", "watching")

    def __init__(self, refused: list[int] | None) -> None:
        self.refused = refused  # None: a trusted peer (pickles loaded, keys free)
        self.watching = False  # maps go through pairs()
        self.chosen_keys = 0
        self.depth = 0

    def decode(self, data) -> Any:
        refused = self.refused
        if refused is None or self.watching:
            return self._unpackb(data)
        mark = len(refused)
        try:
            return self._unpackb(data)
        except _MayBeKey:
            del refused[mark:]
            self.watching, self.depth, self.chosen_keys = True, 0, 0
        return self._unpackb(data)

    def _unpackb(self, data) -> Any:
        # msgpack builds ext -1 (a Timestamp) itself, past the ext hook, and a Timestamp
        # hashes as a tuple, whose hash can be inverted: 12,000 colliding keys took 9 s.
        # From an untrusted sandbox it is its float seconds (floats collide a dozen at a
        # time); gym_fork's encoder never makes one (a datetime travels pickled).
        stamps = 1 if self.refused is not None else 0
        if self.watching:
            return msgpack.unpackb(
                data,
                ext_hook=self.ext,
                object_pairs_hook=self.pairs,
                raw=False,
                strict_map_key=False,
                timestamp=stamps,
            )
        return msgpack.unpackb(
            data, ext_hook=self.ext, raw=False, strict_map_key=False, timestamp=stamps
        )

    def _nested(self, data: bytes) -> Any:
        if self.depth >= MAX_EXT_DEPTH:
            raise DecodeTooBig(
                f"a record nests tuples or other ext values more than {MAX_EXT_DEPTH} deep, "
                "the most a record from an untrusted sandbox may (each level is a "
                "decoder call on the controller's C stack); nest lists or dicts instead"
            )
        self.depth += 1
        try:
            return self._unpackb(data)
        finally:
            self.depth -= 1

    def pairs(self, pairs: list) -> dict:
        free = _FREE_KEYS
        self.chosen_keys += sum(type(key) not in free for key, _ in pairs)
        if self.chosen_keys > MAX_CHOSEN_HASH_KEYS:
            raise _chosen_keys_error()
        return dict(pairs)

    def ext(self, code: int, data: bytes) -> Any:
        refused = self.refused
        if code == EXT_PICKLE:
            if refused is None:
                return cloudpickle.loads(data)
            refused.append(len(data))
            return RefusedPickle(len(data))
        if refused is not None and not self.watching and code not in _PLAIN_EXT_CODES:
            # Fewer such values than the budget fit it even if every one is a key.
            self.chosen_keys += 1
            if self.chosen_keys > MAX_CHOSEN_HASH_KEYS:
                raise _MayBeKey
        if code == EXT_TUPLE:
            return tuple(self._nested(data))
        if code == EXT_GRAPH:
            return GraphInstance(*self._nested(data))
        if code == EXT_PLAIN:
            if refused is None:
                return value_from_data(self._nested(data), trusted=True)
            try:
                return value_from_data(self._nested(data), trusted=False)
            except SpaceRefused:  # e.g. a space holding a pickled one: refused as a pickle
                refused.append(len(data))
                return RefusedPickle(len(data))
        return _plain_ext(code, data)


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


# -- bounds on what a record from a sandbox decodes to ------------------------------
# The size of a whole value for each first byte of a value of fixed size (0: the others:
# containers, str, bin, ext).
_FIXED = [0] * 256
for _b in (*range(0x00, 0x80), *range(0xE0, 0x100), 0xC0, 0xC2, 0xC3, 0x80, 0x90):
    _FIXED[_b] = 1  # fixint, nil, false, true, {}, []
for _b in range(0xA0, 0xC0):
    _FIXED[_b] = 1 + (_b & 0x1F)  # fixstr
for _b, _size in {0xCA: 5, 0xCB: 9, 0xCC: 2, 0xCD: 3, 0xCE: 5, 0xCF: 9}.items():
    _FIXED[_b] = _size  # float32/64, uint8..64
for _b, _size in {0xD0: 2, 0xD1: 3, 0xD2: 5, 0xD3: 9}.items():
    _FIXED[_b] = _size  # int8..64
# str8/16/32, bin8/16/32, ext8/16/32: the width of their length field.
_LENGTH_WIDTH = {0xD9: 1, 0xDA: 2, 0xDB: 4, 0xC4: 1, 0xC5: 2, 0xC6: 4, 0xC7: 1, 0xC8: 2, 0xC9: 4}
_EXT_VARIABLE = (0xC7, 0xC8, 0xC9)
_FIXEXT = {0xD4: 1, 0xD5: 2, 0xD6: 4, 0xD7: 8, 0xD8: 16}
_UINT = {1: struct.Struct(">B").unpack_from, 2: struct.Struct(">H").unpack_from}
_UINT[4] = struct.Struct(">I").unpack_from
# msgpack's own stack holds 1024 levels; deeper records never decode.
_MAX_DEPTH = 1024


def check_bounds(data, max_objects: int) -> None:
    """Walk a record's structure without building anything: raise :class:`DecodeTooBig`
    if it holds more than ``max_objects`` values (every value counts once: containers,
    their items, dict keys, scalars, ext values and the values inside tuple and Graph
    ext values; a str, bytes or numpy array is one value whatever its size), and
    ``ValueError`` if a container announces more items than bytes are left (msgpack
    would allocate for them before finding out) or the record is cut short.

    Items are counted at their container's header, so a bomb is refused before msgpack
    builds any of it; the walk costs about what decoding a record's scalars costs."""
    if max_objects < 1:
        raise _too_big(max_objects)
    fixed = _FIXED
    end = len(data)
    pos = 0
    total = 1  # the top value
    pending = 1  # values still to read at this level
    # Enclosing levels: (values left there after this one, their end, where to resume:
    # -1 for a container, the end of its payload for a nested ext value).
    stack: list[tuple[int, int, int]] = []
    while True:
        if not pending:
            if not stack:
                if pos != end:
                    raise ValueError(f"a record of {end} bytes holds a value of {pos}")
                return
            pending, end, resume = stack.pop()
            if resume >= 0:
                pos = resume
            continue
        if pos >= end:
            raise ValueError("a record is cut short in the middle of a value")
        b = data[pos]
        size = fixed[b]
        if size:
            pos += size
            pending -= 1
            continue
        if 0x80 <= b <= 0x9F:  # fixmap, fixarray
            head, items = 1, (b & 0x0F) if b >= 0x90 else 2 * (b & 0x0F)
        elif 0xDC <= b <= 0xDF:  # array16/32, map16/32
            head = 3 if b in (0xDC, 0xDE) else 5
            if pos + head > end:
                raise ValueError("a record is cut short in a container's header")
            (n,) = _UINT[head - 1](data, pos + 1)
            items = n if b <= 0xDD else 2 * n
        elif b in _LENGTH_WIDTH or b in _FIXEXT:
            if b in _FIXEXT:
                head, n = 2, _FIXEXT[b]
            else:
                width = _LENGTH_WIDTH[b]
                head = 1 + width + (b in _EXT_VARIABLE)
                if pos + head > end:
                    raise ValueError("a record is cut short in a value's header")
                (n,) = _UINT[width](data, pos + 1)
            payload = pos + head
            pos = payload + n
            pending -= 1
            if (b in _FIXEXT or b in _EXT_VARIABLE) and data[payload - 1] in _NESTED_EXT:
                if pos > end:
                    raise ValueError("a record is cut short in an ext value")
                total += 1  # the value its payload holds
                if total > max_objects:
                    raise _too_big(max_objects)
                if len(stack) >= _MAX_DEPTH:
                    raise ValueError(f"a record nests deeper than {_MAX_DEPTH} levels")
                stack.append((pending, end, pos))
                pending, end, pos = 1, pos, payload
            continue
        else:
            raise ValueError(f"byte 0x{b:02x} does not start a msgpack value")
        pos += head
        if items > end - pos:
            raise ValueError(f"a container announces {items} values with {end - pos} bytes left")
        total += items
        if total > max_objects:
            raise _too_big(max_objects)
        pending -= 1
        if items:
            if len(stack) >= _MAX_DEPTH:
                raise ValueError(f"a record nests deeper than {_MAX_DEPTH} levels")
            stack.append((pending, end, -1))
            pending = items


def unpack(
    data,
    *,
    allow_pickle: bool = True,
    refused: list[int] | None = None,
    max_objects: int | None = None,
) -> Any:
    """Decode bytes produced by :func:`pack`. With ``allow_pickle=False`` a pickled
    value is not loaded: it decodes to a :class:`RefusedPickle` and its size is
    appended to ``refused``, for the caller to refuse the record.

    ``max_objects`` (a reader of a sandbox: :data:`MAX_OBJECTS`) bounds the values the
    record decodes to: :func:`check_bounds` walks it first, unless it is too short to
    hold that many (every value takes at least one byte).

    Untrusted or not, ext values nest at most :data:`MAX_EXT_DEPTH` deep; untrusted,
    at most :data:`MAX_CHOSEN_HASH_KEYS` dict keys may be other than str, int, bytes,
    float, bool or None. A trusted record without tuples or Graphs decodes in one
    msgpack call (its first pass stops at the first ext value that nests)."""
    if max_objects is not None and len(data) > max_objects:
        check_bounds(data, max_objects)
    if not allow_pickle:
        return _Decoder([] if refused is None else refused).decode(data)
    try:  # most records hold no tuple: as fast as msgpack alone
        return msgpack.unpackb(data, ext_hook=_flat_ext, raw=False, strict_map_key=False)
    except _Nests:
        return _Decoder(None).decode(data)
