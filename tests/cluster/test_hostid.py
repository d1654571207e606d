"""A rank's host identity (cluster.hostid): two processes share it only when they share a
kernel boot and a PID namespace, since an owner takes a same-host writer's absence from
/proc for proof that it is gone. Broken mode: the identity this module gave before (the
boot id cut to 8 digits, placeholders for what it could not read) names two hosts of one
hostname alike, and the check below reports it."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest

from kvferry.cluster.hostid import (
    BOOT_ID_PATH,
    PID_NAMESPACE_PATH,
    HostIdentityError,
    host_identity,
    this_host,
)

INITIAL_PID_NAMESPACE = "4026531836"  # the initial namespace's inode: the same on every host
Identity = Callable[..., str]


def _unreadable(path: str) -> Callable[[], str]:
    def read() -> str:
        raise PermissionError(13, "Permission denied", path)

    return read


def _placeholder_identity(
    hostname: str, boot_id: Callable[[], str], pid_namespace: Callable[[], str]
) -> str:
    """BROKEN MODE: the boot id's first 8 digits, and a placeholder for a part unread."""
    try:
        boot = boot_id()[:8]
    except OSError:
        boot = "noboot"
    try:
        pidns = pid_namespace()
    except OSError:
        pidns = "nopidns"
    return f"{hostname}:{boot}:{pidns}"


def _hosts_taken_for_one(identity: Identity) -> list[str]:
    """Pairs of hosts (one hostname, the initial PID namespace each) that ``identity``
    names alike; a host it refuses to name (HostIdentityError) is named by nobody."""

    def named(boot: Callable[[], str], pidns: Callable[[], str]) -> str | None:
        try:
            return identity("node", boot, pidns)
        except HostIdentityError:
            return None

    cases = {
        "boot ids alike in their first 8 digits": (
            (lambda: "27c70c9a01a74cb7bd829c435799eef6", lambda: INITIAL_PID_NAMESPACE),
            (lambda: "27c70c9aff0000000000000000000001", lambda: INITIAL_PID_NAMESPACE),
        ),
        "no boot id readable on either": (
            (_unreadable(BOOT_ID_PATH), lambda: INITIAL_PID_NAMESPACE),
            (_unreadable(BOOT_ID_PATH), lambda: INITIAL_PID_NAMESPACE),
        ),
        "no namespace readable in two containers of one boot": (
            (lambda: "27c70c9a01a74cb7bd829c435799eef6", _unreadable(PID_NAMESPACE_PATH)),
            (lambda: "27c70c9a01a74cb7bd829c435799eef6", _unreadable(PID_NAMESPACE_PATH)),
        ),
    }
    alike = []
    for what, (a, b) in cases.items():
        first, second = named(*a), named(*b)
        if first is not None and first == second:
            alike.append(what)
    return alike


@pytest.mark.parametrize("broken", [False, True], ids=["identity", "broken-placeholders"])
def test_two_hosts_of_one_hostname_are_never_one(broken):
    identity = _placeholder_identity if broken else host_identity
    alike = _hosts_taken_for_one(identity)
    if broken:
        assert len(alike) == 3, alike
    else:
        assert alike == []


@pytest.mark.parametrize("path", [BOOT_ID_PATH, PID_NAMESPACE_PATH])
def test_an_unreadable_part_refuses_with_its_path(path):
    readers = {BOOT_ID_PATH: lambda: "ab" * 16, PID_NAMESPACE_PATH: lambda: "4026531836"}
    readers[path] = _unreadable(path)
    with pytest.raises(HostIdentityError, match=re.escape(path)) as err:
        host_identity("node", readers[BOOT_ID_PATH], readers[PID_NAMESPACE_PATH])
    assert "Permission denied" in str(err.value)


def test_this_hosts_identity_holds_the_whole_boot_id():
    hostname, boot, pidns = this_host().rsplit(":", 2)
    assert hostname
    assert re.fullmatch(r"[0-9a-f]{32}", boot), boot
    assert pidns.isdigit(), pidns
