"""The abort cases against vLLM's own NixlPushConnector, side by side with kvferry's rows.

Only NIXL's SCHEDULER side runs here (its worker needs the NIXL library and a transport,
which this machine has not): vLLM's real Scheduler with ``NixlPushConnector`` loaded on the
decode, stepped with worker outputs that carry exactly what a NIXL worker would report for
the case. Read from ``nixl/push_worker.py``: the decode worker reports ``finished_recving``
only when the prefill's completion notice arrives (or a registration handshake/notice fails
before it is sent); it has no timer of its own. So "the prefill died after the registration
went out" is a run in which the worker reports nothing. Everything measured comes from the
scheduler's own state (its block pool). Bytes are never moved on the NIXL side, so "foreign
bytes read" is not measurable there and is reported as such.

The kvferry rows are the ones test_connector.py measured in this session (same record type:
plain dicts with ``connector``, ``case``, ``blocks_leaked``, ``foreign_bytes_read``,
``time_to_release_s``). The table is printed (``-s``) and appended to
``$KVFERRY_VLLM_TABLE`` (which .ci/vllm.sh prints)."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (.ci/vllm.sh builds its venv)")

import harness as h
import test_shape_pairs as sp
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

NIXL_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"
BLOCKS = 6  # as test_connector.DECODE_BLOCKS: one 64-token request and the null block
PROMPT = 64
N_STEPS = 300  # steps with no completion from the worker
HOLD_S = 2.0  # and at least this long
WATCHDOG_S = 0.5  # push_registration_timeout: its watchdog fires inside HOLD_S
NOT_MEASURABLE = "not measurable here (no NIXL transport on this machine)"
ROWS: list[dict[str, Any]] = []


class NixlDecode:
    """A decode engine's real Scheduler with NixlPushConnector (scheduler role only), of
    TP size ``tp`` and ``block``-token blocks, loading from a prefill of TP ``remote_tp``."""

    def __init__(self, model: str, tp: int = 1, block: int = h.BLOCK, remote_tp: int = 1) -> None:
        self.remote_tp = remote_tp
        self.cfg = h.vllm_config(
            model,
            "kv_consumer",
            "nixl-decode",
            {"push_registration_timeout": WATCHDOG_S},
            tp=tp,
            module=NIXL_MODULE,
            connector="NixlPushConnector",
            block=block,
        )
        self.kcc = h.kv_cache_config(BLOCKS)
        self.cfg.cache_config.num_gpu_blocks = BLOCKS
        self.sched = Scheduler(
            vllm_config=self.cfg,
            kv_cache_config=self.kcc,
            structured_output_manager=StructuredOutputManager(self.cfg),
            block_size=block,
            log_stats=True,
        )
        self.metas: list[NixlConnectorMetadata] = []

    def held(self) -> int:
        """Blocks not in the free pool (nothing else runs on this engine)."""
        return BLOCKS - 1 - self.sched.kv_cache_manager.block_pool.get_num_free_blocks()

    def step(self, finished_recving: set[str] | None = None) -> None:
        so = self.sched.schedule()
        meta = so.kv_connector_metadata
        assert isinstance(meta, NixlConnectorMetadata)
        self.metas.append(meta)
        ids = list(so.num_scheduled_tokens)
        out = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[[7] for _ in ids],
            kv_connector_output=KVConnectorOutput(finished_recving=finished_recving or None),
        )
        self.sched.update_from_output(so, out)

    def status(self, rid: str) -> RequestStatus | None:
        req = self.sched.requests.get(rid)
        return None if req is None else req.status

    def shutdown(self) -> None:
        self.sched.connector.shutdown()


def nixl_params(rid: str, remote_tp: int = 1) -> dict[str, Any]:
    """What NixlPushConnector's prefill returns from request_finished (its field names)."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": ([1, 2, 3, 4, 5],),
        "remote_engine_id": "nixl-prefill",
        "remote_request_id": rid,
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
        "tp_size": remote_tp,
        "pp_size": 1,
        "remote_num_tokens": PROMPT,
        "transfer_mode": "push",
    }


def add(d: NixlDecode, rid: str) -> None:
    d.sched.add_request(h.request(rid, PROMPT, nixl_params(rid, d.remote_tp), 2))


def hold(d: NixlDecode) -> tuple[int, float]:
    """Steps the engine with no completion from the worker; (steps, seconds) it ran."""
    t0, n = time.monotonic(), 0
    while n < N_STEPS or time.monotonic() - t0 < HOLD_S:
        d.step()
        n += 1
        time.sleep(0.001)
    return n, time.monotonic() - t0


def record(case: str, **row: Any) -> dict[str, Any]:
    row = {"connector": "NixlPushConnector (scheduler side)", "case": case, **row}
    ROWS.append(row)
    return row


def check_nixl_rows(a: dict[str, Any], b: dict[str, Any], c: dict[str, Any]) -> None:
    """What is certain from the scheduler's own state, case by case."""
    assert a["blocks_allocated"] > 0 and a["blocks_held_before_notice"] == a["blocks_allocated"]
    assert a["blocks_leaked"] == 0, a
    assert b["blocks_leaked"] == b["blocks_allocated"] > 0, b
    assert c["decode_blocks_leaked"] == 0 and c["notice_in_step"] is not None, c


# ---------------------------------------------------------------------- the NIXL cases
def nixl_abort(model: str, **shape: int) -> dict[str, Any]:
    """(a) Abort while waiting for remote KV; the prefill is alive and its completion
    arrives later: how long after that notice are the blocks free?"""
    d = NixlDecode(model, **shape)
    try:
        add(d, "a")
        for _ in range(50):
            d.step()
            if d.status("a") == RequestStatus.WAITING_FOR_REMOTE_KVS:
                break
        assert d.status("a") == RequestStatus.WAITING_FOR_REMOTE_KVS
        assert any("a" in (m.push_registrations or {}) for m in d.metas)
        allocated = d.held()
        d.sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
        n, s = hold(d)
        held_before_notice = d.held()
        t0, k = time.monotonic(), 1
        d.step(finished_recving={"a"})  # the prefill's completion notice arrives
        while d.held() and k < 50:
            d.step()
            k += 1
        return record(
            "abort while waiting",
            blocks_allocated=allocated,
            blocks_held_before_notice=held_before_notice,
            held_for=f"{n} steps / {s:.1f} s without a notice",
            blocks_leaked=d.held(),
            foreign_bytes_read=NOT_MEASURABLE,
            time_to_release_s=round(time.monotonic() - t0, 4),
            steps_to_release=k,
            note="held until the completion notice (no early release)",
        )
    finally:
        d.shutdown()


def nixl_prefill_died(model: str, **shape: int) -> dict[str, Any]:
    """(b) The registration went out, then the prefill died: no completion ever comes.
    The client aborts too. Do the blocks ever come back?"""
    d = NixlDecode(model, **shape)
    try:
        add(d, "c")
        for _ in range(50):
            d.step()
            if d.status("c") == RequestStatus.WAITING_FOR_REMOTE_KVS:
                break
        assert d.status("c") == RequestStatus.WAITING_FOR_REMOTE_KVS
        allocated = d.held()
        n1, s1 = hold(d)  # past the registration watchdog (WATCHDOG_S)
        d.sched.finish_requests("c", RequestStatus.FINISHED_ABORTED)
        n2, s2 = hold(d)
        watchdog = not d.sched.connector.connector_scheduler._push_registration_deadlines
        return record(
            "prefill killed mid-transfer",
            blocks_allocated=allocated,
            held_for=f"{n1 + n2} steps / {s1 + s2:.1f} s (aborted after {n1} steps)",
            watchdog_fired=watchdog,
            blocks_leaked=d.held(),
            foreign_bytes_read=NOT_MEASURABLE,
            time_to_release_s=None if d.held() else round(s1 + s2, 3),
            still_waiting=d.status("c") is not None,
            note="never released: no completion, no timer frees them (vllm#46283)",
        )
    finally:
        d.shutdown()


def nixl_reject(model: str, **shape: int) -> dict[str, Any]:
    """(c) Rejected before allocation: does the decode tell the prefill, and when?"""
    d = NixlDecode(model, **shape)
    try:
        add(d, "r")
        d.sched.finish_requests("r", RequestStatus.FINISHED_ABORTED)
        t0 = time.monotonic()
        told_step = None
        for k in range(1, 51):
            d.step()
            if "r" in d.metas[-1].reqs_to_recv:
                told_step = k
                break
        return record(
            "rejected before allocation",
            decode_blocks_leaked=d.held(),
            notice_in_step=told_step,
            notice_after_s=None if told_step is None else round(time.monotonic() - t0, 4),
            blocks_leaked=f"prefill side: {NOT_MEASURABLE}",
            foreign_bytes_read=NOT_MEASURABLE,
            time_to_release_s=f"prefill side: {NOT_MEASURABLE}",
            prefill_release="when NIXL delivers the notice, else its worker's lease (30 s)",
            note="the decode scheduler emits an empty recv for the prefill's worker",
        )
    finally:
        d.shutdown()


# ---------------------------------------------------------------------- the table
CASES = ["abort while waiting", "prefill killed mid-transfer", "rejected before allocation"]
COLS = ["blocks_leaked", "foreign_bytes_read", "time_to_release_s"]


def kvferry_rows() -> list[dict[str, Any]]:
    """kvferry's safe-mode rows for the same cases, as test_connector.py measured them."""
    try:
        import test_connector
    except Exception:  # pragma: no cover - run alone without it
        return []
    return [r for r in test_connector.TABLE if r["connector"] == "kvferry" and r["case"] in CASES]


def table(rows: list[dict[str, Any]]) -> str:
    def cell(v: Any) -> str:
        return "-" if v is None else str(v).replace(NOT_MEASURABLE, "not measurable*")

    head = ["case", "connector", *COLS]
    body = [[r["case"], r["connector"], *(cell(r.get(c)) for c in COLS)] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *body, strict=True)]
    fmt = " | ".join(f"{{:<{w}}}" for w in widths)
    out = [fmt.format(*head), "-+-".join("-" * w for w in widths)]
    out += [fmt.format(*b) for b in body]
    out.append(f"* {NOT_MEASURABLE}")
    out.append(
        "NIXL time_to_release_s: from the completion notice reaching the scheduler; "
        "kvferry's: from the writer being able to act (abort) or dying (killed)"
    )
    return "\n".join(out)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return h.model_dir(tmp_path_factory.mktemp("model-nixl"))


def test_versus_nixl(model, tmp_path):
    try:
        NixlDecode(model).shutdown()
    except Exception as e:  # the scheduler side cannot even be built here
        msg = f"NixlPushConnector's scheduler side cannot be constructed: {e!r}"
        print(msg)
        pytest.skip(msg)
    a, b, c = nixl_abort(model), nixl_prefill_died(model), nixl_reject(model)
    check_nixl_rows(a, b, c)

    ours = kvferry_rows()
    for r in ours:
        assert r["blocks_leaked"] == 0, r
    by_case = {r["case"]: r for r in ours}
    rows: list[dict[str, Any]] = []
    for case, nixl in zip(CASES, [a, b, c], strict=True):
        rows.append(
            by_case.get(case, {"connector": "kvferry", "case": case, "blocks_leaked": "not run"})
        )
        rows.append(nixl)
    text = table(rows)
    lines = [json.dumps(r) for r in rows]
    print("\n" + text + "\n" + "\n".join(lines))
    (tmp_path / "versus_nixl.txt").write_text(text + "\n" + "\n".join(lines) + "\n")
    if os.environ.get("KVFERRY_VLLM_TABLE"):
        with open(os.environ["KVFERRY_VLLM_TABLE"], "a") as f:
            f.write("\nkvferry versus NixlPushConnector (scheduler side):\n" + text + "\n")
            f.write("\n".join(lines) + "\n")


@pytest.mark.parametrize("pair_shapes", sp.PAIRS, ids=sp.IDS)
def test_versus_nixl_between_unlike_shapes(model, pair_shapes, tmp_path):
    """The same three cases with NixlPushConnector's decode scheduler of the pair's decode
    shape loading from a prefill of the pair's TP size, beside kvferry's rows for that
    pair (test_shape_pairs.py, where it ran in this session)."""
    prefill, decode = pair_shapes
    shape = {"tp": decode.tp, "block": decode.block, "remote_tp": prefill.tp}
    try:
        NixlDecode(model, **shape).shutdown()
    except Exception as e:
        msg = f"NixlPushConnector's scheduler side cannot be constructed for {shape}: {e!r}"
        print(msg)
        pytest.skip(msg)
    pair = f"{prefill}->{decode}"
    nixl = [f(model, **shape) for f in (nixl_abort, nixl_prefill_died, nixl_reject)]
    check_nixl_rows(*nixl)
    ours = {r["case"]: r for r in sp.ROWS if r.get("pair") == pair and r["connector"] == "kvferry"}
    rows: list[dict[str, Any]] = []
    for case, theirs in zip(CASES, nixl, strict=True):
        mine = ours.get(case, {"connector": "kvferry", "case": case, "blocks_leaked": "not run"})
        assert mine.get("blocks_leaked", 0) in (0, "not run"), mine
        rows += [{**mine, "pair": pair}, {**theirs, "pair": pair}]
    lines = [json.dumps(r) for r in rows]
    print("\n" + "\n".join(lines))
    if os.environ.get("KVFERRY_VLLM_TABLE"):
        with open(os.environ["KVFERRY_VLLM_TABLE"], "a") as f:
            f.write(f"\nkvferry versus NixlPushConnector (scheduler side), {pair}:\n")
            f.write("\n".join(lines) + "\n")
