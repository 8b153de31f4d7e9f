"""Which installed packages a guest image packs: what the controller imports, and what
those packages require.

A guest used to get the whole Python environment (every installed distribution: torch
and its CUDA libraries too, several GB). Now it gets the standard library, gym_fork and
its requirements, and every distribution that owns a module the controller process has
imported when the image is built (the vector env's env code and what the user's script
loaded), each with the distributions it requires (``Requires-Dist`` without extras, so
a package's own lazy imports of its dependencies are there too). Installed files that no
distribution owns (a loose module, a ``.pth`` file) are always packed: they are small.

``GYM_FORK_VM_PACKAGES`` adds distributions by name (comma separated) for env code that
imports a package only inside the guest; ``GYM_FORK_VM_PACKAGES=all`` packs the whole
environment as before.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import sys
from dataclasses import dataclass

from gym_fork import knobs

OWN_DISTRIBUTION = "gym-fork"
ALL = "all"
_REQUIREMENT_NAME = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


class UnknownPackage(ValueError):
    """GYM_FORK_VM_PACKAGES names a distribution that is not installed."""


def normalise(name: str) -> str:
    """A distribution name as PEP 503 compares them (``PyYAML`` -> ``pyyaml``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class Selection:
    """What of the installed packages goes into an image.

    ``entries`` are absolute paths directly under a site-packages directory (a package
    directory, a module file, a ``.dist-info``); ``everything`` means whole site dirs.
    """

    everything: bool
    site_dirs: tuple[str, ...]
    distributions: tuple[str, ...]  # normalised names, sorted
    entries: tuple[str, ...]  # sorted

    def describe(self) -> str:
        if self.everything:
            return "the whole environment (GYM_FORK_VM_PACKAGES=all)"
        return f"{len(self.distributions)} distributions: {', '.join(self.distributions)}"


def site_dirs() -> list[str]:
    """The site-packages directories on ``sys.path``, in order."""
    found = []
    for entry in sys.path:
        if entry.endswith(("site-packages", "dist-packages")) and os.path.isdir(entry):
            real = os.path.realpath(entry)
            if real not in found:
                found.append(real)
    return found


@dataclass
class _Installed:
    """The distributions installed in one set of site dirs, and who owns which entry."""

    tops: dict[str, set[str]]  # distribution -> absolute top-level entries it owns
    owner: dict[str, str]  # absolute top-level entry -> distribution (the first seen)
    dists: dict[str, importlib.metadata.Distribution]  # its requirements read when asked
    loose: set[str]  # entries under a site dir that no distribution owns


_installed_memo: dict[tuple, _Installed] = {}


def _installed(sites: list[str]) -> _Installed:
    """:func:`_scan`, reused while no site dir changed (an install or removal changes
    its directory's mtime)."""
    try:
        key = tuple((site, os.stat(site).st_mtime_ns) for site in sites)
    except OSError:
        return _scan(sites)
    known = _installed_memo.get(key)
    if known is None:
        known = _installed_memo[key] = _scan(sites)
    return known


def _scan(sites: list[str]) -> _Installed:
    tops: dict[str, set[str]] = {}
    owner: dict[str, str] = {}
    dists: dict[str, importlib.metadata.Distribution] = {}
    for site in sites:
        for dist in importlib.metadata.distributions(path=[site]):
            name = _name(dist)
            if not name or name in tops:
                continue  # shadowed by an earlier site dir, as the import system does
            owned = _owned_entries(dist, site)
            tops[name] = owned
            for entry in owned:
                owner.setdefault(entry, name)
            dists[name] = dist
    loose = set()
    for site in sites:
        for entry in os.listdir(site):
            full = os.path.join(site, entry)
            if full not in owner and entry != "__pycache__":
                loose.add(full)
    return _Installed(tops, owner, dists, loose)


def _name(dist: importlib.metadata.Distribution) -> str:
    """Its normalised name, from its ``NAME-VERSION.dist-info`` directory where it has
    one (parsing every METADATA file costs more than the rest of the scan)."""
    meta_dir = str(getattr(dist, "_path", ""))
    if meta_dir.endswith(".dist-info"):
        # the name has no "-" in it there (wheels write it with "_"): NAME-VERSION
        return normalise(os.path.basename(meta_dir).removesuffix(".dist-info").split("-")[0])
    return normalise(dist.metadata["Name"] or "")


def _record_tops(dist: importlib.metadata.Distribution) -> set[str] | None:
    """The first path component of every file a wheel's RECORD lists, read as text
    (``dist.files`` makes a Path per file: ~5 s for a venv holding torch)."""
    record = dist.read_text("RECORD")
    if record is None:
        return None
    tops = set()
    for line in record.splitlines():
        first = line.lstrip('"').split("/", 1)[0].split(",", 1)[0]
        tops.add(first)
    return tops


def _owned_entries(dist: importlib.metadata.Distribution, site: str) -> set[str]:
    """The top-level entries under ``site`` that ``dist``'s RECORD lists (files
    outside ``site``, such as scripts in ``bin/``, are left out)."""
    owned = set()
    tops = _record_tops(dist)
    if tops is None:  # no RECORD (an egg-info install): its file list, if any
        tops = {path.parts[0] for path in dist.files or [] if path.parts}
    for first in tops:
        if first and first not in ("..", "__pycache__"):
            owned.add(os.path.join(site, first))
    meta_dir = getattr(dist, "_path", None)  # the .dist-info itself (no RECORD: no files)
    if meta_dir is not None and os.path.dirname(str(meta_dir)) == site:
        owned.add(str(meta_dir))
    if not dist.files:
        for line in (dist.read_text("top_level.txt") or "").split():
            for candidate in (line, line + ".py"):
                if os.path.exists(os.path.join(site, candidate)):
                    owned.add(os.path.join(site, candidate))
    return owned


def _requirements(dist: importlib.metadata.Distribution) -> list[str]:
    names = []
    for requirement in dist.requires or []:
        if "extra ==" in requirement.replace('"', "").replace("'", ""):
            continue  # an optional extra: only where something imports it
        match = _REQUIREMENT_NAME.match(requirement)
        if match:
            names.append(normalise(match.group(1)))
    return names


def _top_entry(path: str, sites: list[str]) -> str | None:
    """The entry directly under a site dir that ``path`` lies in, if any."""
    for site in sites:
        if path.startswith(site + os.sep):
            first = path[len(site) + 1 :].split(os.sep, 1)[0]
            return os.path.join(site, first)
    return None


def imported_entries(sites: list[str]) -> set[str]:
    """Top-level site-packages entries holding a module this process has imported."""
    found = set()
    for module in list(sys.modules.values()):
        paths = []
        file = getattr(module, "__file__", None)
        if isinstance(file, str):
            paths.append(os.path.realpath(file))
        else:  # a namespace package: no file, its directories only
            paths += [os.path.realpath(p) for p in getattr(module, "__path__", []) or []]
        for path in paths:
            entry = _top_entry(path, sites)
            if entry is not None:
                found.add(entry)
    return found


def extra_packages() -> tuple[bool, list[str]]:
    """``GYM_FORK_VM_PACKAGES``: (pack everything, the names it adds)."""
    given = knobs.read("GYM_FORK_VM_PACKAGES").strip()
    names = [normalise(n) for n in given.split(",") if n.strip()]
    return ALL in names, [n for n in names if n != ALL]


def select(entries: set[str] | None = None) -> Selection:
    """The selection for an image built now (``entries``: the imported top-level
    entries; default: what this process has imported)."""
    sites = site_dirs()
    everything, extra = extra_packages()
    if everything:
        return Selection(True, tuple(sites), (), ())
    installed = _installed(sites)
    unknown = [n for n in extra if n not in installed.tops]
    if unknown:
        raise UnknownPackage(
            f"GYM_FORK_VM_PACKAGES names {', '.join(unknown)}, not installed in "
            f"{', '.join(sites) or 'any site-packages directory'}"
        )
    imported = imported_entries(sites) if entries is None else entries
    wanted = [installed.owner[e] for e in sorted(imported) if e in installed.owner]
    if OWN_DISTRIBUTION in installed.tops:
        wanted.append(OWN_DISTRIBUTION)
    chosen: set[str] = set()
    pending = [*wanted, *extra]
    while pending:
        name = pending.pop()
        if name in chosen or name not in installed.tops:
            continue  # a requirement not installed (a marker that does not apply here)
        chosen.add(name)
        pending += _requirements(installed.dists[name])
    packed = set(installed.loose) | {e for e in imported if e not in installed.owner}
    for name in chosen:
        packed |= installed.tops[name]
    return Selection(False, tuple(sites), tuple(sorted(chosen)), tuple(sorted(packed)))
