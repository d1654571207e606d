"""A prefill group of ``tp`` writing into a decode group of ``decode_tp`` members, against
recording runtimes, no processes: each member holds its share of the KV heads in a pool
of its own and owns a request of its own (``rid.j``) with the writers that hold its
heads; every member's I5 checks pass on the bytes that landed and each decodes the
prompt back, so the group's combined answer is the monolithic replay. All nine pairs of
{1, 2, 4}, with heads that split evenly, unevenly and as replicas, and page sizes that
differ; and with the KV replicated across TP (MLA-style: every member holds every head
and takes it all from one writer), where the llama model decodes in every member and
its answer is the monolithic engine's. Broken modes: a writer that writes as if the
member held every head is caught by the member's checks before decode reads a page; with
replicated KV, a writer that writes an owner it was not assigned is refused by the owner
before it plans a page."""

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

PROMPT = 100
STEPS = 6
PAIRS = [(tp, dtp) for tp in (1, 2, 4) for dtp in (1, 2, 4)]


def _model(kv_heads: int, llama: bool):
    if llama:
        return LlamaModel(LlamaConfig(layers=2, q_heads=4, kv_heads=kv_heads, head_dim=32))
    return ReplayModel(
        ReplayConfig(layers=2, kv_heads=kv_heads, q_per_kv=2, head_dim=32, max_positions=4096)
    )


@dataclasses.dataclass
class Group:
    topology: Topology
    split: HeadSplit
    writers: dict[int, tuple[PrefillRank, RecordingRuntime]]
    owners: dict[int, tuple[DecodeRank, TimedRuntime]]


def _group(
    tp: int,
    decode_tp: int,
    kv_heads: int,
    src_page: int,
    dst_page: int,
    replicated: bool = False,
    llama: bool = False,
) -> Group:
    t = Topology(1 + tp + decode_tp, tp, decode_tp, tp=tp, decode_tp=decode_tp)
    cards = {
        r: dataclasses.replace(_card(r, "prefill"), page_size=src_page) for r in t.prefill_ranks
    }
    cards |= {
        r: dataclasses.replace(_card(r, "decode"), page_size=dst_page) for r in t.decode_ranks
    }
    split = t.split(kv_heads, replicated)
    writers, owners = {}, {}
    for i, rank in enumerate(t.prefill_ranks):
        rt = RecordingRuntime(rank, cards)
        model = _model(kv_heads, llama)
        writers[rank] = (
            PrefillRank.serving(
                rt,
                model,
                KVPool(model.pool_config(src_page, 64)),
                None,
                split.writer_heads(i),
                router=0,
                routes=write_routes(t, split, i),
            ),
            rt,
        )
    for j, rank in enumerate(t.decode_ranks):
        rt = TimedRuntime(rank)
        rt.cards = cards
        lo, hi = split.owner_heads(j)
        model = _model(hi - lo, llama)
        owners[rank] = (
            DecodeRank.serving(
                rt,
                model,
                KVPool(model.pool_config(dst_page, 64), zero=True),
                router=0,
                transfer_timeout_s=5.0,
                abort_deadline_s=1.0,
                prefill_tp=tp,
                decode_member=(split, j),
            ),
            rt,
        )
    return Group(t, split, writers, owners)


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
            last_token=int(tokens[-1]),
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
            src = writer.pool.kv.reshape(-1).view(torch.uint8)
            dst = owner.pool.kv.reshape(-1).view(torch.uint8)
            for rank, triples in wrt.writes:
                if rank == owner_rank:
                    for s, d, n in np.asarray(triples).tolist():
                        dst[d : d + n] = src[s : s + n]
            wrt.writes = [x for x in wrt.writes if x[0] != owner_rank]
            for _, kind, fields in wrt.sent:
                if kind == "NOTICE" and fields["rid"] == rid:
                    ort.deliver(m.NOTICE, src=w, **fields)
        ort.pump()
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
def test_every_member_verifies_and_decodes_its_share(tp, decode_tp, kv_heads, src_page, dst_page):
    g = _group(tp, decode_tp, kv_heads, src_page, dst_page)
    answers = _answers(g, _serve(g))
    assert answers == [_prompt()[:STEPS].tolist()] * decode_tp  # the monolithic replay
    # whole pages when both sides have one page size, else the prompt's tokens as runs
    slots = PROMPT if src_page != dst_page else -(-PROMPT // src_page) * src_page
    assert _written(g) == slots * 2 * 2 * 32 * 4 * sum(
        hi - lo for lo, hi in map(g.split.owner_heads, range(decode_tp))
    )  # each member's heads once: tokens x layers x K/V x dim x fp32


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
