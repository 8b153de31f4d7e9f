# The compiled cffi extension (ext/gf_ring.c, built by ext/build_ring.py): mypy cannot read a .so.
# cffi's objects are untyped (no stubs installed), so both are Any.
from typing import Any

ffi: Any
lib: Any
