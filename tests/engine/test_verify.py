"""I5 on arrival (kvferry.engine.verify), the one check every owner runs: a notice that
names what was planned, with the bytes that landed, passes; each way a notice or the
landed bytes can be wrong is refused by exactly the check meant for it, with the numbers.
The broken mode of each case is the same notice with that one check left out: it would
pass, so the check is what catches it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvferry.engine.allocator import PageGrant
from kvferry.engine.integrity import CanaryTable, IntegrityError, expected_canaries, page_checksums
from kvferry.engine.verify import (
    Notice,
    Planned,
    check_canaries,
    check_notice,
    checksum_steps,
)

PAGES, GENS = [5, 2, 7], [3, 1, 4]


@pytest.fixture
def pool():
    torch.manual_seed(0)
    kv = torch.randn(8, 1, 2, 2, 16, 8)  # [pages, layers, 2, heads, page_size, head_dim]
    table = CanaryTable(8)
    grants = [PageGrant(p, g) for p, g in zip(PAGES, GENS, strict=True)]
    table.stamp(PAGES, expected_canaries("r1", grants))
    return kv, table


def _good(kv) -> tuple[Planned, Notice]:
    page_bytes = kv[0].numel() * kv.element_size()
    planned = Planned("r1", 40, PAGES, GENS, 3 * page_bytes)
    sums = page_checksums(kv, PAGES).tolist()
    return planned, Notice(1, 40, PAGES, GENS, sums, 3 * page_bytes)


def _run(kv, table, planned, notice, skip: str | None = None) -> None:
    if skip != "notice":
        check_notice(planned, notice)
    if skip != "canaries":
        check_canaries(planned, table.rows(list(notice.pages)))
    if skip != "checksums":
        for _ in checksum_steps(planned, notice, lambda p: page_checksums(kv, p), 2):
            pass


def test_a_notice_of_what_was_planned_and_landed_passes(pool):
    kv, table = pool
    planned, notice = _good(kv)
    _run(kv, table, planned, notice)


@pytest.mark.parametrize(
    "fault,check,words",
    [
        ("short", "notice", "received 16 positions of KV, expected 40"),
        ("foreign-page", "notice", "wrote 3 pages [5, 2, 6]"),
        ("stale-generation", "notice", "generations [3, 1, 9]"),
        ("bytes", "notice", "posted 100 bytes"),
        ("canary", "canaries", "canary mismatch on pages [2]"),
        ("torn", "checksums", "checksum mismatch on 1 of 3 pages"),
        ("no-checksums", "checksums", "sent 0 checksums for 3 pages"),
    ],
)
@pytest.mark.parametrize("mode", ["checked", "broken-check-left-out"])
def test_each_fault_is_refused_by_its_check(pool, fault, check, words, mode):
    kv, table = pool
    planned, notice = _good(kv)
    if fault == "short":
        notice = dataclasses.replace(notice, tokens=16)
    elif fault == "foreign-page":  # page 6 looks like the planned page 7 in every other way
        notice = dataclasses.replace(notice, pages=[5, 2, 6])
        kv[6] = kv[7]
        table.load([6], table.rows([7]))
    elif fault == "stale-generation":
        notice = dataclasses.replace(notice, generations=[3, 1, 9])
    elif fault == "bytes":
        notice = dataclasses.replace(notice, bytes=100)
    elif fault == "canary":
        table.stamp([2], expected_canaries("other", [PageGrant(2, 1)]))
    elif fault == "torn":
        kv[7, 0, 1, 0, 8:] = kv[5, 0, 1, 0, 8:]  # half of page 7 from page 5
    elif fault == "no-checksums":
        notice = dataclasses.replace(notice, checksums=[])
    if mode == "checked":
        with pytest.raises(IntegrityError) as err:
            _run(kv, table, planned, notice)
        assert words in str(err.value) and "'r1'" in str(err.value)
    else:
        _run(kv, table, planned, notice, skip=check)  # without its check, it passes


def test_the_checksums_run_in_steps_and_name_the_writer(pool):
    kv, _ = pool
    planned, notice = _good(kv)
    kv[2].neg_()
    steps = checksum_steps(planned, notice, lambda p: page_checksums(kv, p), 1)
    assert next(steps) is None and next(steps) is None and next(steps) is None
    with pytest.raises(IntegrityError, match=r"written by rank 1 \(first: \[2\]\)"):
        next(steps)
