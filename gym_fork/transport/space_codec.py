"""Gymnasium spaces as plain data (dicts of numbers, strings and arrays), so that a
controller can learn a sandbox's spaces without unpickling anything it sent.

One encoder and one decoder per space type (``functools.singledispatch``): a custom
space registers its own pair with :func:`register_space`. A space without one travels
pickled, which only a controller that trusts its sandboxes accepts.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import cloudpickle
import numpy as np
from gymnasium import Space, spaces

PICKLED = "pickled"

_DECODERS: dict[str, Callable[[dict[str, Any]], Space]] = {}


class SpaceRefused(ValueError):
    """A sandbox sent a space this controller will not decode (pickled, untrusted)."""


@functools.singledispatch
def space_to_data(space: Space) -> dict[str, Any]:
    """Plain data for ``space`` (a pickle for types without a registered encoder)."""
    return {"kind": PICKLED, "bytes": cloudpickle.dumps(space)}


def space_from_data(data: Any, *, trusted: bool) -> Space:
    """The space ``data`` describes; a pickled one only when ``trusted``."""
    if not isinstance(data, dict) or not isinstance(data.get("kind"), str):
        raise SpaceRefused(f"not an encoded space: {data!r:.100}")
    kind = data["kind"]
    if kind == PICKLED:
        if not trusted:
            raise SpaceRefused(
                "a sandbox sent a pickled space (a type without a plain encoding); an "
                "untrusted sandbox's pickles are not loaded. Register the space type with "
                "gym_fork.transport.space_codec.register_space, or pass trusted=True."
            )
        return cloudpickle.loads(data["bytes"])
    decoder = _DECODERS.get(kind)
    if decoder is None:
        raise SpaceRefused(f"unknown space kind {kind!r:.50}")
    try:
        return decoder(data, trusted)
    except SpaceRefused:
        raise
    except Exception as exc:
        raise SpaceRefused(f"a {kind} space that does not decode: {exc}") from exc


def register_space(
    space_type: type,
    kind: str,
    encode: Callable[[Any], dict[str, Any]],
    decode: Callable[[dict[str, Any], bool], Space],
) -> None:
    """Teach the codec a space type: ``encode(space)`` gives plain data (without
    ``kind``), ``decode(data, trusted)`` rebuilds the space."""

    def encoder(space: Any) -> dict[str, Any]:
        return {"kind": kind, **encode(space)}

    space_to_data.register(space_type)(encoder)
    _DECODERS[kind] = decode


register_space(
    spaces.Box,
    "box",
    lambda s: {"low": s.low, "high": s.high, "dtype": s.dtype.str},
    lambda d, _t: spaces.Box(
        np.asarray(d["low"]), np.asarray(d["high"]), dtype=np.dtype(_plain_dtype(d["dtype"]))
    ),
)
register_space(
    spaces.Discrete,
    "discrete",
    lambda s: {"n": int(s.n), "start": int(s.start), "dtype": s.dtype.str},
    lambda d, _t: spaces.Discrete(
        int(d["n"]), start=int(d["start"]), dtype=np.dtype(_plain_dtype(d["dtype"]))
    ),
)
register_space(
    spaces.MultiDiscrete,
    "multidiscrete",
    lambda s: {"nvec": s.nvec, "start": s.start, "dtype": s.dtype.str},
    lambda d, _t: spaces.MultiDiscrete(
        np.asarray(d["nvec"]),
        dtype=np.dtype(_plain_dtype(d["dtype"])),
        start=np.asarray(d["start"]),
    ),
)
register_space(
    spaces.MultiBinary,
    "multibinary",
    lambda s: {"n": s.n if isinstance(s.n, int) else list(s.n)},
    lambda d, _t: spaces.MultiBinary(d["n"] if isinstance(d["n"], int) else list(d["n"])),
)
register_space(
    spaces.Text,
    "text",
    lambda s: {"max": s.max_length, "min": s.min_length, "charset": "".join(s.character_set)},
    lambda d, _t: spaces.Text(int(d["max"]), min_length=int(d["min"]), charset=str(d["charset"])),
)
register_space(
    spaces.Dict,
    "dict",
    lambda s: {"keys": list(s.spaces), "spaces": [space_to_data(c) for c in s.spaces.values()]},
    lambda d, t: spaces.Dict(
        {str(k): space_from_data(c, trusted=t) for k, c in zip(d["keys"], d["spaces"], strict=True)}
    ),
)
register_space(
    spaces.Tuple,
    "tuple",
    lambda s: {"spaces": [space_to_data(c) for c in s.spaces]},
    lambda d, t: spaces.Tuple([space_from_data(c, trusted=t) for c in d["spaces"]]),
)
register_space(
    spaces.OneOf,
    "oneof",
    lambda s: {"spaces": [space_to_data(c) for c in s.spaces]},
    lambda d, t: spaces.OneOf([space_from_data(c, trusted=t) for c in d["spaces"]]),
)
register_space(
    spaces.Sequence,
    "sequence",
    lambda s: {"feature": space_to_data(s.feature_space), "stack": bool(s.stack)},
    lambda d, t: spaces.Sequence(space_from_data(d["feature"], trusted=t), stack=d["stack"]),
)
register_space(
    spaces.Graph,
    "graph",
    lambda s: {
        "node": space_to_data(s.node_space),
        "edge": None if s.edge_space is None else space_to_data(s.edge_space),
    },
    lambda d, t: spaces.Graph(
        space_from_data(d["node"], trusted=t),
        None if d["edge"] is None else space_from_data(d["edge"], trusted=t),
    ),
)


def _plain_dtype(value: Any) -> str:
    """A dtype string that names a plain numeric or bool type (never ``object``)."""
    dtype = np.dtype(str(value))
    if dtype.kind not in "biuf":
        raise SpaceRefused(f"dtype {dtype} is not a plain number type")
    return dtype.str


def _is_plain(value: Any) -> bool:
    if value is None or type(value) in (bool, int, float, str, bytes):
        return True
    if type(value) in (list, tuple):
        return all(_is_plain(v) for v in value)
    if type(value) is dict:
        return all(type(k) is str and _is_plain(v) for k, v in value.items())
    if isinstance(value, np.ndarray | np.generic):
        return not value.dtype.hasobject
    return False


def mapping_to_data(mapping: dict[str, Any]) -> dict[str, Any]:
    """``mapping`` (an env's metadata) with every value that is not plain data pickled
    under a marker, so that the rest decodes without unpickling."""
    return {
        str(k): v if _is_plain(v) else {"kind": PICKLED, "bytes": cloudpickle.dumps(v)}
        for k, v in mapping.items()
    }


def mapping_from_data(data: Any, *, trusted: bool) -> dict[str, Any]:
    """The mapping back; a pickled value is loaded only when ``trusted`` (else its
    place holds a note saying it was refused)."""
    if not isinstance(data, dict):
        raise SpaceRefused(f"not an encoded mapping: {data!r:.100}")
    out = {}
    for key, value in data.items():
        if isinstance(value, dict) and value.get("kind") == PICKLED and "bytes" in value:
            out[key] = (
                cloudpickle.loads(value["bytes"])
                if trusted
                else "<refused: a pickled value from an untrusted sandbox>"
            )
        else:
            out[key] = value
    return out
