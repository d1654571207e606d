"""A prefill group of ``tp`` writing into a decode group of ``decode_tp`` members, against
recording runtimes, no processes: each member holds its share of the KV heads in a pool
of its own and owns a request of its own (``rid.j``) with the writers that hold its
heads; every member's I5 checks pass on the bytes that landed and each decodes the
prompt back, so the group's combined answer is the monolithic replay. All nine pairs of
{1, 2, 4}, with heads that split evenly, unevenly and as replicas, and page sizes that
differ. Broken mode: a writer that writes as if the member held every head is caught by
the member's checks before decode reads a page."""

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
from kvferry.cluster.topology import Topology, head_range
from kvferry.engine.models import ReplayConfig, ReplayModel
from kvferry.engine.pool import KVPool

PROMPT = 100
STEPS = 6


def _model(kv_heads: int, q_per_kv: int = 2) -> ReplayModel:
    return ReplayModel(
        ReplayConfig(
            layers=2, kv_heads=kv_heads, q_per_kv=q_per_kv, head_dim=32, max_positions=4096
        )
    )


@dataclasses.dataclass
class Group:
    topology: Topology
    writers: dict[int, tuple[PrefillRank, RecordingRuntime]]
    owners: dict[int, tuple[DecodeRank, TimedRuntime]]


def _group(tp: int, decode_tp: int, kv_heads: int, src_page: int, dst_page: int) -> Group:
    t = Topology(1 + tp + decode_tp, tp, decode_tp, tp=tp, decode_tp=decode_tp)
    cards = {
        r: dataclasses.replace(_card(r, "prefill"), page_size=src_page) for r in t.prefill_ranks
    }
    cards |= {
        r: dataclasses.replace(_card(r, "decode"), page_size=dst_page) for r in t.decode_ranks
    }
    split = t.split(kv_heads)
    writers, owners = {}, {}
    for i, rank in enumerate(t.prefill_ranks):
        rt = RecordingRuntime(rank, cards)
        model = _model(kv_heads)
        writers[rank] = (
            PrefillRank.serving(
                rt,
                model,
                KVPool(model.pool_config(src_page, 64)),
                None,
                head_range(i, tp, kv_heads),
                router=0,
                routes=write_routes(t, i, kv_heads),
            ),
            rt,
        )
    for j, rank in enumerate(t.decode_ranks):
        rt = TimedRuntime(rank)
        rt.cards = cards
        lo, hi = split.owner_heads(j)
        model = _model(hi - lo)
        owners[rank] = (
            DecodeRank.serving(
                rt,
                model,
                KVPool(model.pool_config(dst_page, 64), zero=True),
                router=0,
                transfer_timeout_s=5.0,
                abort_deadline_s=1.0,
                prefill_tp=tp,
                decode_member=(decode_tp, j, kv_heads),
            ),
            rt,
        )
    return Group(t, writers, owners)


def _serve(g: Group, kv_heads: int) -> dict[int, str]:
    """Every member's request through ASSIGN, PLAN, PREFILL, the writes landing and the
    notices; the member's request id by owner rank."""
    tokens = (np.arange(PROMPT) * 7 % 400).astype("<i4")
    group = g.topology.prefill_groups[0]
    rids = {}
    for j, owner_rank in enumerate(g.topology.decode_groups[0]):
        rid = "r" if j == 0 else f"r.{j}"
        rids[owner_rank] = rid
        owner, ort = g.owners[owner_rank]
        writers = g.topology.writers_in(group, kv_heads, j)
        ort.deliver(
            m.ASSIGN, src=0, rid=rid, prompt_len=PROMPT, max_tokens=STEPS, writers=writers,
            last_token=int(tokens[-1]),
        )  # fmt: skip
        plan = next(f for _, k, f in ort.sent if k == "PLAN" and f["rid"] == rid)
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


PAIRS = [(tp, dtp) for tp in (1, 2, 4) for dtp in (1, 2, 4)]


@pytest.mark.parametrize("tp, decode_tp", PAIRS)
@pytest.mark.parametrize("kv_heads", [4, 3, 2])
@pytest.mark.parametrize("src_page, dst_page", [(16, 16), (32, 16), (16, 64)])
def test_every_member_verifies_and_decodes_its_share(tp, decode_tp, kv_heads, src_page, dst_page):
    g = _group(tp, decode_tp, kv_heads, src_page, dst_page)
    rids = _serve(g, kv_heads)
    tokens = (np.arange(PROMPT) * 7 % 400).tolist()
    answers = []
    for owner_rank, (owner, ort) in g.owners.items():
        assert owner.reqs[rids[owner_rank]].state is OwnerState.DECODING, owner.reqs
        for _ in range(STEPS):
            owner.step()
        answers.append([t for _, k, f in ort.sent if k == "TOKENS" for t in f["tokens"]])
    assert answers == [tokens[:STEPS]] * decode_tp  # every member, the monolithic replay
    written = sum(
        f["bytes"] for _, rt in g.writers.values() for _, k, f in rt.sent if k == "NOTICE"
    )
    # whole pages when both sides have one page size, else the prompt's tokens as runs
    slots = PROMPT if src_page != dst_page else -(-PROMPT // src_page) * src_page
    assert written == slots * 2 * 2 * 32 * 4 * sum(
        hi - lo for lo, hi in map(g.topology.split(kv_heads).owner_heads, range(decode_tp))
    )  # each member's heads once: tokens x layers x K/V x dim x fp32


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
    _serve(g, 4)
    failed = [f for _, (_, ort) in g.owners.items() for _, k, f in ort.sent if k == "DONE"]
    assert failed and all(f["outcome"] == "failed" and "integrity" in f["error"] for f in failed), (
        failed
    )
