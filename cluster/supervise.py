"""A rank's launcher on its own host: forks the rank, reaps it, and publishes its exit.

In a cluster run as failure domains every rank process is the child of a small launcher
process (the one torchrun started). When the rank exits, for any reason including SIGKILL,
the launcher reaps it (its mappings, sockets and queue pairs are gone once it is reaped),
publishes an :class:`~.rendezvous.ExitRecord` for the rank's incarnation in the cluster's
store, and exits with the rank's status, so torchrun restarts the job as it was told to.
The exit record is what an owner on another host takes as proof that the writer's process
is gone (see ``RankRuntime.write_path_closed``). Only a launcher that dies with its rank
(the host lost) says nothing, and then the pages stay quarantined: safe, never proven.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import sys
import time
from typing import TYPE_CHECKING

from .hostid import this_host
from .rendezvous import ExitRecord, card_key, open_card, publish_exit
from .trust import Trust, process_trust

if TYPE_CHECKING:
    from .store import StoreSpec

log = logging.getLogger("kvferry.cluster")

CARD_WAIT_S = 5.0


def fork_rank(rank: int, store_address: str | StoreSpec, trust: Trust | None = None) -> None:
    """Return in the child (the rank); in the parent, wait for the child, publish its
    exit (MAC'd with the cluster's ``trust``) in the store at ``store_address``
    (``HOST:PORT``, or a parsed ``--store`` with its TLS and authentication) and leave the
    process with the child's exit code (never returns)."""
    trust = trust or process_trust()
    child = os.fork()
    if child == 0:
        return
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, functools.partial(_forward, child))
    while True:
        try:
            _, status = os.waitpid(child, 0)
            break
        except InterruptedError:
            continue
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


def _forward(child: int, sig: int, frame: object = None) -> None:
    try:
        os.kill(child, sig)
    except ProcessLookupError:
        pass


def _publish(rank: int, pid: int, code: int, store_address: str | StoreSpec, trust: Trust) -> None:
    from .store import connect

    store = connect(store_address, timeout_s=CARD_WAIT_S)
    key = card_key(rank)
    if not store.check([key]):
        return  # it died before publishing a card: no peer knows of it
    card = open_card(store.get(key), trust, rank)  # a stranger's card: CardRefused
    if card.pid != pid:
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
