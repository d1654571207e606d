"""The prefill worker's rule for its staging slots (cluster/vllm/staging.py): a slot is
given back only once the batch posted from it settled. Over a transport that reads a
batch's bytes only as it completes, what lands is what the writer checksummed; a slot
given back early (the broken mode) lets the next gather overwrite bytes still on the
wire, which the owner's region checksums catch."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (.ci/vllm.sh builds its venv)")

from writer_fakes import TOKENS, make_writer, plan, sender

from kvferry.cluster.vllm import wire
from kvferry.cluster.vllm.reshape import region_checksums
from kvferry.cluster.vllm.staging import Staging


def gathered_early(monkeypatch) -> None:
    """BROKEN MODE: a staging slot is given back as soon as it is taken, so the next
    gather may overwrite a batch still on the wire."""
    stage = Staging.stage

    def stage_and_free(self, src, triples):
        staged = stage(self, src, triples)
        if staged is not None:
            self.free.append(staged.slot)
        return staged

    monkeypatch.setattr(Staging, "stage", stage_and_free)
    monkeypatch.setattr(Staging, "release", lambda self, staged: staged.ready.result())


@pytest.mark.parametrize("broken", [False, True], ids=["held-until-settled", "broken-early-reuse"])
def test_the_writer_reuses_a_slot_only_after_its_batch_settled(monkeypatch, broken):
    """A prefill worker (TP 1, NHD) writing rows into both decode workers of TP 2, in
    staged batches of 8 KiB with two slots (the second job waits for one while the first
    holds both), over a transport that reads each batch's bytes only as it completes,
    one at a time. Safe: what landed is what the writer checksummed. Broken: a slot
    given back while its batch is on the wire carries another batch's bytes into it, and
    the region checksums differ."""
    if broken:
        gathered_early(monkeypatch)
    wr = make_writer(monkeypatch)
    w, engine, link, dsts, staging = wr.host, wr.engine, wr.link, wr.dsts, wr.staging
    assert staging is not None
    wr.hand_over()
    for d in range(2):
        w.on_plan(sender(d), plan(d, dsts[d], TOKENS))
    jobs = sorted(w.jobs.values(), key=lambda j: j.decode_rank)
    assert [j.staged for j in jobs] == [True, True]
    waited = bool(w.waiting_for_slot) or broken
    finished = 0
    while engine.pending:
        engine.finish()
        finished += 1
        w.settle()
    sent = [[int(c) for c in m["checksums"]] for m in link.sent if m["k"] is wire.NOTICE]
    assert waited and finished >= 8 and len(sent) == 2
    same = []
    for job, dst in zip(jobs, dsts, strict=True):
        assert job.runs is not None
        same.append(region_checksums(dst, job.runs, 1, 4).tolist() in sent)
    assert all(same) is not broken, same
    staging.close()
