"""Which peers an engine takes for its own host (a pidfd on the peer's process, the
cross-memory copy, and the vLLM connector's proof that a writer is gone): only one with the
same hostname, boot id and PID namespace, each of them known. Broken mode: the three
compared as they stand, so that two engines that could not read them (an empty boot id,
namespace 0) on two hosts of one hostname are taken for one host, and are reported."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

from kvferry.transfer import TransferConfig, TransferEngine
from kvferry.transfer import engine as engine_module
from kvferry.transfer.protocol import AddressInfo

BOOT = "27c70c9a-01a7-4cb7-bd82-9c435799eef6"
INITIAL_PID_NAMESPACE = 4026531836  # the initial namespace's inode: the same on every host
ME = AddressInfo(
    ucx=b"", incarnation=1, name="a", host="node", boot_id=BOOT, pidns=INITIAL_PID_NAMESPACE, pid=1
)
SameHost = Callable[[AddressInfo, AddressInfo], bool]


def _as_they_stand(a: AddressInfo, b: AddressInfo) -> bool:
    """BROKEN MODE: the identities compared field by field, unknown ones included."""
    return (a.host, a.boot_id, a.pidns) == (b.host, b.boot_id, b.pidns)


def _wrong_answers(same_host: SameHost) -> list[str]:
    """The pairs ``same_host`` answers wrongly."""
    unknown = dataclasses.replace(ME, boot_id="", pidns=0)
    cases = {
        "one host": (ME, dataclasses.replace(ME, pid=2, name="b"), True),
        "another boot": (ME, dataclasses.replace(ME, boot_id=BOOT[:-1] + "0"), False),
        "another namespace": (ME, dataclasses.replace(ME, pidns=4026532500), False),
        "another hostname": (ME, dataclasses.replace(ME, host="node2"), False),
        "both unread": (unknown, dataclasses.replace(unknown, pid=2), False),
        "boot id unread": (
            dataclasses.replace(ME, boot_id=""),
            dataclasses.replace(ME, boot_id="", pid=2),
            False,
        ),
        "namespace unread": (
            dataclasses.replace(ME, pidns=0),
            dataclasses.replace(ME, pidns=0, pid=2),
            False,
        ),
    }
    return [
        what
        for what, (a, b, expected) in cases.items()
        if same_host(a, b) is not expected or same_host(b, a) is not expected
    ]


@pytest.mark.parametrize("broken", [False, True], ids=["same_host", "broken-as-they-stand"])
def test_only_a_known_identity_shares_a_host(broken):
    wrong = _wrong_answers(_as_they_stand if broken else AddressInfo.same_host)
    if broken:
        assert wrong == ["both unread", "boot id unread", "namespace unread"]
    else:
        assert wrong == []


@pytest.mark.parametrize("known", [True, False], ids=["identity-read", "identity-unread"])
def test_an_engine_that_cannot_name_its_host_watches_no_peer_as_local(monkeypatch, known):
    """Two engines in this process: with their identity read, each watches the other's
    process by pidfd (it is on this host); with it unread, neither takes the other for
    local, though here they are."""
    if not known:
        monkeypatch.setattr(engine_module, "_host_identity", lambda: ("node", "", 0))
    engines = [TransferEngine(TransferConfig(transports="shm", name=n)) for n in "ab"]
    try:
        peer = engines[0].connect(engines[1].address)
        assert (peer.pidfd is not None) is known
        assert peer.info.same_host(peer.info) is known
    finally:
        for e in engines:
            e.shutdown()
