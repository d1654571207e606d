"""A rank's launcher on its own host: forks the rank, reaps it, and publishes its exit.

In a cluster run as failure domains every rank process is the child of a small launcher
process (the one torchrun started). When the rank exits, for any reason including SIGKILL,
the launcher reaps it (its mappings, sockets and queue pairs are gone once it is reaped),
publishes an :class:`~.rendezvous.ExitRecord` for the rank's incarnation in the cluster's
store, and exits with the rank's status, so torchrun restarts the job as it was told to.
The exit record is what an owner on another host takes as proof that the writer's process
is gone (see ``RankRuntime.write_path_closed``). Only a launcher that dies with its rank
(the host lost) says nothing, and then the pages stay quarantined: safe, never proven. A
launcher killed alone takes its rank with it (:func:`die_with_launcher`).

While the rank runs, the launcher also looks in the store for a fence order naming the
rank's incarnation (:mod:`.fencing`: the router orders one once an owner severed the
rank). On one it SIGKILLs the rank, and the exit is published as for any other death.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import sys
import time
from typing import TYPE_CHECKING, Any

from .fencing import FENCE_POLL_S, FenceOrder, FenceRefused, fence_ordered
from .hostid import this_host
from .rendezvous import ExitRecord, RankCard, card_key, open_card, publish_exit
from .trust import Trust, process_trust

if TYPE_CHECKING:
    from .store import StoreSpec

log = logging.getLogger("kvferry.cluster")

CARD_WAIT_S = 5.0
STORE_RETRY_S = 30.0  # a launcher that lost the store looks for fence orders this seldom


def fork_rank(rank: int, store_address: str | StoreSpec, trust: Trust | None = None) -> None:
    """Return in the child (the rank); in the parent, wait for the child, publish its
    exit (MAC'd with the cluster's ``trust``) in the store at ``store_address``
    (``HOST:PORT``, or a parsed ``--store`` with its TLS and authentication) and leave the
    process with the child's exit code (never returns)."""
    trust = trust or process_trust()
    launcher = os.getpid()
    child = os.fork()
    if child == 0:
        die_with_launcher(launcher)
        return
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, functools.partial(_forward, child))
    status = _wait_fenced(child, FenceWatch(rank, child, store_address, trust))
    code = os.waitstatus_to_exitcode(status)
    try:
        _publish(rank, child, code, store_address, trust)
    except Exception as exc:  # the store gone: nobody to tell, pages stay quarantined
        print(
            f"kvferry launcher: rank {rank} (pid {child}) exited with {code}; "
            f"could not publish it: {exc}",
            file=sys.stderr,
        )
    os._exit(code if code >= 0 else 128 - code)


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_launcher(launcher: int) -> None:
    """In the rank (the launcher's child): be SIGKILLed when the launcher dies. A launcher
    killed outright (SIGKILL, the OOM killer, torchrun tearing a job down) cannot reap its
    rank or publish its exit; a rank left running would go on writing and holding pages
    with nobody to fence it, and a restarted job would run a second process of its rank
    beside it. Dying with the launcher, it leaves a process that is gone, which an owner
    on its host proves from the pid; the pages behind it on other hosts stay quarantined
    (safe, never proven). A launcher that died before this ran is caught by its pid."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        print(
            f"kvferry launcher: prctl(PR_SET_PDEATHSIG) failed: {os.strerror(err)}; the "
            "rank would outlive its launcher, so it stops here",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)
    if os.getppid() != launcher:  # the launcher died between the fork and the prctl
        os._exit(1)


def _wait_fenced(child: int, watch: FenceWatch) -> int:
    """Wait for ``child`` to exit and return its wait status; SIGKILL it first if a fence
    order names it."""
    killed = False
    while True:
        try:
            pid, status = os.waitpid(child, os.WNOHANG)
        except InterruptedError:
            continue
        if pid == child:
            return status
        if not killed and (order := watch.ordered()) is not None:
            print(
                f"kvferry launcher: rank {order.rank} (pid {child}, incarnation "
                f"{order.incarnation:#x}) fenced: {order.reason}; killing it",
                file=sys.stderr,
                flush=True,
            )
            _forward(child, signal.SIGKILL)
            killed = True
            continue
        time.sleep(FENCE_POLL_S)


class FenceWatch:
    """Whether the cluster's store holds a fence order for the launcher's child: its
    incarnation is read from its card (once the child published one), then the order's
    key is polled. A store that does not answer is retried; a forged order is logged and
    stops nothing."""

    def __init__(self, rank: int, child: int, store_address: str | StoreSpec, trust: Trust) -> None:
        self.rank, self.child = rank, child
        self.address, self.trust = store_address, trust
        self.store: Any = None  # the store's client, once connected
        self.incarnation: int | None = None
        self.complained: dict[str, str] = {}
        self.quiet_until = 0.0

    def ordered(self) -> FenceOrder | None:
        from .store import connect

        if time.monotonic() < self.quiet_until:
            return None
        try:
            if self.store is None:
                self.store = connect(self.address, timeout_s=CARD_WAIT_S)
            if self.incarnation is None:
                self.incarnation = self._child_incarnation()
                if self.incarnation is None:
                    return None
            return fence_ordered(self.store, self.rank, self.incarnation, self.trust)
        except FenceRefused as exc:
            self._complain("refused", f"a fence order refused, it stops nothing: {exc}")
        except Exception as exc:  # the store away: the order waits, the rank runs on
            # the reason alone: torch's errors carry a C++ backtrace after it
            reason = str(exc).split("Exception raised from")[0].strip()
            first_line = reason.splitlines()[0][:200] if reason else ""
            self._complain("store", f"cannot read fence orders: {type(exc).__name__}: {first_line}")
            self.store = None  # a new client at the next look, STORE_RETRY_S from now
            self.quiet_until = time.monotonic() + STORE_RETRY_S
        return None

    def _child_incarnation(self) -> int | None:
        key = card_key(self.rank)
        if not self.store.check([key]):
            return None
        card = open_card(self.store.get(key), self.trust, self.rank)
        return card.incarnation if _is_childs(card, self.child) else None

    def _complain(self, kind: str, what: str) -> None:
        """Say ``what`` once per ``kind`` (a lost store's errors differ at each try)."""
        if kind not in self.complained:
            self.complained[kind] = what
            print(f"kvferry launcher: rank {self.rank}: {what}", file=sys.stderr, flush=True)


def _forward(child: int, sig: int, frame: object = None) -> None:
    try:
        os.kill(child, sig)
    except ProcessLookupError:
        pass


def _is_childs(card: RankCard, pid: int) -> bool:
    """Whether ``card`` is the one this launcher's child ``pid`` published. The pid alone
    does not say: a rank restarted in a fresh pid namespace (a new container, another
    node) gets small pids again, and the card still in the store may be its predecessor's
    with the same one. Taken for the child's, the predecessor's fence order would kill
    the child and its exit record would prove a process gone that this launcher never
    ran (it may be alive behind a partition, writing). Within one host, boot and pid
    namespace, a pid is one live process."""
    return card.pid == pid and card.host == this_host()


def _publish(rank: int, pid: int, code: int, store_address: str | StoreSpec, trust: Trust) -> None:
    from .store import connect

    store = connect(store_address, timeout_s=CARD_WAIT_S)
    key = card_key(rank)
    if not store.check([key]):
        return  # it died before publishing a card: no peer knows of it
    card = open_card(store.get(key), trust, rank)  # a stranger's card: CardRefused
    if not _is_childs(card, pid):
        return  # the card is an earlier incarnation's: this one never published
    publish_exit(
        store,
        ExitRecord(
            rank=rank,
            incarnation=card.incarnation,
            pid=pid,
            host=this_host(),
            status=code,
            at=time.time(),
        ),
        trust,
    )
    print(
        f"kvferry launcher: rank {rank} (pid {pid}, incarnation {card.incarnation:#x}) "
        f"exited with {code}; exit published",
        file=sys.stderr,
        flush=True,
    )
