"""Page-list bounds checks (property-tested against a plain oracle) and the mapping of
every ucs_status_t to a named exception."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvferry.transfer import SegmentBoundsError, UcxError
from kvferry.transfer._native import ffi, lib
from kvferry.transfer.errors import UCS_STATUS_NAMES, status_name, ucx_error
from kvferry.transfer.runs import as_runs, check_runs

I64 = st.integers(-(2**63), 2**63 - 1)


def oracle_ok(pages, local_len, remote_len) -> bool:
    return all(
        ln > 0 and lo >= 0 and ro >= 0 and lo + ln <= local_len and ro + ln <= remote_len
        for lo, ro, ln in pages
    )


@given(
    st.lists(st.tuples(I64, I64, I64), min_size=1, max_size=8),
    st.integers(1, 2**62),
    st.integers(1, 2**62),
)
def test_check_pages_matches_oracle(pages, local_len, remote_len):
    arr = as_runs(pages)
    if oracle_ok(pages, local_len, remote_len):
        assert check_runs(arr, local_len, remote_len) == sum(p[2] for p in pages)
    else:
        with pytest.raises(SegmentBoundsError):
            check_runs(arr, local_len, remote_len)


@given(
    st.lists(st.tuples(I64, I64, I64), min_size=1, max_size=8),
    st.integers(1, 2**62),
    st.integers(1, 2**62),
)
def test_native_check_matches_oracle(pages, local_len, remote_len):
    """The check that the write/read hot path runs in C (inside kvf_rma_pages)."""
    arr = as_runs(pages)
    total = ffi.new("int64_t *")
    bad = lib.kvf_check_pages(
        ffi.from_buffer("int64_t[]", arr), len(pages), local_len, remote_len, total
    )
    bad_at = [i for i, p in enumerate(pages) if not oracle_ok([p], local_len, remote_len)]
    if bad_at:
        assert bad == bad_at[0]
    else:
        assert bad == -1 and total[0] == sum(p[2] for p in pages)


@given(
    st.lists(
        st.tuples(st.integers(0, 1000), st.integers(0, 1000), st.integers(1, 100)),
        min_size=1,
        max_size=8,
    )
)
def test_first_offending_page_is_reported(pages):
    bad_at = [i for i, p in enumerate(pages) if not oracle_ok([p], 1000, 900)]
    if not bad_at:
        check_runs(as_runs(pages), 1000, 900)
        return
    with pytest.raises(SegmentBoundsError) as info:
        check_runs(as_runs(pages), 1000, 900)
    assert info.value.index in bad_at


def test_empty_page_list_is_zero_bytes():
    assert check_runs(as_runs(np.zeros((0, 3), np.int64)), 10, 10) == 0


@pytest.mark.parametrize("code", sorted(UCS_STATUS_NAMES))
def test_every_status_has_a_named_exception(code):
    err = ucx_error(code, "op", peer="p1")
    assert isinstance(err, UcxError) and err.status == code
    assert type(err).__name__ != "UcxError"
    assert UCS_STATUS_NAMES[code] in str(err) and "p1" in str(err)
    assert status_name(code) == UCS_STATUS_NAMES[code]


@pytest.mark.parametrize(
    "code,cls", [(-45, "UcsLinkFailureError"), (-80, "UcsEndpointFailureError")]
)
def test_status_ranges(code, cls):
    assert type(ucx_error(code, "op")).__name__ == cls
