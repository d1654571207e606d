"""The decode worker's side of the protocol: the owner's driver over vLLM's ports.

A decode worker owns its TP rank's share of the blocks vLLM allocated for a request that
waits for remote KV (``WAITING_FOR_REMOTE_KVS``); its writers are the prefill workers that
hold the heads it holds (:func:`.reshape.writers_of`: with equal TP sizes, the prefill
worker of the same rank; with others, one or several, each writing the heads it is
assigned, as rows planned once when their blocks differ). vLLM keeps those blocks until
the connector reports the request in
``finished_recving``: for a verified load it then reads them, for any other it frees
them. That report is the one thing the owner's pages port can do with them, so:

- FREE and RELEASE_* report the request in ``finished_recving`` (a failed load also in
  ``failed_recving``, its blocks in ``get_block_ids_with_load_errors()``: I6);
- QUARANTINE holds the blocks: the request is not reported, whatever else happens, until
  a release (I4: every writer acked after its flush, or its process is proven gone; the
  first writer to fail frees nothing while another may still write);
- a verified load (VERIFIED, I5) is reported as loaded, and vLLM decodes it.

What each effect of the owner's table means, and the owner's timers, are
:class:`~kvferry.engine.protocol.owner_driver.OwnerDriver`'s, as for the service's decode
rank; this module turns what reaches the worker (the scheduler's loads, aborts and
refusals, the writer's NOTICE, ABORT and ABORT_ACK, the writer's process exiting) into the
table's events and supplies the ports.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvferry.cluster.processes import DRAIN_S, process_gone
from kvferry.engine.integrity import IntegrityError, PageList, request_id_hash
from kvferry.engine.protocol import owner as oc
from kvferry.engine.protocol.owner import OwnerBook, OwnerEvent, OwnerState
from kvferry.engine.protocol.owner_driver import (
    ABORT_EVENTS,
    HELD,
    SEVERED_RETRY_S,
    OwnerDriver,
    OwnerPorts,
    OwnerTimes,
)
from kvferry.engine.protocol.proof import GoneFacts, Proof, gone_proof
from kvferry.engine.protocol.words import AbortSource, Outcome, Release
from kvferry.engine.verify import Notice as VerifyNotice
from kvferry.engine.verify import (
    Planned,
    check_canaries,
    check_notice,
    check_part,
    checksum_steps,
    unchecked_rest,
)
from kvferry.transfer import AddressInfo, Peer, TransferError, decode_address

from . import wire
from .handshake import handshake_problem
from .layout import KVRegions, LayoutError
from .loop import PollTimers
from .parts import WorkerHost, WorkerParts
from .reshape import (
    EngineShape,
    PairRuns,
    block_checksums,
    pairs,
    plan_pair,
    plan_slots,
    region_checksums,
    same_blocks,
    slot_of,
    slots_agree,
    slotted_alike,
    turn_blocks,
    turned_pair,
    writers_of,
)
from .sidechannel import Fetcher

log = logging.getLogger("kvferry.vllm")

WRITER = 0  # a load's first writer (writers are numbered by their place in Load.links)
# a prefill's failed handshake fails the loads that wait for it; a load that comes this
# long after asks again (the prefill may have been starting, or has restarted)
HANDSHAKE_RETRY_S = 5.0


class QuarantineBreach(RuntimeError):
    """Quarantined blocks were about to go back to vLLM without a release (I4)."""


@dataclass(frozen=True)
class ConnectorTimes(OwnerTimes):
    """The owner's deadlines, and the connector's own retry period (``ack_retry_s``)
    where the service derives it from the abort deadline."""

    ack_retry_s: float = 1.0

    def retry_every(self, a_writer_severed: bool) -> float:
        return SEVERED_RETRY_S if a_writer_severed else self.ack_retry_s


@dataclass
class WriterLink:
    """One prefill worker writing into a load: its rank and card at the prefill, the
    heads it writes here and, for a worker of another shape, the runs of those rows
    (both sides plan the same runs; the owner reads the landed side)."""

    rank: int
    card: dict[str, Any]
    heads: tuple[int, ...]
    peer: Peer | None = None
    pid: int = -1
    local: bool = False
    gone_since: float | None = None  # when its process was first seen gone
    runs: PairRuns | None = None  # None: whole blocks (a prefill worker of this shape)
    # whole blocks laid in the writer's order, turned into ours after the checks
    turn_from: KVRegions | None = None
    # a fan-in's writer: its spans whole in slot ``slot`` of ours (turned, with the other
    # writers' slots, after the checks)
    slot: int | None = None


@dataclass
class Load:
    """A request at a decode worker: the owner's book and what its ports need."""

    rid: str
    remote: dict[str, Any]  # engine, host, port, rid (the prefill's), tp_size, blocks
    blocks: list[int]
    tokens: int
    book: OwnerBook = field(init=False)
    gens: list[int] = field(default_factory=list)
    links: list[WriterLink] = field(default_factory=list)  # its writers, once assigned
    notices: dict[int, dict[str, Any]] = field(default_factory=dict)  # whole, by writer
    parts: list[tuple[int, dict[str, Any]]] = field(default_factory=list)  # NOTICE_PARTs to check
    # per writer: which of the planned blocks its parts checked, and their checksums
    checked: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    turned: np.ndarray | None = None  # the planned blocks turned into our order so far
    failed: bool = False  # REPORT_FAILED, or the writer ended it: failed_recving
    error: str = ""  # why it failed
    scheduler_aborted: bool = False  # vLLM ended it: no load error to report
    vllm_holds: bool = True  # False: refused before vLLM allocated any block
    handed_back: bool = False  # reported in finished_recving
    quarantined: bool = False
    started: float = field(default_factory=time.monotonic)
    timer: Any = None  # the driver's transfer timeout, then its abort deadline
    abort_started: float = 0.0
    abort_source: AbortSource = AbortSource.INTERNAL  # ASK_ACKS's words
    abort_reason: str = ""
    warned: bool = False

    def __post_init__(self) -> None:
        self.book = OwnerBook(self.rid, (WRITER,))

    def writer_of(self, incarnation: int) -> int | None:
        """The writer whose engine incarnation sent a message, if one of this load's."""
        for w, link in enumerate(self.links):
            if link.peer is not None and link.peer.incarnation == incarnation:
                return w
        return None

    def names(self, writers: Iterable[int]) -> str:
        """The prefill workers ``writers`` (numbers in this load) as a log names them."""
        return ", ".join(
            f"tp{self.links[w].rank} (pid {self.links[w].pid})"
            if w < len(self.links)
            else f"writer {w} (not yet assigned)"
            for w in writers
        )

    @property
    def writers(self) -> tuple[int, ...]:
        return self.book.writers

    @property
    def prompt_len(self) -> int:
        return self.tokens

    @property
    def key(self) -> tuple[str, int]:
        """The prefill engine's side channel."""
        return (self.remote["host"], self.remote["port"])


class OwnerWire:
    """The owner's messages to its writer, over the worker's link."""

    def __init__(self, host: OwnerHost) -> None:
        self.host = host

    def send_plan(self, o: Load) -> None:
        """PLAN to the writer; a plan that cannot be sent fails the load (the writer may
        have got part of it: the abort's way, so its blocks wait for its ack or exit)."""
        h = self.host
        assert h.regions is not None
        fields = dict(
            rid=o.remote["rid"],
            orid=o.rid,
            blocks=o.blocks,
            gens=o.gens,
            tokens=o.tokens,
            regions=h.regions.to_wire(),
            descs=[s.descriptor().pack() for s in h.segments],
            tp_rank=h.tp_rank,
            tp_size=h.tp_size,
            kv_heads=h.kv_heads,
        )
        unsent = [
            w
            for w, link in enumerate(o.links)
            if h.link.send(
                link.peer, wire.encode(wire.PLAN, heads=list(link.heads), **fields), o.rid
            )
            is None
        ]
        for address in h.idle_writers(o):  # they hold the prompt too: no write is wanted
            h.link.send_to(address, wire.encode(wire.PLAN, heads=[], **fields), o.rid)
        if unsent:
            reason = f"the plan could not be sent to prefill worker {o.names(unsent)}"
            o.error = o.error or reason
            h.driver.abort(o, oc.on_failure(o.book), AbortSource.TRANSFER, reason)
        if h.settings.unsafe:  # BROKEN MODE: the load is reported before it lands
            h.hand_back(o)

    def tell_abort(
        self, rid: str, to: list[int], writers: list[int], source: AbortSource, reason: str
    ) -> None:
        """ABORT to the writer. One never planned (refused, or aborted before its plan)
        is found through the prefill's handshake, as are the prefill's workers this
        decode has none for (they hold the prompt's blocks too)."""
        h = self.host
        o = h.loads.get(rid)
        if o is None or not to:
            return
        if not o.links:
            h.abort_writers(o, source, o.error or reason)
            return
        payload = h.abort_payload(o.remote["rid"], rid, source, reason)
        for w in to:
            peer = o.links[w].peer
            if peer is not None:
                # by address: after a sever the next ask connects again (it may be back)
                h.link.send_to(peer.address, payload, rid)

    def sever(self, rid: str, fenced: list[int], writers: list[int], why: str) -> None:
        """Close the endpoint to the silent writer (no more plans on it) and count it.
        Not a proof: the blocks stay held until its ack or its exit."""
        h = self.host
        o = h.loads.get(rid)
        if o is None or not writers:
            return
        for w in writers:
            peer = o.links[w].peer if w < len(o.links) else None
            if peer is not None:
                h.link.sever(peer)
        h.stats.add(severed_peers=len(writers))
        log.warning("request %s: prefill workers %s severed: %s", rid, o.names(writers), why)


class VerifyPath:
    """The owner's data path: I5 on the notice's arrival, by :mod:`kvferry.engine.verify`
    as a decode rank checks it (length, blocks and generations, bytes, canaries,
    checksums); VERIFIED or CORRUPT back to the driver. A large load comes in parts, each
    checked when its NOTICE_PART arrives, so the whole notice leaves only the last part
    to check. Whole blocks or spans that landed in the writer's order (a layout that
    differs only inside each layer's span, a fan-in's slots) are checked as they landed,
    then turned into this worker's order, part by part (vLLM reads them once VERIFIED).
    Decoding is vLLM's."""

    def __init__(self, host: OwnerHost) -> None:
        self.host = host

    def verify_parts(self, o: Load) -> None:
        """The pipelined path: check the NOTICE_PARTs that arrived (each part's blocks and
        generations against the plan, their canaries and checksums) while the writers
        write the rest, then turn the blocks that every writer landing in them has
        checked; CORRUPT on a mismatch. A part proves nothing of its writer's later
        writes: only its whole notice or its ack does (the table's)."""
        h = self.host
        if h.settings.unsafe:  # the broken mode checks nothing; all is turned at the end
            o.parts.clear()
            return
        while o.parts:
            w, m = o.parts.pop(0)
            err = self._check_part(o, w, m)
            if err:
                o.parts.clear()
                o.error = f"integrity check failed: {err}"
                h.driver.feed(o, oc.on_part_corrupt(o.book))
                return
            lo, n = int(m["offset"]), len(m["blocks"])
            mask, sums = o.checked.setdefault(
                w, (np.zeros(len(o.blocks), bool), np.zeros(len(o.blocks), np.int64))
            )
            mask[lo : lo + n] = True
            sums[lo : lo + n] = m["checksums"]
        self._turn(o, final=False)

    def start_decode(self, o: Load) -> None:
        """vLLM's own scheduler takes the loaded request on from here (its prefill's
        first token is vLLM's)."""

    def verify(self, o: Load) -> None:
        h = self.host
        err = ""
        if not h.settings.unsafe:
            for w in range(len(o.links)):
                err = self._check_writer(o, w)
                if err:
                    break
        if err:
            o.error = f"integrity check failed: {err}"
            h.driver.feed(o, OwnerEvent.CORRUPT)
            return
        self._turn(o, final=True)  # checked as they landed; vLLM reads them in its order
        h.driver.feed(o, OwnerEvent.VERIFIED)

    def _turn(self, o: Load, final: bool) -> None:
        """Turn into this worker's order the planned blocks not turned yet that are
        final: those that every writer landing in them checked in a part, or all of them
        once every notice was checked (``final``). A whole-block writer's blocks are its
        own; a fan-in's spans are turned once every slot of the block was checked."""
        h = self.host
        assert h.regions is not None
        n = len(o.blocks)
        if o.turned is None:
            o.turned = np.zeros(n, bool)
        turned = o.turned

        def ready(writers: list[int]) -> np.ndarray:
            if final:
                return ~turned
            masks = [o.checked[w][0] if w in o.checked else np.zeros(n, bool) for w in writers]
            return np.logical_and.reduce(masks) & ~turned

        for w, link in enumerate(o.links):
            if link.turn_from is not None and link.slot is None:
                idx = np.flatnonzero(ready([w]))
                turn_blocks(h.regions, link.turn_from, [o.blocks[i] for i in idx])
                turned[idx] = True
        slotted = [w for w, link in enumerate(o.links) if link.slot is not None]
        if slotted:  # a fan-in's spans, every slot at once
            theirs = o.links[slotted[0]].turn_from
            assert theirs is not None
            idx = np.flatnonzero(ready(slotted))
            turn_blocks(h.regions, theirs, [o.blocks[i] for i in idx], writers=len(slotted))
            turned[idx] = True

    def _planned(self, o: Load, w: int) -> Planned:
        """What writer ``w`` was planned to write: the load's blocks and generations, and
        the bytes its whole blocks or its runs hold."""
        h = self.host
        assert h.regions is not None
        runs = o.links[w].runs
        planned_bytes = len(o.blocks) * h.regions.block_bytes if runs is None else runs.bytes
        return Planned(o.rid, o.tokens, o.blocks, o.gens, planned_bytes, "block")

    def _landed_sums(self, o: Load, w: int, keep: np.ndarray) -> dict[int, int]:
        """Checksums of what landed from writer ``w`` in the planned blocks ``keep``
        marks, by block: whole blocks by their page checksums, rows of another shape by
        the region the writer wrote into each block (:func:`.reshape.region_checksums`)."""
        h = self.host
        assert h.regions is not None
        idx = np.flatnonzero(keep)
        blocks = [o.blocks[i] for i in idx]
        runs = o.links[w].runs
        if runs is None:
            values = block_checksums(h.regions, blocks)
            return dict(zip(blocks, values.tolist(), strict=True))
        sums = region_checksums(h.regions, runs.within(keep), 1, len(o.blocks))
        return dict(zip(blocks, sums[idx].tolist(), strict=True))

    def _check_part(self, o: Load, w: int, m: dict[str, Any]) -> str:
        """I5 for one NOTICE_PART of writer ``w`` (its blocks' place in the plan, their
        canaries and checksums): '' or what failed."""
        h = self.host
        link = o.links[w]
        lo, blocks, gens, sums = int(m["offset"]), list(m["blocks"]), m["gens"], m["checksums"]
        try:
            part = check_part(self._planned(o, w), link.rank, lo, blocks, gens, sums)
            if h.settings.integrity:
                notice = VerifyNotice(link.rank, o.tokens, blocks, gens, sums, part.bytes)
                self._check_landed(o, w, part, notice, np.arange(lo, lo + len(blocks)))
        except IntegrityError as exc:
            return exc.reason
        return ""

    def _check_writer(self, o: Load, w: int) -> str:
        """I5 for writer ``w``'s whole notice: '' or what failed. The blocks its parts
        checked are not read again; the notice must repeat their checksums."""
        h = self.host
        n = o.notices.get(w)
        if n is None:
            return f"no notice from prefill worker {o.names([w])}"
        planned = self._planned(o, w)
        notice = VerifyNotice(
            o.links[w].rank, n["tokens"], n["blocks"], n["gens"], n["checksums"], n["bytes"]
        )
        try:
            check_notice(planned, notice)
            if not h.settings.integrity:
                return ""
            index = np.arange(len(o.blocks))  # the blocks' places in the plan
            checked = o.checked.get(w)
            if checked is not None and len(notice.checksums) == len(notice.pages):
                notice, planned, index = unchecked_rest(planned, notice, *checked)
            self._check_landed(o, w, planned, notice, index)
        except IntegrityError as exc:
            return exc.reason
        return ""

    def _check_landed(
        self, o: Load, w: int, planned: Planned, notice: VerifyNotice, index: np.ndarray
    ) -> None:
        """Checks 4 and 5 for ``planned``'s blocks (at ``index`` in the load's plan):
        their canaries, then the checksums of what writer ``w`` landed in them against
        ``notice``'s. Raises IntegrityError."""
        h = self.host
        assert h.canaries is not None
        blocks = torch.tensor([int(b) for b in planned.pages], dtype=torch.long)
        check_canaries(planned, h.canaries[blocks], index)
        keep = np.zeros(len(o.blocks), bool)
        keep[index] = True
        landed = self._landed_sums(o, w, keep)

        def checksums_of(bs: PageList) -> torch.Tensor:
            return torch.tensor([landed[int(b)] for b in bs], dtype=torch.int64)

        for _ in checksum_steps(planned, notice, checksums_of, len(blocks) or 1):
            pass


class OwnerHost(WorkerHost):
    """A decode worker's loads: what arrives becomes the owner's events, fed to its
    driver; this object is the driver's pages, writer facts and report ports."""

    def __init__(self, parts: WorkerParts, timers: PollTimers, me: AddressInfo) -> None:
        super().__init__(parts, timers)
        self.me = me
        self.loads: dict[str, Load] = {}
        self.handshakes: dict[tuple[str, int], dict[str, Any]] = {}
        self.handshake_arrived: dict[tuple[str, int], float] = {}  # by this host's clock
        # a failed handshake: why, and when it failed
        self.handshake_errors: dict[tuple[str, int], tuple[str, float]] = {}
        self.fetcher = Fetcher(self.settings.handshake_timeout_s, self.settings.key)
        self._pending_aborts: list[tuple[Load, AbortSource, str]] = []  # for a handshake
        self.finished_recving: set[str] = set()
        self.failed_recving: set[str] = set()
        self.load_errors: set[int] = set()
        self.regions: KVRegions | None = None
        self.segments: list[Any] = []
        self.gens: torch.Tensor | None = None  # per block: bumped at each plan into it
        self.canaries: torch.Tensor | None = None  # per block: (rid hash, gen, index)
        ports = OwnerPorts(
            wire=OwnerWire(self),
            pages=self,
            facts=self,
            data=VerifyPath(self),
            report=self,
            tombstones=self.tombstones,
            timers=timers,
            clock=self.clock,
            times=ConnectorTimes(
                self.settings.transfer_timeout_s,
                self.settings.abort_deadline_s,
                self.settings.ack_retry_s,
            ),
        )
        self.driver = OwnerDriver(
            ports,
            oc.owner_table(unsafe=self.settings.unsafe),
            observe=self._observe,
            settled=self._settled,
        )

    def attach(self, regions: KVRegions, segments: list[Any], kv_heads: int) -> None:
        """vLLM's KV buffers, registered with the transfer engine; the engine's KV heads."""
        self.regions, self.segments, self.kv_heads = regions, segments, kv_heads
        self.gens = torch.zeros(regions.num_blocks, dtype=torch.int64)
        self.canaries = torch.full((regions.num_blocks, 3), -1, dtype=torch.int64)

    # ------------------------------------------------------------ the driver's hooks
    def _observe(self, o: Load, event: OwnerEvent, before: OwnerState, move: Any) -> None:
        """An abort's first sign starts its clock and is counted by its source."""
        if event in ABORT_EVENTS and before not in HELD and not move.ignored:
            o.abort_started = o.abort_started or self.clock.now()
            self.stats.abort(o.abort_source.value)

    def _settled(self, o: Load, move: Any) -> None:
        if move.ignored:
            return
        if o.book.state is OwnerState.DECODING:  # verified (I5): vLLM reads the blocks
            self.hand_back(o)
        elif o.book.state is OwnerState.CLOSED and self.loads.get(o.rid) is o:
            del self.loads[o.rid]

    def hand_back(self, o: Load) -> None:
        """Report ``o`` in ``finished_recving`` (once): vLLM reads its blocks if the load
        was verified, else frees them; a failed load is also in ``failed_recving`` and
        its blocks are load errors (I6). Never while its blocks are quarantined."""
        if o.handed_back or not o.vllm_holds:
            return
        if o.quarantined:
            raise QuarantineBreach(
                f"request {o.rid}: {len(o.blocks)} quarantined blocks would go back to vLLM "
                f"in state {o.book.state.value} without a release (writer acked: "
                f"{sorted(o.book.acked)}, proven gone: {sorted(o.book.gone)})"
            )
        o.handed_back = True
        self.finished_recving.add(o.rid)
        if o.failed and not o.scheduler_aborted:
            self.failed_recving.add(o.rid)
            self.load_errors.update(o.blocks)
            log.error("request %s: KV load failed: %s", o.rid, o.error)
        self.stats.add(transfer_ms=1e3 * (time.monotonic() - o.started))

    def fail_request(self, rid: str | None, exc: Exception) -> None:
        """An exception in one of ``rid``'s timers: the load fails through the protocol
        (its blocks go the abort's way)."""
        reason = f"internal error: {type(exc).__name__}: {exc}"
        log.error("request %s: decode worker tp%d: %s", rid, self.tp_rank, reason, exc_info=exc)
        o = self.loads.get(rid) if rid is not None else None
        if o is None:
            return
        o.error = o.error or reason
        if o.book.state is OwnerState.NEW:
            self.driver.feed(o, oc.on_assign(o.book, (WRITER,), granted=False))
        else:
            self.driver.abort(o, oc.on_failure(o.book), AbortSource.INTERNAL, reason)

    # ------------------------------------------------------------ pages (a port)
    def stamp_canaries(self, o: Load) -> None:
        assert self.gens is not None and self.canaries is not None
        idx = torch.tensor(o.blocks, dtype=torch.int64)
        self.gens[idx] += 1
        o.gens = self.gens[idx].tolist()
        h = request_id_hash(o.rid)
        self.canaries[idx] = torch.tensor(
            [[h, g, i] for i, g in enumerate(o.gens)], dtype=torch.int64
        )

    def free(self, rid: str) -> list[int]:
        """The blocks go back to vLLM (every writer noticed or acked, or none was ever
        planned): reported in ``finished_recving``, once."""
        o = self.loads.get(rid)
        if o is None or not o.vllm_holds:
            return []
        self.hand_back(o)
        return list(o.blocks)

    def quarantine(self, o: Load) -> None:
        """Hold the blocks: the request is not reported to vLLM, which keeps them
        allocated (counted as used) until :meth:`release`."""
        o.quarantined = True
        self.stats.add(quarantined_blocks=len(o.blocks))
        log.info(
            "request %s: %d blocks quarantined on decode worker tp%d (aborted: %s) until the "
            "prefill worker acks after its flush or is proven gone",
            o.rid,
            len(o.blocks),
            self.tp_rank,
            o.abort_reason,
        )

    def release(self, rid: str) -> list[int]:
        o = self.loads.get(rid)
        if o is None:
            return []
        o.quarantined = False
        self.hand_back(o)
        return list(o.blocks)

    def quarantined(self, rid: str) -> bool:
        o = self.loads.get(rid)
        return o is not None and o.quarantined

    # ------------------------------------------------------------ writer facts (a port)
    def restarted_since(self, o: Load, writer: int) -> bool:
        """Never: a restarted prefill worker is another process with another transfer
        address and incarnation, reached by no load planned before; a message of it is
        refused by incarnation (:meth:`load_from`), and the old one's proof is its exit."""
        return False

    def proven_gone(self, o: Load, writers: Iterable[int]) -> dict[int, Proof]:
        """Each writer's proof of its end by the protocol's one rule
        (:func:`kvferry.engine.protocol.proof.gone_proof`): its process exited on this
        host (every thread of it: :func:`kvferry.cluster.processes.process_gone`) and the
        drain passed. A prefill on another host is never proven gone here (no exit
        records reach a connector): its blocks wait for its ack."""
        out: dict[int, Proof] = {}
        now = self.clock.now()
        for w in writers:
            link = o.links[w] if w < len(o.links) else None
            if link is None or not link.local or link.pid < 0 or not process_gone(link.pid):
                if link is not None:
                    link.gone_since = None
                continue
            link.gone_since = link.gone_since or now
            facts = GoneFacts(
                same_host=True,
                process_gone=True,
                gone_for_s=now - link.gone_since,
                drain_s=DRAIN_S,
            )
            proof = gone_proof(facts)
            if proof is not None:
                out[w] = proof
        return out

    def is_severed(self, writer: int) -> bool:
        """Never said: writer 0 is a different prefill worker in each load, so a sever is
        no fact about a writer number here; a severed load's asks keep the configured
        ``ack_retry_s`` (each connects again)."""
        return False

    # ------------------------------------------------------------ the report (a port)
    def done(self, o: Load, outcome: Outcome) -> None:
        """DONE(failed): the load is marked failed, so its report to vLLM carries
        ``failed_recving`` and the blocks' load errors. DONE(finished) has nothing to
        add: vLLM finished the request and answered its client itself."""
        if outcome is Outcome.FAILED:
            o.failed = True

    def nothing_held(self, rid: str) -> None:
        """No plan went out, so no write can land in the blocks vLLM allocated for it
        (if any): they go back to vLLM now."""
        o = self.loads.get(rid)
        if o is not None:
            self.hand_back(o)

    def closed(self, o: Load, pages: list[int], how: Release) -> None:
        """RELEASED: logged with the proof; the load's timer is cancelled (it is
        forgotten once the move settles, its id tombstoned by the table)."""
        if o.timer is not None:
            o.timer.cancel()
        why = o.book.justification()
        if o.abort_started:
            log.info(
                "request %s: %d blocks released (%s; proof: %s) %.1f ms after the abort (%s)",
                o.rid,
                len(pages),
                how.value,
                why,
                1e3 * (self.clock.now() - o.abort_started),
                o.abort_reason or "writer finished",
            )
        else:
            log.debug("request %s: %d blocks freed (%s; proof: %s)", o.rid, len(pages), how, why)

    def integrity_failure(self, o: Load) -> None:
        self.stats.add(checksum_failures=1)
        log.error("request %s: decode worker tp%d: %s", o.rid, self.tp_rank, o.error)

    def stuck(self, o: Load, waited_s: float) -> None:
        log.error(
            "request %s: %d blocks stay quarantined on decode worker tp%d: prefill workers %s "
            "neither acked nor are known to be gone after %.1f s",
            o.rid,
            len(o.blocks),
            self.tp_rank,
            o.names(o.book.pending()),
            waited_s,
        )

    # ------------------------------------------------------------ events in
    def on_recv(self, rid: str, spec: dict[str, Any]) -> None:
        """The scheduler allocated blocks for a remote prefill's KV: a new load. One the
        scheduler refused (``refused``: a shape kvferry cannot load), or a request id this
        worker loaded already (a client that names its requests, reusing one), gets nothing
        planned: its load fails at once (its blocks are fresh, nothing can land in them),
        so vLLM computes the prompt rather than wait for good."""
        if rid in self.loads:
            log.error(
                "request %s: decode worker tp%d: a second load of it ignored", rid, self.tp_rank
            )
            return
        refused = spec.get("refused") or (
            "this request id was loaded already; request ids must not repeat"
            if rid in self.tombstones
            else None
        )
        if refused:
            log.error(
                "request %s: decode worker tp%d: load refused: %s", rid, self.tp_rank, refused
            )
            self.finished_recving.add(rid)
            self.failed_recving.add(rid)
            self.load_errors.update(int(b) for b in spec["blocks"])
            return
        remote = {k: spec[k] for k in ("engine", "host", "port", "rid", "tp_size", "src")}
        o = self.loads[rid] = Load(rid, remote, list(spec["blocks"]), int(spec["tokens"]))
        self.fetcher.ask(o.key)
        self._try_assign(o)

    def on_refuse(self, rid: str, remote: dict[str, Any]) -> None:
        """Never allocated here: the owner refuses, and the prefill is told to free."""
        if rid in self.loads or rid in self.tombstones or not remote.get("rid"):
            return
        o = self.loads[rid] = Load(rid, remote, [], 0)
        o.error = "rejected at the decode before allocation"
        o.vllm_holds = False
        self.stats.abort(AbortSource.DECODE.value)
        self.driver.feed(o, oc.on_assign(o.book, (WRITER,), granted=False))

    def on_scheduler_abort(self, rid: str, reason: str) -> None:
        o = self.loads.get(rid)
        if o is None:
            return
        o.scheduler_aborted = True
        o.error = o.error or reason
        # Before the plan (NEW) nothing can land: the table closes it and tells the writer.
        self.driver.abort(o, oc.on_abort(o.book, writers_told=False), AbortSource.CLIENT, reason)

    def load_from(self, msg: Any, m: dict[str, Any]) -> tuple[Load, int] | None:
        """The load a writer's message is for and the writer's number in it, if it comes
        from one of that load's writer incarnations (another is counted and dropped: its
        word proves nothing here)."""
        o = self.loads.get(m["orid"])
        if o is None or not o.links:
            return None
        w = o.writer_of(msg.sender_incarnation)
        if w is None:
            self.stats.count("stale_messages")
            return None
        return o, w

    def on_notice_part(self, o: Load, w: int, m: dict[str, Any]) -> None:
        """A part of writer ``w``'s blocks landed (its flush came first): checked now,
        while the rest is written. Once the load left AWAITING it is of no use."""
        if o.book.state is OwnerState.AWAITING and w not in o.book.whole:
            o.parts.append((w, m))
            self.stats.add(parts=1)
        self.driver.feed(o, oc.on_part(o.book, w))

    def on_notice(self, o: Load, w: int, m: dict[str, Any]) -> None:
        if o.book.state is OwnerState.AWAITING:
            o.notices[w] = m
        self.driver.feed(o, oc.on_notice(o.book, w, whole=True))

    def on_ack(self, o: Load, w: int) -> None:
        if o.book.state in (OwnerState.AWAITING, OwnerState.VERIFYING):
            o.failed = True  # the writer ended the request on its side
            o.error = o.error or (
                f"prefill worker {o.names([w])} acked an abort this decode did not send"
            )
        self.driver.abort(
            o,
            oc.on_ack(o.book, w, severed=w in o.book.fenced),
            AbortSource.WRITER,
            f"prefill worker {o.names([w])} acked an abort",
        )

    def on_writer_abort(self, o: Load, w: int, m: dict[str, Any]) -> None:
        """A writer failed the request (its ABORT, to us as its owner)."""
        reason = f"prefill worker {o.names([w])} aborted ({m['source']}): {m['reason']}"
        o.failed = True
        o.error = o.error or reason
        self.driver.abort(o, oc.on_abort(o.book, writers_told=True), AbortSource.PREFILL, reason)

    def finished(self, rids: Iterable[str]) -> None:
        """vLLM finished these requests: a decoding load's end (FINISHED)."""
        for rid in rids:
            o = self.loads.get(rid)
            if o is not None and o.book.state is OwnerState.DECODING:
                self.driver.feed(o, OwnerEvent.FINISHED)

    # ------------------------------------------------------------ the poll
    def poll(self) -> None:
        """Handshakes that arrived (loads waiting for one are assigned, aborts waiting
        for one are sent), and writers whose process exited before their notice."""
        arrived = False
        for key, hs, err in self.fetcher.take():
            arrived = True
            if hs is not None and (problem := handshake_problem(hs)):
                hs, err = None, f"its handshake does not fit: {problem}"
                log.error("prefill engine at %s:%s: %s", key[0], key[1], err)
            if hs is None:
                self.handshake_errors[key] = (err, self.clock.now())
            else:
                self.handshakes[key] = hs
                self.handshake_arrived[key] = self.clock.now()
        if arrived:
            for o in [o for o in self.loads.values() if o.book.state is OwnerState.NEW]:
                self._try_assign(o)
            waiting, self._pending_aborts = self._pending_aborts, []
            for o, source, reason in waiting:
                self.abort_writers(o, source, reason)
        self._watch_writers()

    def _watch_writers(self) -> None:
        """A writer on this host whose process exited before its notice fails its load
        (the abort's way: its blocks wait for the proof that every writer is done)."""
        for o in list(self.loads.values()):
            if o.book.state is not OwnerState.AWAITING:
                continue
            for w, link in enumerate(o.links):
                if w in o.book.whole or not link.local or link.pid < 0:
                    continue
                if not process_gone(link.pid):
                    continue
                link.gone_since = link.gone_since or self.clock.now()
                reason = (
                    f"prefill worker {o.names([w])} of engine {o.remote['engine']} exited "
                    "before its notice"
                )
                o.error = o.error or reason
                self.driver.abort(o, oc.on_failure(o.book), AbortSource.PEER, reason)
                break

    # ------------------------------------------------------------ assignment
    def _handshake(self, remote: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
        key = (remote["host"], remote["port"])
        if key in self.handshake_errors:
            err, at = self.handshake_errors[key]
            if self.clock.now() - at < HANDSHAKE_RETRY_S:
                return None, (
                    f"cannot connect to prefill engine {remote.get('engine', '?')}: its "
                    f"handshake at {key[0]}:{key[1]} failed: {err}"
                )
            del self.handshake_errors[key]  # asked again; the load waits for the answer
            self.fetcher.ask(key, again=True)
        hs = self.handshakes.get(key)
        if hs is not None and hs.get("engine_id") != remote.get("engine"):
            # Another engine answers at that address now (the prefill restarted there): a
            # handshake just fetched means the prompt's engine is gone; an older one is
            # asked again, and the load waits for the answer.
            if self.clock.now() - self.handshake_arrived.get(key, 0.0) < HANDSHAKE_RETRY_S:
                return None, (
                    f"prefill engine {remote.get('engine', '?')} is gone: engine "
                    f"{hs.get('engine_id')} answers at {key[0]}:{key[1]} now"
                )
            self.forget_handshake(key)
            return None, ""
        return hs, ""

    def forget_handshake(self, key: tuple[str, int]) -> None:
        """Fetch the handshake of the engine at ``key`` again, for the loads waiting and
        to come (its workers' addresses may be gone with a restart)."""
        self.handshakes.pop(key, None)
        self.handshake_arrived.pop(key, None)
        self.fetcher.ask(key, again=True)

    def _shapes(self, hs: dict[str, Any]) -> tuple[EngineShape, EngineShape]:
        """The prefill's and this decode's (KV heads, TP size)."""
        if not hs.get("kv_heads"):
            raise LayoutError(
                f"prefill engine {hs.get('engine_id')} gave no KV head count in its handshake"
            )
        prefill = EngineShape(int(hs["kv_heads"]), int(hs["tp_size"]))
        return prefill, EngineShape(self.kv_heads, self.tp_size)

    def _links(self, o: Load) -> tuple[list[WriterLink] | None, str]:
        """This load's writers from the prefill's handshake (None while it is on its way),
        or why the two engines cannot pair."""
        hs, err = self._handshake(o.remote)
        if hs is None:
            return None, err
        assert self.regions is not None
        try:
            prefill, decode = self._shapes(hs)
            assigned = pairs(prefill, decode)
        except LayoutError as exc:
            return None, f"refused at handshake: {exc}"
        links: list[WriterLink] = []
        for (p, d), heads in assigned.items():
            if d != self.tp_rank:
                continue
            card = hs["workers"].get(p)
            if card is None:
                return None, f"prefill engine {hs['engine_id']} has no TP rank {p}"
            link = WriterLink(p, card, heads)
            if not card.get("regions"):
                return None, f"prefill worker tp{p} gave no KV geometry in its handshake"
            theirs = KVRegions.from_wire(card["regions"])
            like = prefill.tp == decode.tp and p == self.tp_rank
            slot = slot_of(theirs, self.regions, prefill, decode, p, self.tp_rank)
            if like and turned_pair(theirs, self.regions):
                link.turn_from = theirs  # whole blocks, turned after the checks
            elif slot is not None:  # its spans whole in its slot of ours, turned after
                try:
                    link.runs = plan_slots(
                        theirs, self.regions, slot, o.remote["src"], o.blocks, o.tokens
                    )
                except LayoutError as exc:
                    return None, f"cannot plan the spans of prefill worker tp{p}: {exc}"
                link.turn_from, link.slot = theirs, slot
            elif not (like and same_blocks(theirs, self.regions)):
                try:
                    link.runs = plan_pair(
                        theirs,
                        self.regions,
                        heads,
                        prefill.heads_of(p)[0],
                        decode.heads_of(self.tp_rank)[0],
                        o.remote["src"],
                        o.blocks,
                        o.tokens,
                    )
                except LayoutError as exc:
                    return None, f"cannot plan the rows of prefill worker tp{p}: {exc}"
            links.append(link)
        if not links:
            return None, f"no prefill worker of engine {hs['engine_id']} writes heads here"
        if not slots_agree([link.slot for link in links]):
            slotted = [link.rank for link in links if link.slot is not None]
            return None, (
                f"prefill workers {slotted} of engine {hs['engine_id']} would land in slots "
                f"and {[link.rank for link in links if link.slot is None]} as rows: their "
                "geometries differ"
            )
        spans = [(link.rank, link.turn_from) for link in links if link.turn_from is not None]
        if any(link.slot is not None for link in links) and not slotted_alike(
            [regions for _, regions in spans]
        ):
            return None, (
                f"prefill workers {[rank for rank, _ in spans]} of engine {hs['engine_id']} "
                f"would land in slots of one span with layouts that differ "
                f"({[regions.layout for _, regions in spans]}): one turn cannot order them"
            )
        return links, ""

    def _refuse(self, o: Load, error: str) -> None:
        """The load cannot be planned: it fails with nothing planned (REFUSED), its
        blocks go back to vLLM as a failed load, the prefill is told."""
        o.error = error
        log.error("request %s: %s", o.rid, error)
        self.driver.feed(o, oc.on_assign(o.book, (WRITER,), granted=False))

    def _try_assign(self, o: Load) -> None:
        try:
            self._assign(o)
        except Exception as exc:  # the load fails through the protocol, never into vLLM
            self.fail_request(o.rid, exc)

    def _assign(self, o: Load) -> None:
        links, err = self._links(o)
        if links is None and not err:
            return  # the handshake is on its way
        if links is None:
            self._refuse(o, err)
            return
        for link in links:
            address = bytes(link.card["address"])
            try:
                link.peer = self.link.peer(address)
            except TransferError as exc:
                # e.g. the prefill was killed after its handshake: its shared-memory
                # segment is gone (UcsShmemSegmentError). Nothing was planned, so nothing
                # can land; the next load asks for the handshake again.
                self.forget_handshake(o.key)
                self.stats.abort(AbortSource.PEER.value)
                self._refuse(
                    o,
                    f"cannot connect to prefill worker tp{link.rank} of engine "
                    f"{o.remote['engine']} (pid {link.card['pid']}): {type(exc).__name__}: {exc}",
                )
                return
            info = decode_address(address)
            link.pid = info.pid  # the process behind the address (the handshake checked the card's)
            link.local = info.same_host(self.me)
        o.links = links
        self.driver.feed(o, oc.on_assign(o.book, tuple(range(len(links))), granted=True))

    def idle_writers(self, o: Load) -> list[bytes]:
        """From decode TP rank 0: the addresses of the prefill workers that write into no
        decode worker (their heads are written by other holders), which hold the prompt's
        blocks all the same and are told so with a PLAN of no heads."""
        hs, _ = self._handshake(o.remote)
        if hs is None or self.tp_rank != 0:
            return []
        try:
            prefill, decode = self._shapes(hs)
            writing = {p for p, _ in pairs(prefill, decode)}
        except LayoutError:
            return []
        return [
            bytes(card["address"]) for p, card in sorted(hs["workers"].items()) if p not in writing
        ]

    def abort_writers(self, o: Load, source: AbortSource, reason: str) -> None:
        """ABORT to the prefill workers of a load that was never planned: those that
        would write into this worker, and (from TP rank 0) those that write into none
        (they hold the prompt's blocks too). Waits for the prefill's handshake if it is
        on its way."""
        hs = self.handshakes.get(o.key)
        if hs is None:
            if o.key not in self.handshake_errors:
                self.fetcher.ask(o.key)
                self._pending_aborts.append((o, source, reason))
            return
        if hs.get("engine_id") != o.remote.get("engine"):
            return  # the prompt's engine is gone (another answers there): none to tell
        try:
            prefill, decode = self._shapes(hs)
            ranks = writers_of(prefill, decode, self.tp_rank)
            if self.tp_rank == 0:
                writing = {p for p, _ in pairs(prefill, decode)}
                ranks += [p for p in range(prefill.tp) if p not in writing]
        except LayoutError:  # engines that cannot pair: every worker of the same rank
            ranks = [self.tp_rank]
            if self.tp_rank == 0:
                ranks += [r for r in hs["workers"] if r >= self.tp_size]
        payload = self.abort_payload(o.remote["rid"], o.rid, source, reason)
        for r in ranks:
            w = hs["workers"].get(r)
            if w is not None:
                self.link.send_to(bytes(w["address"]), payload, o.rid)
