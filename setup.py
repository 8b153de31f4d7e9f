"""Build hook: compiles the C ring (ext/gf_ring.c) through cffi as gym_fork._ring."""

import shutil
import sys

from setuptools import setup

if shutil.which("cc") is None and shutil.which("gcc") is None:
    sys.exit(
        "gym_fork: no C compiler found (cc/gcc). The shared-memory ring in ext/ is compiled "
        "at install time; install one first, e.g. `apt-get install build-essential`."
    )

setup(
    cffi_modules=["ext/build_ring.py:ffibuilder"],
    # The ring uses the stable ABI only: one abi3 wheel serves every CPython >= 3.11.
    options={"bdist_wheel": {"py_limited_api": "cp311"}},
)
