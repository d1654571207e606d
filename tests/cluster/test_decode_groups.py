"""A prefill group of ``tp`` writing into a decode group of ``decode_tp`` members, against
recording runtimes, no processes: each member holds its share of the KV heads in a pool
of its own and owns a request of its own (``rid.j``) with the writers that hold its
heads; every member's I5 checks pass on the bytes that landed and each decodes the
prompt back, so the group's combined answer is the monolithic replay. All nine pairs of
{1, 2, 4}, with heads that split evenly, unevenly and as replicas, and page sizes that
differ; and with the KV replicated across TP (MLA-style: every member holds every head
and takes it all from one writer), where the llama model decodes in every member and
its answer is the monolithic engine's. Dispatched as the router does, a writer into
several members computes and holds the prompt once for all of them, and frees it only
after the last member's notice flushed (I4). Broken modes: a writer that writes as if the
member held every head is caught by the member's checks before decode reads a page; with
replicated KV, a writer that writes an owner it was not assigned is refused by the owner
before it plans a page; a writer that frees the shared pages at the first member's end
is caught while the second member's writes are in flight."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from test_protocol_units import RecordingRuntime, TimedRuntime, _card

from kvferry.cluster import messages as m
from kvferry.cluster import prefill_path
from kvferry.cluster.decode import DecodeRank, OwnerState
from kvferry.cluster.launch import write_routes
from kvferry.cluster.prefill import PrefillRank
from kvferry.cluster.topology import HeadSplit, Topology
from kvferry.engine.models import LlamaConfig, LlamaModel, ReplayConfig, ReplayModel
from kvferry.engine.monolithic import MonolithicEngine
from kvferry.engine.pool import KVPool
from kvferry.engine.reshard import Order

PROMPT = 100
STEPS = 6
PAIRS = [(tp, dtp) for tp in (1, 2, 4) for dtp in (1, 2, 4)]


def _model(kv_heads: int, llama: bool):
    if llama:
        config = LlamaConfig(layers=2, q_heads=max(4, 2 * kv_heads), kv_heads=kv_heads, head_dim=32)
        return LlamaModel(config)
    return ReplayModel(
        ReplayConfig(layers=2, kv_heads=kv_heads, q_per_kv=2, head_dim=32, max_positions=4096)
    )


@dataclasses.dataclass
class Group:
    topology: Topology
    split: HeadSplit
    writers: dict[int, tuple[PrefillRank, RecordingRuntime]]
    owners: dict[int, tuple[DecodeRank, TimedRuntime]]
    prefills: dict[int, int]  # by writer rank: the prefills its model ran
    noticed: set[tuple[int, str]] = dataclasses.field(default_factory=set)  # delivered


def _counted(model, prefills: dict[int, int], rank: int):
    """``model``, its prefills counted in ``prefills[rank]``."""
    run = model.prefill_layers

    def prefill_layers(*args, **kwargs):
        prefills[rank] += 1
        return run(*args, **kwargs)

    model.prefill_layers = prefill_layers
    return model


def _group(
    tp: int,
    decode_tp: int,
    kv_heads: int,
    src_page: int,
    dst_page: int,
    replicated: bool = False,
    llama: bool = False,
    *,
    writer_runtime=RecordingRuntime,
    prefill_slice_s: float = prefill_path.PREFILL_SLICE_S,
    orders: tuple[Order, Order] = (Order.HND, Order.HND),
) -> Group:
    t = Topology(1 + tp + decode_tp, tp, decode_tp, tp=tp, decode_tp=decode_tp)
    src_layout, dst_layout = (o.value for o in orders)
    cards = {
        r: dataclasses.replace(_card(r, "prefill"), page_size=src_page, kv_layout=src_layout)
        for r in t.prefill_ranks
    }
    cards |= {
        r: dataclasses.replace(_card(r, "decode"), page_size=dst_page, kv_layout=dst_layout)
        for r in t.decode_ranks
    }
    split = t.split(kv_heads, replicated)
    writers, owners, prefills = {}, {}, dict.fromkeys(t.prefill_ranks, 0)
    for i, rank in enumerate(t.prefill_ranks):
        rt = writer_runtime(rank, cards)
        model = _counted(_model(kv_heads, llama), prefills, rank)
        writers[rank] = (
            PrefillRank.serving(
                rt,
                model,
                KVPool(dataclasses.replace(model.pool_config(src_page, 64), order=orders[0])),
                None,
                split.writer_heads(i),
                router=0,
                routes=write_routes(t, split, i),
                prefill_slice_s=prefill_slice_s,
            ),
            rt,
        )
    for j, rank in enumerate(t.decode_ranks):
        rt = TimedRuntime(rank)
        rt.cards = cards
        lo, hi = split.owner_heads(j)
        # the replay model is built for the member's heads; llama whole, its pool the share
        model = _model(kv_heads, llama) if llama else _model(hi - lo, llama)
        config = model.pool_config(dst_page, 64)
        owners[rank] = (
            DecodeRank.serving(
                rt,
                model,
                KVPool(dataclasses.replace(config, order=orders[1], kv_heads=hi - lo), zero=True),
                router=0,
                transfer_timeout_s=5.0,
                abort_deadline_s=1.0,
                prefill_tp=tp,
                decode_member=(split, j),
            ),
            rt,
        )
    return Group(t, split, writers, owners, prefills)


def _prompt() -> np.ndarray:
    return (np.arange(PROMPT) * 7 % 251).astype("<i4")  # inside every vocabulary


def _serve(g: Group, writers_of=None) -> dict[int, str]:
    """Every member's request through ASSIGN, PLAN, PREFILL, the writes landing and the
    notices; the member's request id by owner rank. ``writers_of(position)``: the writer
    positions the router lists for a member (default the split's)."""
    tokens = _prompt()
    group = g.topology.prefill_groups[0]
    writers_of = writers_of or g.split.writers_of
    rids = {}
    for j, owner_rank in enumerate(g.topology.decode_groups[0]):
        rid = "r" if j == 0 else f"r.{j}"
        rids[owner_rank] = rid
        owner, ort = g.owners[owner_rank]
        writers = [group[w] for w in writers_of(j)]
        ort.deliver(
            m.ASSIGN, src=0, rid=rid, prompt_len=PROMPT, max_tokens=STEPS, writers=writers,
            last_token=int(tokens[-1]), **_group_fields(g),
        )  # fmt: skip
        plan = next((f for _, k, f in ort.sent if k == "PLAN" and f["rid"] == rid), None)
        if plan is None:  # refused before any page was planned
            continue
        for w in writers:
            writer, wrt = g.writers[w]
            wrt.deliver(m.PLAN, src=owner_rank, **plan)
            wrt.deliver(
                m.PREFILL, src=0, rid=rid, tokens=tokens.tobytes(), offset=0, total=PROMPT,
                owner=owner_rank, owner_inc=1,
            )  # fmt: skip
            for _ in range(50):
                wrt.pump()
            _copy_writes(writer, wrt, owner, owner_rank)
            for _, kind, fields in wrt.sent:
                if kind == "NOTICE" and fields["rid"] == rid:
                    ort.deliver(m.NOTICE, src=w, **fields)
        ort.pump()
    return rids


def _group_fields(g: Group) -> dict:
    """ASSIGN's naming of the decode group, as the router sends it to every member."""
    ranks = g.topology.decode_groups[0]
    if len(ranks) == 1:
        return {}
    rids = ["r" if j == 0 else f"r.{j}" for j in range(len(ranks))]
    return {"group_rids": rids, "group_ranks": list(ranks)}


def _copy_writes(writer: PrefillRank, wrt: RecordingRuntime, owner: DecodeRank, rank: int) -> None:
    """The bytes of every write ``writer`` posted into owner ``rank``'s pool, copied."""
    src = writer.pool.storage.reshape(-1).view(torch.uint8)
    dst = owner.pool.storage.reshape(-1).view(torch.uint8)
    for to, triples in wrt.writes:
        if to == rank:
            for s, d, n in np.asarray(triples).tolist():
                dst[d : d + n] = src[s : s + n]
    wrt.writes = [x for x in wrt.writes if x[0] != rank]


def _dispatch(g: Group) -> dict[int, str]:
    """What the router sends, in its order: per member, ASSIGN to its owner (whose PLAN
    goes to its writers) and PREFILL to its writers, naming the first member a writer
    writes into as the id it holds the prompt under; no writer has run yet. The member's
    request id by owner rank."""
    tokens = _prompt()
    group = g.topology.prefill_groups[0]
    rids: dict[int, str] = {}
    shares: dict[int, str] = {}
    for j, owner_rank in enumerate(g.topology.decode_groups[0]):
        rid = rids[owner_rank] = "r" if j == 0 else f"r.{j}"
        _, ort = g.owners[owner_rank]
        writers = [group[w] for w in g.split.writers_of(j)]
        ort.deliver(
            m.ASSIGN, src=0, rid=rid, prompt_len=PROMPT, max_tokens=STEPS, writers=writers,
            last_token=int(tokens[-1]), **_group_fields(g),
        )  # fmt: skip
        plan = next(f for _, k, f in ort.sent if k == "PLAN" and f["rid"] == rid)
        for w in writers:
            share = shares.setdefault(w, rid)
            _, wrt = g.writers[w]
            wrt.deliver(m.PLAN, src=owner_rank, **plan)
            wrt.deliver(
                m.PREFILL, src=0, rid=rid, tokens=tokens.tobytes(), offset=0, total=PROMPT,
                owner=owner_rank, owner_inc=1, share=share,
            )  # fmt: skip
    return rids


def _land(g: Group, owner_rank: int) -> None:
    """The writes every writer posted into ``owner_rank``'s pool land (copied), then the
    notices they sent it arrive, and the owner runs."""
    owner, ort = g.owners[owner_rank]
    for w, (writer, wrt) in g.writers.items():
        _copy_writes(writer, wrt, owner, owner_rank)
        if hasattr(wrt, "land"):
            wrt.land(owner_rank)
        for rank, kind, fields in wrt.sent:
            if rank == owner_rank and kind == "NOTICE" and (w, fields["rid"]) not in g.noticed:
                g.noticed.add((w, fields["rid"]))
                ort.deliver(m.NOTICE, src=w, **fields)
    ort.pump()


def _serve_together(g: Group) -> dict[int, str]:
    """The router's dispatch (:func:`_dispatch`), then the writers run, then each owner's
    writes land in turn."""
    rids = _dispatch(g)
    for _, wrt in g.writers.values():
        wrt.pump()
    for owner_rank in g.topology.decode_groups[0]:
        _land(g, owner_rank)
    return rids


def _answers(g: Group, rids: dict[int, str]) -> list[list[int]]:
    answers = []
    for owner_rank, (owner, ort) in g.owners.items():
        assert owner.reqs[rids[owner_rank]].state is OwnerState.DECODING, owner.reqs
        for _ in range(STEPS):
            owner.step()
        answers.append([t for _, k, f in ort.sent if k == "TOKENS" for t in f["tokens"]])
    return answers


def _written(g: Group) -> int:
    return sum(f["bytes"] for _, rt in g.writers.values() for _, k, f in rt.sent if k == "NOTICE")


@pytest.mark.parametrize("tp, decode_tp", PAIRS)
@pytest.mark.parametrize("kv_heads", [4, 3, 2])
@pytest.mark.parametrize("src_page, dst_page", [(16, 16), (32, 16), (16, 64)])
@pytest.mark.parametrize("serve", ["one by one", "together", "together, sliced"])
def test_every_member_verifies_and_decodes_its_share(
    tp, decode_tp, kv_heads, src_page, dst_page, serve
):
    """``one by one``: each member served to its end before the next is dispatched (a
    writer's later member finds its first one's pages freed and computes again);
    ``together``: as the router dispatches, every member's PREFILL before a writer runs
    (a later member joins a prefill that has ended); ``sliced``: a prefill that yields
    after every step (a later member joins it while it runs). Dispatched together, every
    writer computes the prompt once, whatever number of members it writes into."""
    sliced = serve == "together, sliced"
    g = _group(tp, decode_tp, kv_heads, src_page, dst_page, prefill_slice_s=0.0 if sliced else 1)
    answers = _answers(g, _serve(g) if serve == "one by one" else _serve_together(g))
    assert answers == [_prompt()[:STEPS].tolist()] * decode_tp  # the monolithic replay
    if serve != "one by one":
        assert set(g.prefills.values()) <= {0, 1}, g.prefills
    for writer, _ in g.writers.values():
        assert writer.allocator.free_pages == writer.pool.num_pages  # every hold ended
    # whole pages when both sides have one page size, else the prompt's tokens as runs
    slots = PROMPT if src_page != dst_page else -(-PROMPT // src_page) * src_page
    assert _written(g) == slots * 2 * 2 * 32 * 4 * sum(
        hi - lo for lo, hi in map(g.split.owner_heads, range(decode_tp))
    )  # each member's heads once: tokens x layers x K/V x dim x fp32


H, N = Order.HND, Order.NHD


@pytest.mark.parametrize("tp, decode_tp", [(1, 2), (2, 1), (2, 2), (4, 2), (2, 4)])
@pytest.mark.parametrize("kv_heads", [4, 3])
@pytest.mark.parametrize("orders", [(H, N), (N, H), (N, N)], ids=["HND-NHD", "NHD-HND", "NHD-NHD"])
@pytest.mark.parametrize("src_page, dst_page", [(16, 16), (32, 16)])
def test_every_member_verifies_and_decodes_its_share_across_layouts(
    tp, decode_tp, kv_heads, orders, src_page, dst_page
):
    """Token-major pages on either side of a split. Of one page size, each writer sends
    its heads of whole pages laid as in its memory, every member checks them as they
    landed and turns them into its order; across page sizes, each writer's runs put its
    heads of every token where the member's memory holds them, and every member checks
    its pages as they lie. Either way the group's answer is the monolithic replay."""
    g = _group(tp, decode_tp, kv_heads, src_page, dst_page, orders=orders)
    answers = _answers(g, _serve_together(g))
    assert answers == [_prompt()[:STEPS].tolist()] * decode_tp
    assert set(g.prefills.values()) <= {0, 1}, g.prefills
    slots = PROMPT if src_page != dst_page else -(-PROMPT // src_page) * src_page
    assert _written(g) == slots * 2 * 2 * 32 * 4 * sum(
        hi - lo for lo, hi in map(g.split.owner_heads, range(decode_tp))
    )  # whole pages or the prompt's tokens as runs, each member's heads once


def _monolithic(kv_heads: int) -> list[int]:
    model = _model(kv_heads, llama=True)
    engine = MonolithicEngine(model, KVPool(model.pool_config(16, 64)), context_length=512)
    (result,) = engine.generate([("r", _prompt().tolist(), STEPS)])
    assert result.ok, result.error
    return result.tokens


@pytest.mark.parametrize("tp, decode_tp", PAIRS)
@pytest.mark.parametrize("llama", [False, True])
def test_replicated_kv_one_writer_per_owner_and_every_member_answers_alone(tp, decode_tp, llama):
    """MLA-style KV (one latent "head", replicated across TP): each decode member takes
    the whole KV from exactly one prefill member; the others write it nothing and it
    waits for none of them. With llama, every member's answer is the monolithic one."""
    g = _group(tp, decode_tp, 1, 16, 16, replicated=True, llama=llama)
    assert all(len(g.split.writers_of(j)) == 1 for j in range(decode_tp))
    answers = _answers(g, _serve(g))
    want = _monolithic(1) if llama else _prompt()[:STEPS].tolist()
    assert answers == [want] * decode_tp
    pages = -(-PROMPT // 16)
    assert _written(g) == decode_tp * pages * 16 * 2 * 2 * 32 * 4  # one copy per owner


@pytest.mark.parametrize("tp, decode_tp", [(1, 2), (2, 4), (4, 2)])
def test_broken_a_writer_that_writes_as_if_the_member_held_every_head_is_caught(
    monkeypatch, tp, decode_tp
):
    monkeypatch.setattr(
        prefill_path.PrefillPath,
        "route",
        lambda self, job: prefill_path.Route(
            self._route_of(job.owner).heads, (0, self.pool.kv_heads)
        ),
    )
    g = _group(tp, decode_tp, 4, 16, 16)
    _serve(g)
    failed = [f for _, (_, ort) in g.owners.items() for _, k, f in ort.sent if k == "DONE"]
    assert failed and all(f["outcome"] == "failed" and "integrity" in f["error"] for f in failed), (
        failed
    )


@pytest.mark.parametrize("tp, decode_tp", [(2, 1), (4, 2)])
def test_broken_every_holder_writing_a_replicated_owner_is_refused_before_a_page(tp, decode_tp):
    """The broken router lists every prefill member as a writer of each owner (each holds
    the replicated KV): the owner refuses the request before it allocates, since it would
    wait for writers that never write (or get every byte twice)."""
    g = _group(tp, decode_tp, 1, 16, 16, replicated=True)
    _serve(g, writers_of=lambda j: list(range(tp)))
    for _, ort in g.owners.values():
        assert not [k for _, k, _ in ort.sent if k == "PLAN"]
        done = [f for _, k, f in ort.sent if k == "DONE"]
        assert done and "writers" in done[0]["error"], done


class _HeldWrites(RecordingRuntime):
    """A writer's runtime whose writes stay in flight until the test lands them (by owner
    rank, :meth:`land`)."""

    def __init__(self, rank: int, cards=None) -> None:
        super().__init__(rank, cards)
        self.in_flight: list[tuple[int, _Pending]] = []

    def write(self, rank, local, pages, rid=None, incarnation=None):
        self.writes.append((rank, np.asarray(pages)))
        batch = _Pending()
        self.in_flight.append((rank, batch))
        return batch

    def watch(self, batch, callback, rid=None) -> None:
        if isinstance(batch, _Pending) and not batch.landed:
            batch.callbacks.append(callback)
        else:
            callback(batch)

    def land(self, rank: int) -> None:
        landing = [b for r, b in self.in_flight if r == rank]
        self.in_flight = [(r, b) for r, b in self.in_flight if r != rank]
        for batch in landing:
            batch.landed = True
            for callback in batch.callbacks:
                callback(batch)
        self.pump()


@dataclasses.dataclass
class _Pending:
    landed: bool = False
    callbacks: list = dataclasses.field(default_factory=list)

    def status(self):
        from kvferry.transfer import BatchStatus

        return BatchStatus.COMPLETED if self.landed else BatchStatus.PENDING

    error = None


def _shared_pages_while_the_second_member_writes() -> tuple[int, int, list[dict]]:
    """One writer into a decode group of two, dispatched together; the first member's
    writes land and its notice flushes (its job is done) while the second member's are
    still in flight. The writer's source pages held then, the prompt's pages, and the
    RELEASED it had sent."""
    g = _group(1, 2, 2, 16, 16, writer_runtime=_HeldWrites)
    (w, (writer, wrt)), = g.writers.items()  # fmt: skip
    _dispatch(g)
    wrt.pump()
    assert g.prefills[w] == 1
    first, second = g.topology.decode_groups[0]
    _land(g, first)
    assert writer.jobs.get("r") is None  # done and forgotten; r.1 writes on
    held = writer.pool.num_pages - writer.allocator.free_pages
    released = [f for _, k, f in wrt.sent if k == "RELEASED"]
    _land(g, second)
    assert writer.allocator.free_pages == writer.pool.num_pages
    answers = _answers(g, {first: "r", second: "r.1"})
    assert answers == [_prompt()[:STEPS].tolist()] * 2
    after = [f for _, k, f in wrt.sent if k == "RELEASED"]
    assert [(f["rid"], f["pages"], f["how"]) for f in after] == [("r", -(-PROMPT // 16), "freed")]
    return held, -(-PROMPT // 16), released


def test_a_members_end_keeps_the_pages_its_siblings_writes_read():
    """I4, writer side, across a decode group: the prompt's pages are computed once and
    held until the last member's notice flushed, then released once, under the id the
    router reserved them under."""
    held, pages, released = _shared_pages_while_the_second_member_writes()
    assert held == pages and released == []


def test_broken_a_source_freed_at_the_first_members_end_is_caught(monkeypatch):
    """Broken mode: the first member's end frees the shared pages (as a source of its own
    per job would) while the second member's writes still read them."""
    from test_shared_source import FreesAtFirstEnd

    from kvferry.cluster.ports import SharedSource

    monkeypatch.setattr(SharedSource, "free", FreesAtFirstEnd.free)
    held, _, released = _shared_pages_while_the_second_member_writes()
    assert held == 0 and [f["rid"] for f in released] == ["r"]  # the safe test's check fails


@pytest.mark.parametrize("kv_heads, decode_tp", [(2, 2), (4, 2), (4, 4), (3, 2)])
def test_a_members_checksums_read_in_place_are_its_views(kv_heads, decode_tp):
    """A writer's checksums for a member that holds exactly the heads it writes are taken
    from the route's runs in place; they equal those of the pool's view of those heads
    (what the owner computes over its pages once they landed)."""
    from kvferry.cluster.prefill import WriteJob
    from kvferry.engine.integrity import page_checksums

    g = _group(1, decode_tp, kv_heads, 16, 16)
    ((writer, _),) = g.writers.values()
    writer.pool.kv.copy_(
        torch.randn(writer.pool.kv.shape, generator=torch.Generator().manual_seed(7))
    )
    for owner_rank in g.topology.decode_groups[0]:
        job = WriteJob("r")
        job.book.owner, job.src_pages = owner_rank, [5, 3, 9, 0, 63]
        route = writer.path.route(job)
        assert route.heads == route.dst_heads != (0, kv_heads)  # the in-place path
        view = writer.path._view(job)
        got = writer.path._checksums(job, 1, 5).tolist()
        assert got == page_checksums(view, [3, 9, 0, 63]).tolist()


class _ErrorsEndRequests(RecordingRuntime):
    """A writer's runtime whose deferred work ends its request on an exception, as the
    rank's runtime does (``RankRuntime.run_for``)."""

    def defer(self, fn, rid=None) -> None:
        def guarded() -> None:
            try:
                fn()
            except RuntimeError as exc:
                self.on_request_error(rid, f"internal error: {exc}")

        self.deferred.append(guarded)


def _told_after_a_failing_shared_prefill() -> set[str]:
    """One writer into a decode group of two, its prefill failing at its second step,
    after the second member joined it: the requests it tells the router have failed."""
    g = _group(1, 2, 2, 16, 16, writer_runtime=_ErrorsEndRequests, prefill_slice_s=0.0)
    ((writer, wrt),) = g.writers.values()
    run = writer.path.model.prefill_layers

    def failing(*args, **kwargs):
        steps = run(*args, **kwargs)
        yield next(steps)
        raise RuntimeError("the model failed")

    writer.path.model.prefill_layers = failing
    _dispatch(g)
    wrt.pump()
    return {f["rid"] for rank, k, f in wrt.sent if k == "ABORT" and rank == 0}


def test_a_failing_shared_prefill_fails_every_member_waiting_for_it():
    assert _told_after_a_failing_shared_prefill() == {"r", "r.1"}


def test_broken_a_failure_that_ends_only_the_first_member_is_caught(monkeypatch):
    """Broken mode: the failure ends the job the prefill was started for; the second
    member's job waits for a prefill that runs no more."""

    def only_its_own(self, rid: str, reason: str) -> None:
        self._fail(self.jobs[rid], prefill_path.AbortSource.INTERNAL, reason)

    monkeypatch.setattr(PrefillRank, "fail_request", only_its_own)
    assert _told_after_a_failing_shared_prefill() == {"r"}
