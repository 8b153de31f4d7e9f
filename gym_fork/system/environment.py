"""The environment variables a sandbox gets: an allowlist of the controller's, not all.

A training process's environment holds credentials (cloud keys, API tokens, database
URLs) that env code has no use for. Warm parents, and so every sandbox, start from the
controller's variables filtered by :func:`scrubbed`: what interpreters, numeric and GPU
libraries, simulators and renderers read (locale, paths, thread counts, CUDA, MuJoCo,
SDL, ...), gym_fork's own, and whatever the caller names with ``pass_env`` (names or
shell patterns, e.g. ``["WANDB_*"]``; ``pass_env=True``: everything, as
``AsyncVectorEnv``'s workers inherit it).

The filter is applied where the interpreter is started (the zygote's and a warm
parent's exec), not only to ``os.environ`` after it: ``/proc/self/environ`` shows what
a process was started with, and a fork keeps those bytes in its memory.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping

# Read by interpreters, loaders, shells and terminals; none is a secret.
ALLOWED_NAMES = frozenset(
    {
        "PATH",
        "HOME",
        "USER",
        "LOGNAME",
        "SHELL",
        "LANG",
        "LANGUAGE",
        "TZ",
        "TERM",
        "COLUMNS",
        "LINES",
        "NO_COLOR",
        "FORCE_COLOR",
        "VIRTUAL_ENV",
        "CONDA_PREFIX",
        "CONDA_DEFAULT_ENV",
        "DISPLAY",
        "WAYLAND_DISPLAY",
        "MPLBACKEND",
        "MUJOCO_GL",
        "PYOPENGL_PLATFORM",
        "SSL_CERT_FILE",
        "SSL_CERT_DIR",
        "REQUESTS_CA_BUNDLE",
    }
)
# Families of settings (thread pools, GPU and numeric libraries, simulators, renderers).
ALLOWED_PREFIXES = (
    "LC_",
    "PYTHON",
    "LD_",
    "MALLOC_",
    "GYM_FORK_",
    "GYM_",
    "ALE_",
    "CUDA_",
    "NVIDIA_",
    "CUBLAS_",
    "CUDNN_",
    "OMP_",
    "KMP_",
    "GOMP_",
    "MKL_",
    "OPENBLAS_",
    "BLIS_",
    "VECLIB_",
    "NUMEXPR_",
    "NUMBA_",
    "JAX_",
    "XLA_",
    "TF_",
    "TORCH_",
    "MUJOCO_",
    "EGL_",
    "MESA_",
    "__GLX_",
    "__EGL_",
    "SDL_",
    "PYGAME_",
    "XDG_",
)
ALLOWED_SUFFIXES = ("_NUM_THREADS",)
# Never passed by the allowlist, whatever family they look like (still by pass_env).
SECRET_WORDS = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "API_KEY", "PRIVATE")


def allowed(name: str) -> bool:
    """Whether the allowlist passes ``name`` to sandboxes."""
    upper = name.upper()
    if any(word in upper for word in SECRET_WORDS):
        return False
    return (
        name in ALLOWED_NAMES
        or name.startswith(ALLOWED_PREFIXES)
        or name.endswith(ALLOWED_SUFFIXES)
    )


def check_pass_env(pass_env: object) -> tuple[str, ...] | bool:
    """``pass_env`` as given to ForkVectorEnv: True (everything), or names/patterns."""
    if pass_env is True or pass_env is False:
        return bool(pass_env)
    if isinstance(pass_env, str):
        raise TypeError(
            f"`pass_env` must be a list of variable names or patterns (or True), got the "
            f"string {pass_env!r}: write [{pass_env!r}]"
        )
    try:
        names: tuple[str, ...] = tuple(pass_env)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"`pass_env` must be a list of names or True, got {pass_env!r}") from None
    for name in names:
        if not isinstance(name, str) or not name or "=" in name:
            raise ValueError(f"`pass_env` entries must be variable names or patterns, got {name!r}")
    return names


def scrubbed(environ: Mapping[str, str], pass_env: Iterable[str] | bool = ()) -> dict[str, str]:
    """The variables of ``environ`` a sandbox gets (see the module docstring)."""
    if pass_env is True:
        return dict(environ)
    patterns = () if pass_env is False else tuple(pass_env)
    return {
        name: value
        for name, value in environ.items()
        if allowed(name) or any(fnmatch.fnmatchcase(name, p) for p in patterns)
    }


def withheld(environ: Mapping[str, str], pass_env: Iterable[str] | bool = ()) -> list[str]:
    """The names :func:`scrubbed` leaves out (for an error naming ``pass_env``)."""
    kept = scrubbed(environ, pass_env)
    return sorted(name for name in environ if name not in kept)
