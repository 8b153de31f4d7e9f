"""Gymnasium spaces as plain data (dicts of numbers, strings and arrays), so that a
controller can learn a sandbox's spaces without unpickling anything it sent.

One encoder and one decoder per space type (``functools.singledispatch``): a custom
space registers its own pair with :func:`register_space`. A space without one travels by
reference when it can: its class's module and qualified name, and its attributes as
plain data (numbers, strings, arrays, dtypes, numpy Generators, nested spaces); a
controller rebuilds it from the class it has already imported (it never imports one),
without running ``__init__``. Anything else travels pickled, which only a controller
that trusts its sandboxes accepts (a by-reference space carries its pickle too, and a
trusted controller loads that: exactly what the sandbox had).

:func:`value_to_data` / :func:`value_from_data` carry, for the ring's codec, the
values a Gymnasium user reads with ``get_attr`` that msgpack does not: spaces, an
``EnvSpec`` (as its JSON) and a numpy ``Generator`` (its bit generator's state).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Mapping
from typing import Any

import cloudpickle
import numpy as np
from gymnasium import Space, spaces
from gymnasium.envs.registration import EnvSpec

PICKLED = "pickled"
REFERENCE = "reference"

_DECODERS: dict[str, Callable[[dict[str, Any], bool], Space]] = {}


class SpaceRefused(ValueError):
    """A sandbox sent a space this controller will not decode (pickled, untrusted)."""


@functools.singledispatch
def space_to_data(space: Space) -> dict[str, Any]:
    """Plain data for ``space``: a type without a registered encoder travels by
    reference where its attributes are plain data, else pickled."""
    try:
        pickled = cloudpickle.dumps(space)
    except Exception:
        pickled = None
    reference = _reference_to_data(space)
    if reference is not None:
        return reference if pickled is None else {**reference, "bytes": pickled}
    if pickled is None:
        cloudpickle.dumps(space)  # raise its error
    return {"kind": PICKLED, "bytes": pickled}


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
    if kind == REFERENCE and trusted and isinstance(data.get("bytes"), bytes):
        return cloudpickle.loads(data["bytes"])  # exactly what the sandbox had
    decoder = _reference_from_data if kind == REFERENCE else _DECODERS.get(kind)
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
    # The charset in its own order (a set's order changes with each interpreter's hash
    # seed, and with it what a seeded sample() draws).
    lambda s: {"max": s.max_length, "min": s.min_length, "charset": "".join(s.character_list)},
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


# The longest dtype text read from a sandbox: numpy parses a structured dtype's text
# field by field, under the GIL (a 15 MB "b,b,b,..." took 32 s and 1.7 GB). A plain type
# is a few characters; a structured array's header (codec.py) may take up to 1024.
MAX_DTYPE_TEXT = 1024


def untrusted_dtype(value: Any, limit: int = MAX_DTYPE_TEXT) -> np.dtype:
    """``np.dtype`` of a dtype text a sandbox sent, at most ``limit`` characters; a
    longer one, or a value that is no str, raises ValueError before numpy reads it."""
    if not isinstance(value, str):
        raise ValueError(f"a dtype must be given as text, not as a {type(value).__name__}")
    if len(value) > limit:
        raise ValueError(f"a dtype text of {len(value)} characters (at most {limit})")
    return np.dtype(value)


def _plain_dtype(value: Any) -> str:
    """A dtype string that names a plain numeric or bool type (never ``object``)."""
    dtype = untrusted_dtype(value, 64)
    if dtype.kind not in "biuf":
        raise SpaceRefused(f"dtype {dtype} is not a plain number type")
    return dtype.str


def _is_plain(value: Any) -> bool:
    if type(value) is int:
        return -(1 << 63) <= value < 1 << 64  # what msgpack carries
    if value is None or type(value) in (bool, float, str, bytes):
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


# -- spaces by reference ------------------------------------------------------------
def _reference_to_data(space: Space) -> dict[str, Any] | None:
    """``space`` as its class's name and its attributes as plain data, or None where
    the class has no importable name or an attribute is not plain data."""
    cls = type(space)
    if "<locals>" in cls.__qualname__ or not isinstance(getattr(space, "__dict__", None), dict):
        return None
    state = {}
    for name, value in vars(space).items():
        item = _attribute_to_data(value)
        if type(name) is not str or item is None:
            return None
        state[name] = item
    return {
        "kind": REFERENCE,
        "module": cls.__module__,
        "qualname": cls.__qualname__,
        "state": state,
    }


def _attribute_to_data(value: Any) -> list[Any] | None:
    if _is_plain(value):
        return ["plain", value]
    if isinstance(value, np.dtype) and not value.hasobject:
        return ["dtype", value.str]
    if isinstance(value, np.random.Generator):
        rng = generator_to_data(value)
        return None if rng is None else ["generator", rng]
    if isinstance(value, Space):
        return ["space", space_to_data(value)]
    return None


def _reference_from_data(data: dict[str, Any], trusted: bool) -> Space:
    """Rebuild a space from a class this controller has already imported: looked up in
    ``sys.modules`` and class dicts (no import, no attribute hook runs), created without
    ``__init__``, its attributes set from plain data."""
    module_name, qualname = str(data["module"])[:500], str(data["qualname"])[:500]
    where = f"{module_name}.{qualname}"
    module = sys.modules.get(module_name)
    if module is None:
        raise SpaceRefused(
            f"a sandbox sent a space of type {where}, whose module this controller has not "
            "imported (an untrusted sandbox's spaces are rebuilt only from classes already "
            "loaded here). Import it before building the vector env, register the type "
            "with gym_fork.transport.space_codec.register_space, or pass trusted=True."
        )
    found: Any = module
    for part in qualname.split("."):
        namespace = getattr(found, "__dict__", None)
        found = namespace.get(part) if isinstance(namespace, Mapping) else None
    if not (isinstance(found, type) and issubclass(found, Space)):
        raise SpaceRefused(f"{where} is not a space class loaded in this controller")
    space = object.__new__(found)
    state = data["state"]
    if not isinstance(state, dict) or not all(type(k) is str for k in state):
        raise SpaceRefused(f"the attributes of a {where} space are not a mapping of names")
    space.__dict__.update({k: _attribute_from_data(v, trusted) for k, v in state.items()})
    return space


def _attribute_from_data(item: Any, trusted: bool) -> Any:
    tag, value = item
    if tag == "plain":
        return value
    if tag == "dtype":
        dtype = untrusted_dtype(value)
        if dtype.hasobject:
            raise SpaceRefused("an object dtype")
        return dtype
    if tag == "generator":
        return generator_from_data(value)
    if tag == "space":
        return space_from_data(value, trusted=trusted)
    raise SpaceRefused(f"unknown attribute tag {tag!r:.50}")


# -- numpy Generators and EnvSpecs ---------------------------------------------------
_BIT_GENERATORS = ("PCG64", "PCG64DXSM", "MT19937", "Philox", "SFC64")


def generator_to_data(rng: np.random.Generator) -> dict[str, Any] | None:
    """A numpy Generator as its bit generator's name and state (its big ints as text),
    or None for a bit generator numpy does not ship."""
    name = type(rng.bit_generator).__name__
    if name not in _BIT_GENERATORS or type(rng.bit_generator) is not getattr(np.random, name):
        return None
    return {"bit_generator": name, "state": _ints_to_text(rng.bit_generator.state)}


def generator_from_data(data: Any) -> np.random.Generator:
    """The Generator back: same bit generator, same state (numpy checks the state)."""
    name = data.get("bit_generator") if isinstance(data, dict) else None
    if name not in _BIT_GENERATORS:
        raise SpaceRefused(f"not a numpy bit generator: {name!r:.50}")
    bit_generator = getattr(np.random, name)()
    try:
        bit_generator.state = _ints_from_text(data["state"])
    except (TypeError, ValueError, KeyError) as exc:
        raise SpaceRefused(f"a {name} state that does not load: {exc}") from exc
    return np.random.Generator(bit_generator)


def _ints_to_text(value: Any) -> Any:
    if type(value) is int:
        return {"int": str(value)}
    if isinstance(value, dict):
        return {str(k): _ints_to_text(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_ints_to_text(v) for v in value]
    return value


def _ints_from_text(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"int"} and isinstance(value["int"], str) and len(value["int"]) < 100:
            return int(value["int"])
        return {k: _ints_from_text(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_ints_from_text(v) for v in value]
    return value


def value_to_data(value: Any) -> dict[str, Any] | None:
    """Plain data for a value msgpack does not carry that a Gymnasium user reads with
    ``get_attr`` (a space, an EnvSpec, a numpy Generator), or None (pickle it)."""
    if isinstance(value, Space):
        data = space_to_data(value)
        return None if data["kind"] == PICKLED else {"kind": "space", "space": data}
    if type(value) is EnvSpec:
        try:
            return {"kind": "env_spec", "json": value.to_json()}
        except Exception:  # a callable entry point, kwargs that are not JSON
            return None
    if type(value) is np.random.Generator:
        rng = generator_to_data(value)
        return None if rng is None else {"kind": "generator", **rng}
    return None


def value_from_data(data: Any, *, trusted: bool) -> Any:
    """The value :func:`value_to_data` describes, rebuilt without unpickling (a space
    that carries its pickle too is loaded from it only when ``trusted``)."""
    kind = data.get("kind") if isinstance(data, dict) else None
    try:
        if kind == "space":
            return space_from_data(data["space"], trusted=trusted)
        if kind == "env_spec":
            return EnvSpec.from_json(str(data["json"]))
        if kind == "generator":
            return generator_from_data(data)
    except SpaceRefused:
        raise
    except Exception as exc:
        raise SpaceRefused(f"a {kind} value that does not decode: {exc}") from exc
    # The type alone: the repr of a value nested ~1000 deep raises RecursionError.
    what = repr(kind[:40]) if isinstance(kind, str) else type(kind).__name__
    raise SpaceRefused(f"not an encoded value: a {type(data).__name__} of kind {what}")
