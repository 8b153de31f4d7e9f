"""The layers a sandbox has (gym_fork/system/measure.py ``achieved``): its own report
when its process cannot be measured, the kernel's word when it can, and nothing it
shares with another process of its tree counted as its own."""

from __future__ import annotations

from gym_fork.system.isolation import IsolationConfig
from gym_fork.system.measure import Measured, achieved

TREE = {"uts": True, "net": True, "pid": True, "proc": True}
OWN = {"mount": True, "ipc": True, "private_tmp": True, "no_new_privs": True, "user": False}


def kernel(mnt: str = "mnt:[1]", tmp: str = "0:41", writable: list[str] | None = None):
    """A measured sandbox: every namespace its own, seccomp and capabilities dropped."""
    namespaces = dict.fromkeys(("mnt", "ipc", "uts", "net", "pid"), True) | {"user": False}
    return Measured(
        namespaces=namespaces,
        no_new_privs=True,
        seccomp_filters=1,
        capabilities=0,
        bounding=0,
        writable_mounts=[] if writable is None else writable,
        links={"mnt": mnt, "ipc": "ipc:[1]"},
        layers={"/tmp": tmp, "/dev/shm": "0:42"},
    )


def test_without_a_measurement_the_sandbox_report_counts():
    seen = achieved(TREE, {**OWN, "ipc": False}, {"x": "why"}, None, [], IsolationConfig())
    assert seen.namespaces == {"mount": True, "ipc": False, "uts": True, "net": True, "pid": True}
    assert seen.private_tmp and seen.no_new_privs
    assert seen.details["proc"] == "the tree's own" and seen.details["seccomp"] == "off"
    assert "measured_by" not in seen.details and seen.missing == {"x": "why"}


def test_the_kernel_overrides_what_the_sandbox_said():
    measured = kernel(writable=["/data"])
    measured.no_new_privs = False
    seen = achieved(TREE, OWN, {}, measured, [], IsolationConfig())
    assert not seen.no_new_privs and seen.details["capabilities"] == "dropped"
    assert seen.details["seccomp"].startswith("on (1 filter")
    assert seen.details["read_only_host"] is False
    assert seen.missing == {"read_only_host": "writable mounts of the host: /data"}


def test_what_it_shares_with_its_tree_is_not_its_own():
    others = [(7, kernel(mnt="mnt:[9]", tmp="0:99")), (8, None), (9, kernel(tmp="0:41"))]
    seen = achieved(TREE, OWN, {}, kernel(), others, IsolationConfig())
    assert seen.namespaces["mount"] is False and seen.namespaces["ipc"] is False
    assert seen.private_tmp is False
    assert seen.missing["shared_namespaces"].startswith("shares ipc, /dev/shm with process 7")


def test_the_hosts_tmp_is_shared_when_asked():
    others = [(7, kernel(mnt="mnt:[9]", tmp="0:41"))]
    config = IsolationConfig(private_tmp=False)
    seen = achieved(TREE, OWN, {}, kernel(), others, config)
    assert seen.private_tmp and seen.namespaces["ipc"] is False
    assert seen.missing["shared_namespaces"] == "shares ipc with process 7 of its tree"


def test_the_tree_is_not_looked_at_without_namespaces():
    def others():
        raise AssertionError("measured the tree")
        yield

    seen = achieved(TREE, OWN, {}, kernel(), others(), IsolationConfig(namespaces=False))
    assert seen.namespaces["mount"] and seen.private_tmp
