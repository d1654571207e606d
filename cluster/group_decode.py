"""Decode groups that split the KV heads of a model whose layers mix them (Llama).

Each member of a decode group holds a share of the KV heads in a pool of its own and owns
its pages (I4 and I5 are each member's, as for any owner). A Llama layer's output reads
every head's attention, so the group steps together:

- the lead (the group's first member, ``rid`` itself) runs the model
  (:meth:`~kvferry.engine.llama.LlamaModel.decode_layers`). At each layer it sends each
  other member an ATTEND with the query of that member's heads and the new token's K/V
  for them, then computes its own heads' attention over its pages while they compute
  theirs;
- a member checks that each request named is one of its own, decoding, led by the
  sender and at the position it expects, writes the K/V into its pages and attends over
  them (:func:`~kvferry.engine.headgroup.attend_held`, the page ownership check first),
  and answers ATTENDED; a request it cannot attend is named in ``failed`` with the reason;
- the lead puts the layer together (:func:`~kvferry.engine.headgroup.combine`) and goes
  on. After the last layer its tokens go to the router as any owner's do, and to every
  member (STEPPED), which reports them too: the router's group answer takes a token once
  every member has it, the same.

A member sends MEMBER_READY once its pages are verified; the lead steps a request only
once every member of its group is ready. Every wait has an end: a member that does not
answer a layer within the reply deadline fails the step's requests at the lead, and any
member's failure ends the whole group through the router (``GroupAnswer``). The step's
compute runs on the rank's step thread like any step (:mod:`.stepping`); between layers
the step waits on the loop, its requests pinned, without holding the thread, and a rank
with a group's message due polls rather than sleeps (a wake-up a layer would be most of
the step's cost).
"""

from __future__ import annotations

import collections
import functools
import itertools
import logging
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvferry.engine.headgroup import HeldHeads, LayerQuery, attend_held, combine
from kvferry.engine.protocol.owner import OwnerState
from kvferry.engine.protocol.words import Kind
from kvferry.transfer.wire import Message

from . import messages as m
from .decode_path import StepPlan
from .topology import HeadSplit

log = logging.getLogger("kvferry.cluster")

SLOWER_MEMBER_FACTOR = 4.0  # a member's share may take this many times the lead's own
EARLY_READY_KEPT = 4096  # MEMBER_READYs kept for requests whose ASSIGN is not here yet


class GroupStepError(RuntimeError):
    """A decode group's step failed: a member did not answer in time, or answered wrong."""


class Waiting:
    """What a group step's compute returns while it waits for its members' shares."""


WAITING = Waiting()


@dataclass
class Group:
    """A request's decode group, as its ASSIGN named it: each member's request id and
    rank in group order, and this rank's position; the lead counts its ready members."""

    rids: list[str]
    ranks: list[int]
    position: int
    ready: set[int] = field(default_factory=set)
    next_layer: int = 0  # a member: the layer its lead asks next at this position

    @property
    def lead_rank(self) -> int:
        return self.ranks[0]

    @property
    def lead_rid(self) -> str:
        return self.rids[0]

    @property
    def is_lead(self) -> bool:
        return self.position == 0

    @property
    def all_ready(self) -> bool:
        return len(self.ready) == len(self.ranks)


@dataclass
class GroupStep:
    """The lead's step in flight. ``layers`` is the model's step, ``query`` the layer it
    asked for; ``own`` the lead's share of it (None: still to compute, which the lead does
    while its members compute theirs), ``replies`` the members' (by position), ``waiting``
    the members not answered yet, ``dropped`` the batch's requests a member could not
    attend (index -> why). ``running``: a part of it computes now (possibly on the step
    thread), so its end waits for that part (``failure``: why it ends then)."""

    number: int
    plan: StepPlan
    layers: Generator[LayerQuery, torch.Tensor, torch.Tensor] | None = None
    query: LayerQuery | None = None
    own: torch.Tensor | None = None
    own_s: float = 0.0
    asked_at: float = 0.0  # when the members were asked for the layer (the rank's clock)
    deadline_s: float = 0.0  # their reply's deadline, from asked_at
    replies: dict[int, torch.Tensor] = field(default_factory=dict)
    waiting: set[int] = field(default_factory=set)
    dropped: dict[int, str] = field(default_factory=dict)
    timer: Any = None
    running: bool = False
    failure: BaseException | None = None

    @property
    def batch(self) -> list[Any]:
        return self.plan.batch

    @property
    def ready(self) -> bool:
        """A part can compute now: the first layer, the lead's own share of the asked
        layer, or the next layer once every member's share of this one is here."""
        if self.running or self.failure is not None:
            return False
        return self.query is None or self.own is None or not self.waiting


@dataclass
class AttendJob:
    """A member's share of one layer of its lead's step, checked: ``rids`` the ATTEND's
    request ids in its order (echoed in the reply), ``rows`` the entries it attends
    (``batch``, its own requests), ``failed`` the others' request ids with the reason."""

    lead: int
    step: int
    layer: int
    rids: list[str]
    rows: list[int]
    batch: list[Any]
    share: LayerQuery
    positions: torch.Tensor
    failed: dict[str, str]
    table: torch.Tensor | None = None

    def keep(self, kept: list[int]) -> None:
        """Only the entries of ``batch`` (and ``rows``) at ``kept`` are attended."""
        self.rows = [self.rows[i] for i in kept]
        self.batch = [self.batch[i] for i in kept]


def _to_bytes(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()


def _from_bytes(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    expected = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    if len(data) != expected:
        raise ValueError(f"{len(data)} bytes, expected {expected} for {shape} {dtype}")
    return torch.frombuffer(bytearray(data), dtype=dtype).view(shape)


class GroupDecode:
    """A decode rank's part in decode groups that split a head-mixing model's heads: the
    lead's steps and a member's shares (see the module's docstring). ``owner`` is the
    :class:`~.decode.DecodeRank`; ``reply_s`` the least time a member has for a layer."""

    def __init__(self, owner: Any, split: HeadSplit, position: int, reply_s: float) -> None:
        self.owner = owner
        self.path = owner.path
        self.rt = owner.rt
        self.model = self.path.model
        self.kv_heads = split.kv_heads
        group = self.model.q_heads // self.model.kv_heads
        self.held = [HeldHeads(*split.owner_heads(p), group) for p in range(split.decode_tp)]
        # the most requests one step may hold: every member's query share fits an ATTEND
        widest = max((h.hi - h.lo) * group for h in self.held)
        per_request = (
            widest * self.model.head_dim * torch.empty((), dtype=self.model.dtype).element_size()
        )
        self.batch_cap = max(1, min(m.MAX_GROUP_BATCH, m.MAX_SHARE_BYTES // per_request))
        self.position = position
        self.reply_s = reply_s
        self.own_s_by_layer: dict[int, float] = {}  # the lead's own share, by layer, last timed
        self.step: GroupStep | None = None
        self.jobs: collections.deque[AttendJob] = collections.deque()
        # request id -> (member position, sender rank) of each MEMBER_READY before its ASSIGN
        self.early_ready: collections.OrderedDict[str, set[tuple[int, int]]] = (
            collections.OrderedDict()
        )
        self._numbers = itertools.count(1)
        self.handlers = {
            Kind.MEMBER_READY: self._on_ready,
            Kind.ATTEND: self._on_attend,
            Kind.ATTENDED: self._on_attended,
            Kind.STEPPED: self._on_stepped,
        }

    # -------------------------------------------------------------- membership
    def join(self, req: Any, msg: Message) -> str | None:
        """``req``'s group from its ASSIGN, or why the ASSIGN cannot be this rank's."""
        rids, ranks = msg.group_rids, msg.group_ranks
        if not rids or ranks is None:
            return (
                "a decode group that splits the heads of a model mixing them needs its "
                "members named in the ASSIGN (group_rids, group_ranks)"
            )
        if len(rids) != len(ranks) or len(ranks) != len(self.held):
            return (
                f"the ASSIGN names {len(rids)} member requests on ranks {ranks}; this "
                f"group has {len(self.held)} members"
            )
        if len(set(ranks)) != len(ranks) or ranks[self.position] != self.rt.rank:
            return (
                f"the ASSIGN's group ranks {ranks} do not put this rank ({self.rt.rank}) at "
                f"its position {self.position}"
            )
        if rids[self.position] != req.rid:
            return f"the ASSIGN's group names {rids[self.position]!r} at this rank's position"
        req.group = Group(list(rids), list(ranks), self.position)
        if req.group.is_lead:
            for member, src in self.early_ready.pop(req.rid, set()):
                if 0 < member < len(ranks) and ranks[member] == src:
                    req.group.ready.add(member)
        return None

    def decoding(self, req: Any) -> None:
        """``req`` reached DECODING here: the lead counts itself ready, a member tells its
        lead."""
        group = req.group
        if group is None:
            return
        if group.is_lead:
            group.ready.add(0)
        else:
            self.rt.send(group.lead_rank, m.MEMBER_READY, rid=group.lead_rid, member=group.position)

    def _on_ready(self, msg: Message) -> None:
        req = self.owner.reqs.get(msg.rid)
        if req is None:
            if msg.rid not in self.owner.tombstones:  # the ASSIGN is still on its way
                self.early_ready.setdefault(msg.rid, set()).add((msg.member, msg.src))
                while len(self.early_ready) > EARLY_READY_KEPT:
                    self.early_ready.popitem(last=False)
            return
        group = req.group
        if group is None or not group.is_lead or not 0 < msg.member < len(group.ranks):
            log.warning(
                "request %s: MEMBER_READY %d from rank %d dropped", msg.rid, msg.member, msg.src
            )
            return
        if group.ranks[msg.member] != msg.src:
            log.warning(
                "request %s: MEMBER_READY for member %d from rank %d, not its rank %d",
                msg.rid,
                msg.member,
                msg.src,
                group.ranks[msg.member],
            )
            return
        group.ready.add(msg.member)

    def batch(self, decoding: list[Any], limit: int) -> list[Any]:
        """Of ``decoding`` (this rank's decoding requests), the next step's: requests this
        rank leads whose whole group is ready, all of one group of ranks, at most
        ``limit`` (and :attr:`batch_cap`). A member never steps its requests itself (its
        lead asks it for each layer)."""
        led = [r for r in decoding if r.group is not None and r.group.is_lead and r.group.all_ready]
        if not led:
            return []
        ranks = led[0].group.ranks
        return [r for r in led if r.group.ranks == ranks][: min(limit, self.batch_cap)]

    # -------------------------------------------------------------- the rank's steps
    def busy(self) -> bool:
        """A member's share to compute, or the lead's step to go on with."""
        return bool(self.jobs) or (self.step is not None and self.step.ready)

    def awaiting(self) -> bool:
        """A peer's message is due: the lead's step waits for its members, or this rank
        has requests decoding in a group (a member's lead asks at every layer)."""
        return self.step is not None or any(
            r.group is not None and r.state is OwnerState.DECODING for r in self.owner.reqs.values()
        )

    def waiting(self) -> bool:
        """The lead's step waits for its members: no other step starts meanwhile."""
        return self.step is not None

    def next_work(self) -> GroupStep | AttendJob | None:
        """A member's share, checked and pinned, or the lead's step once its members
        answered; None when neither."""
        while self.jobs:
            job = self._checked(self.jobs.popleft())
            if job is not None:
                return job
        if self.step is not None and self.step.ready and self.step.query is not None:
            self.step.running = True
            return self.step
        return None

    def start(self, plan: StepPlan) -> GroupStep:
        """The lead's new step over ``plan`` (its requests pinned by the caller)."""
        self.step = GroupStep(next(self._numbers), plan, running=True)
        return self.step

    def run(self, work: GroupStep | AttendJob) -> list[int] | Waiting | torch.Tensor:
        """The compute (any thread): a part of the lead's step (its own share of the asked
        layer, or the model to its next layer's query, both WAITING, or to its tokens);
        a member's share of a layer."""
        with torch.no_grad():
            if isinstance(work, AttendJob):
                return self._attend(work)
            return self._advance(work)

    def end(self, work: GroupStep | AttendJob, out: Any, error: BaseException | None) -> None:
        """On the loop's thread, after :meth:`run`."""
        if isinstance(work, AttendJob):
            self._answer(work, out, error)
            return
        work.running = False
        error = error or work.failure
        if error is None and isinstance(out, Waiting):
            if work.own is not None:
                self._measured(work)
                return  # its own share is in; the members' come as ATTENDED
            try:
                self._ask(work)  # the members compute theirs while it computes its own
                return
            except Exception as exc:  # e.g. a share that does not fit a message
                error = exc
        self._close(work)
        if error is not None:
            self.owner.fail_step(work.batch, error)
            return
        self._apply(work, out)

    def _fail(self, gs: GroupStep, error: BaseException) -> None:
        """End ``gs`` with ``error``: now, or when the part computing now returns (its
        requests stay pinned until then: it may be writing into their pages)."""
        if gs.running:
            gs.failure = gs.failure or error
            return
        self._close(gs)
        self.owner.fail_step(gs.batch, error)

    # -------------------------------------------------------------- the lead
    def _advance(self, gs: GroupStep) -> list[int] | Waiting:
        """The step's next part: the lead's own share of the asked layer, or the model up
        to its next layer's query (to ask the members: WAITING) or to its tokens."""
        plan = gs.plan
        assert plan.table is not None and plan.positions is not None  # a path's plan_step
        if gs.query is not None and gs.own is None:
            started = self.owner.clock.now()
            layer = gs.query.layer
            gs.own = attend_held(
                self.path.pool.kv,
                self.held[self.position].share(gs.query),
                plan.table,
                plan.positions,
                plan.step_args.get("ownership") if layer == 0 else None,
            )
            gs.own_s = self.owner.clock.now() - started
            self.own_s_by_layer[layer] = gs.own_s
            return WAITING
        if gs.layers is None:
            if self.rt.faults.enabled:
                self.rt.faults.before_decode_step(plan.labels)
            gs.layers = self.model.decode_layers(plan.positions, plan.inputs)
            query = next(gs.layers)
        else:
            assert gs.own is not None
            shares = [
                (held, gs.own if p == self.position else gs.replies[p])
                for p, held in enumerate(self.held)
            ]
            try:
                query = gs.layers.send(combine(shares, self.kv_heads))
            except StopIteration as end:
                tokens: list[int] = end.value.argmax(dim=-1).tolist()
                return tokens
        gs.query, gs.own = query, None
        return WAITING

    def _ask(self, gs: GroupStep) -> None:
        """Send each member its share of the layer asked; the reply deadline starts."""
        assert gs.query is not None and gs.plan.positions is not None
        positions = gs.plan.positions.numpy().astype(np.int64)
        gs.replies, gs.waiting = {}, set()
        groups = [r.group for r in gs.batch]
        for p, held in enumerate(self.held):
            if p == self.position:
                continue
            share = held.share(gs.query)
            gs.waiting.add(p)
            self.rt.send(
                groups[0].ranks[p],
                m.ATTEND,
                step=gs.number,
                layer=gs.query.layer,
                rids=[g.rids[p] for g in groups],
                positions=positions,
                q=_to_bytes(share.q),
                k=_to_bytes(share.k),
                v=_to_bytes(share.v),
            )
        # the lead's own share of this layer at its last step (a step's first layer reads
        # every page's canaries too): the deadline grows once this one's is timed
        expected = self.own_s_by_layer.get(gs.query.layer, gs.own_s)
        gs.asked_at = self.owner.clock.now()
        self._arm(gs, self.reply_s + SLOWER_MEMBER_FACTOR * expected)

    def _arm(self, gs: GroupStep, deadline_s: float) -> None:
        """The members' reply is due ``deadline_s`` after the ask."""
        gs.deadline_s = deadline_s
        left = max(0.0, gs.asked_at + deadline_s - self.owner.clock.now())
        gs.timer = self.rt.call_later(left, functools.partial(self._expired, gs))

    def _measured(self, gs: GroupStep) -> None:
        """The lead's own share of the asked layer is in: a member has ``reply_s`` plus
        :data:`SLOWER_MEMBER_FACTOR` times it from the ask, where that is later than the
        deadline set when asking."""
        wanted = self.reply_s + SLOWER_MEMBER_FACTOR * gs.own_s
        if not gs.waiting or gs.timer is None or wanted <= gs.deadline_s:
            return
        gs.timer.cancel()
        self._arm(gs, wanted)

    def _expired(self, gs: GroupStep) -> None:
        if self.step is not gs or not gs.waiting:
            return
        assert gs.query is not None
        ranks = sorted(gs.batch[0].group.ranks[p] for p in gs.waiting)
        self._fail(
            gs,
            GroupStepError(
                f"decode group step {gs.number}: member ranks {ranks} sent no attention for "
                f"layer {gs.query.layer} within {gs.deadline_s:.1f} s"
            ),
        )

    def _on_attended(self, msg: Message) -> None:
        gs = self.step
        if gs is None or gs.number != msg.step or gs.query is None or gs.query.layer != msg.layer:
            return  # a step that already ended (failed, or its deadline passed)
        ranks = gs.batch[0].group.ranks
        p = ranks.index(msg.src) if msg.src in ranks else -1
        if p not in gs.waiting:
            return
        asked = [r.group.rids[p] for r in gs.batch]
        if list(msg.rids) != asked:  # an answer to another lead's step of this number
            log.warning(
                "decode group step %d: ATTENDED of rank %d for layer %d names requests %s, "
                "not this step's %s; ignored",
                gs.number, msg.src, msg.layer, list(msg.rids)[:8], asked[:8],
            )  # fmt: skip
            return
        held = self.held[p]
        shape = (len(gs.batch), (held.hi - held.lo) * held.group, self.model.head_dim)
        mine = {r.group.rids[p]: i for i, r in enumerate(gs.batch)}
        failed = self._failures_named(msg.failed, mine)
        for rid in failed:
            i = mine.get(rid)
            if i is not None:
                gs.dropped.setdefault(
                    i, f"decode group member rank {msg.src} could not attend {rid}: {msg.error}"
                )
        try:
            if len(failed) >= len(gs.batch) and not msg.out:
                out = torch.zeros(shape, dtype=self.model.dtype)
            else:
                out = _from_bytes(msg.out, self.model.dtype, shape)
        except ValueError as exc:
            gs.waiting.discard(p)
            self._fail(
                gs,
                GroupStepError(
                    f"decode group step {gs.number}: member rank {msg.src}'s attention for "
                    f"layer {msg.layer}: {exc}"
                ),
            )
            return
        gs.replies[p] = out
        gs.waiting.discard(p)
        if not gs.waiting and gs.timer is not None:
            gs.timer.cancel()

    @staticmethod
    def _failures_named(failed: list[str], mine: dict[str, int]) -> set[str]:
        """The requests of this step an ATTENDED names as failed. Others named count for
        nothing: a reply that failed none of the step's requests and carries no attention
        is refused as malformed, not taken as a share of zeros (every member would then
        report the same wrong tokens)."""
        return set(failed) & mine.keys()

    def _close(self, gs: GroupStep) -> None:
        """The step ended (tokens, failure or deadline): its requests unpinned."""
        if gs.timer is not None:
            gs.timer.cancel()
        if self.step is gs:
            self.step = None
        for r in gs.batch:
            self.owner.driver.unpin(r)

    def _apply(self, gs: GroupStep, out: list[int]) -> None:
        """The step's tokens: a request a member could not attend fails; the others' go
        to the router (the path's apply) and to every member."""
        for i, why in gs.dropped.items():
            r = gs.batch[i]
            if r.state is OwnerState.DECODING:
                self.owner.fail_request(r.rid, why)
        before = [len(r.generated) for r in gs.batch]
        self.path.apply_step(gs.plan, out)
        got = [
            (r, r.generated[-1])
            for r, n in zip(gs.batch, before, strict=True)
            if len(r.generated) > n
        ]
        if not got:
            return
        for p in range(len(self.held)):
            if p == self.position:
                continue
            self.rt.send(
                got[0][0].group.ranks[p],
                m.STEPPED,
                rids=[r.group.rids[p] for r, _ in got],
                tokens=[int(t) for _, t in got],
            )

    # -------------------------------------------------------------- a member
    def _on_attend(self, msg: Message) -> None:
        """The lead's ATTEND: each request it names checked (one of this rank's, led by
        the sender, decoding, at the position expected), then queued for the step thread."""
        held = self.held[self.position]
        n = len(msg.rids)
        failed: dict[str, str] = {}
        rows: list[int] = []
        batch: list[Any] = []
        dims = (held.hi - held.lo) * held.group, held.hi - held.lo
        try:
            if len(msg.positions) != n:
                raise ValueError(f"{len(msg.positions)} positions for {n} requests")
            dtype, d = self.model.dtype, self.model.head_dim
            share = LayerQuery(
                msg.layer,
                _from_bytes(msg.q, dtype, (n, dims[0], d)),
                _from_bytes(msg.k, dtype, (n, dims[1], d)),
                _from_bytes(msg.v, dtype, (n, dims[1], d)),
            )
            if not 0 <= msg.layer < self.model.layers:
                raise ValueError(f"layer {msg.layer} outside [0, {self.model.layers})")
        except ValueError as exc:
            why = f"ATTEND of rank {msg.src} (step {msg.step}, layer {msg.layer}): {exc}"
            log.error("requests %s: %s", list(msg.rids), why)
            failed = {rid: why for rid in msg.rids}
            self._reply(msg.src, msg.step, msg.layer, list(msg.rids), b"", failed)
            return
        for i, rid in enumerate(msg.rids):
            refused = self._cannot_attend(rid, msg.src, int(msg.positions[i]), msg.layer)
            if refused is None:
                rows.append(i)
                batch.append(self.owner.reqs[rid])
            else:
                failed[rid] = refused
        self.jobs.append(
            AttendJob(
                msg.src,
                msg.step,
                msg.layer,
                list(msg.rids),
                rows,
                batch,
                share,
                torch.from_numpy(np.asarray(msg.positions, dtype=np.int64)),
                failed,
            )
        )

    def _cannot_attend(self, rid: str, lead: int, position: int, layer: int) -> str | None:
        req = self.owner.reqs.get(rid)
        if req is None or req.group is None:
            return f"request {rid} is not decoding in a group on rank {self.rt.rank}"
        if req.group.lead_rank != lead:
            return f"request {rid}: ATTEND from rank {lead}, its lead is rank {req.group.lead_rank}"
        if req.state is not OwnerState.DECODING:
            return f"request {rid} is {req.state.value} on rank {self.rt.rank}, not decoding"
        if position != req.next_position:
            return (
                f"request {rid}: ATTEND at position {position}, rank {self.rt.rank} expects "
                f"{req.next_position}"
            )
        if layer != req.group.next_layer:
            return (
                f"request {rid}: ATTEND for layer {layer} at position {position}, rank "
                f"{self.rt.rank} expects layer {req.group.next_layer}"
            )
        return None

    def _checked(self, job: AttendJob) -> AttendJob | None:
        """``job`` with its requests pinned and, at a step's first layer, every page they
        read checked against their canaries (the torch reference, before the share runs;
        a request that fails is CORRUPT and named in ``failed``): the later layers of the
        step read the same pages, which stay the request's while it decodes, and each
        layer is taken only in order (:meth:`_cannot_attend`). A request is checked again
        as its job is taken, on the thread that pins it: one aborted (or failed) since its
        ATTEND was queued has freed its pages, which may be another request's by now, so
        it goes into ``failed`` and nothing is written for it (I4). None (answered
        already) when no request is left to attend."""
        job.keep([i for i, r in enumerate(job.batch) if self._still_attends(job, job.rows[i], r)])
        table = self.path.page_table(job.batch) if job.batch else None
        if table is not None and self.path.integrity and job.layer == 0:
            kept = self.path.still_owned(job.batch, table)
            if len(kept) < len(job.batch):
                for i, r in enumerate(job.batch):
                    if i not in kept:
                        why = f"page ownership check on rank {self.rt.rank}: {r.error}"
                        job.failed[r.rid] = why
                job.keep(kept)
                table = self.path.page_table(job.batch) if job.batch else None
        if table is None:
            self._reply(job.lead, job.step, job.layer, job.rids, b"", job.failed)
            return None
        job.table = table
        for r in job.batch:
            self.owner.driver.pin(r)
        return job

    def _still_attends(self, job: AttendJob, row: int, req: Any) -> bool:
        """Whether ``req``, accepted when ``job``'s ATTEND came, may still be attended
        (:meth:`_cannot_attend` again, and still this rank's same request); if not, why
        goes into ``job.failed``."""
        why = (
            f"request {req.rid} ended on rank {self.rt.rank} ({req.state.value}) before its "
            f"share of layer {job.layer} of step {job.step} ran"
            if self.owner.reqs.get(req.rid) is not req
            else self._cannot_attend(req.rid, job.lead, int(job.positions[row]), job.layer)
        )
        if why is None:
            return True
        log.warning("request %s: %s", req.rid, why)
        job.failed[req.rid] = why
        return False

    def _attend(self, job: AttendJob) -> torch.Tensor:
        assert job.table is not None
        if self.rt.faults.enabled:  # a member's share is its part of the group's step
            self.rt.faults.before_decode_step([f"prompt_len={r.prompt_len}" for r in job.batch])
        rows = torch.tensor(job.rows, dtype=torch.int64)
        share = LayerQuery(job.layer, job.share.q[rows], job.share.k[rows], job.share.v[rows])
        got = attend_held(self.path.pool.kv, share, job.table, job.positions[rows])
        out = torch.zeros((job.share.q.shape[0], *got.shape[1:]), dtype=got.dtype)
        out[rows] = got.to("cpu")
        return out

    def _answer(self, job: AttendJob, out: Any, error: BaseException | None) -> None:
        for r in job.batch:
            self.owner.driver.unpin(r)
            if error is None:
                r.group.next_layer = job.layer + 1
        if error is not None:
            why = f"attention on rank {self.rt.rank} failed: {type(error).__name__}: {error}"
            log.error("requests %s: %s", [r.rid for r in job.batch], why, exc_info=error)
            job.failed.update({r.rid: why for r in job.batch})
            self._reply(job.lead, job.step, job.layer, job.rids, b"", job.failed)
            return
        self._reply(job.lead, job.step, job.layer, job.rids, _to_bytes(out), job.failed)

    def _reply(
        self, lead: int, step: int, layer: int, rids: list[str], out: bytes, failed: dict[str, str]
    ) -> None:
        error = "; ".join(f"{rid}: {why}" for rid, why in failed.items())
        self.rt.send(
            lead,
            m.ATTENDED,
            step=step,
            layer=layer,
            rids=rids,
            out=out,
            failed=list(failed),
            error=error or None,
        )

    def _out_of_step(self, req: Any, lead: int) -> str | None:
        """Why a STEPPED of ``lead`` cannot carry ``req``'s token: this rank has not
        attended every layer of the step (None: it has)."""
        if req.group.next_layer == self.model.layers:
            return None
        return (
            f"STEPPED of lead rank {lead} at position {req.next_position}, but rank "
            f"{self.rt.rank} attended {req.group.next_layer} of the step's "
            f"{self.model.layers} layers"
        )

    def _on_stepped(self, msg: Message) -> None:
        """The lead's tokens of a step: each of this rank's requests in it reports its
        token as its own (its position moves on), once it has attended every layer of
        that step. A STEPPED for a request that has not (a lead out of step with this
        member) fails the request: its token is of a step this rank never computed, and
        the router, which compares the members' tokens, would see the lead's echoed."""
        if len(msg.tokens) != len(msg.rids):
            log.error(
                "requests %s: STEPPED of rank %d has %d tokens for %d requests; ignored (they "
                "end at the router's request timeout)",
                list(msg.rids)[:16],
                msg.src,
                len(msg.tokens),
                len(msg.rids),
            )
            return
        for rid, token in zip(msg.rids, msg.tokens, strict=True):
            req = self.owner.reqs.get(rid)
            if req is None or req.group is None or req.group.lead_rank != msg.src:
                continue
            if req.state is not OwnerState.DECODING:
                continue
            why = self._out_of_step(req, msg.src)
            if why is not None:
                log.error("request %s: %s", rid, why)
                self.rt.run_for(
                    rid, "a STEPPED", functools.partial(self.owner.fail_request, rid, why)
                )
                continue
            req.group.next_layer = 0  # the next step starts at the next position
            self.path.emit(req, int(token))
