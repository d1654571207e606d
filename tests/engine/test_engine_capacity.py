import logging

import pytest
import torch

from kvferry.cluster.cli import main
from kvferry.engine import (
    CapacityError,
    KVPool,
    MonolithicEngine,
    PoolConfig,
    ReplayModel,
    check_capacity,
    enforce_startup_capacity,
)


def test_check_capacity_reports_both_numbers():
    report = check_capacity(PoolConfig.for_tokens(681_280, dtype="bf16"), 1_048_576)
    assert not report.ok
    assert (report.measured_tokens, report.context_length) == (681_280, 1_048_576)
    assert "681280" in report.message() and "1048576" in report.message()
    assert check_capacity(PoolConfig.for_tokens(2_097_152, dtype="bf16"), 1_048_576).ok


def test_start_up_refuses_a_short_pool():
    pool = KVPool(PoolConfig.for_tokens(1024, page_size=16))
    with pytest.raises(CapacityError) as err:
        enforce_startup_capacity(pool, 4096)
    assert (err.value.measured_tokens, err.value.context_length) == (1024, 4096)
    assert enforce_startup_capacity(pool, 1024) == 1024


def test_start_up_accepts_an_explicit_logged_lowering(caplog):
    pool = KVPool(PoolConfig.for_tokens(1024, page_size=16))
    with caplog.at_level(logging.WARNING):
        assert enforce_startup_capacity(pool, 4096, lowered_context_length=1000) == 1000
    assert any("lowered" in r.message for r in caplog.records)
    with pytest.raises(CapacityError):
        enforce_startup_capacity(pool, 4096, lowered_context_length=2000)  # still too long


def test_engine_refuses_to_start_on_a_short_pool():
    model = ReplayModel()
    pool = KVPool(model.pool_config(16, 8))
    with pytest.raises(CapacityError):
        MonolithicEngine(model, pool, context_length=256)
    engine = MonolithicEngine(model, pool, context_length=256, lowered_context_length=128)
    assert engine.context_length == 128


def test_check_uses_the_allocated_tensor(monkeypatch):
    """Injected fault: the allocation comes up short. The check reports the real figure."""
    real_empty = torch.empty

    def short_empty(shape, **kwargs):
        shape = (shape[0] // 2,) + tuple(shape[1:])
        return real_empty(shape, **kwargs)

    monkeypatch.setattr(torch, "empty", short_empty)
    report = check_capacity(PoolConfig.for_tokens(2_048, page_size=16), 2_048)
    assert report.measured_tokens == 1_024 and not report.ok


def test_cli_fails_for_the_incident_figures(capsys):
    assert main(["check-capacity", "--context-length", "1048576", "--pool-tokens", "681280"]) != 0
    err = capsys.readouterr().err
    assert "681280" in err and "1048576" in err


def test_cli_passes_when_the_pool_fits(capsys):
    assert main(["check-capacity", "--context-length", "1048576", "--pool-tokens", "2097152"]) == 0
    out = capsys.readouterr().out
    assert "2097152" in out and "1048576" in out


def test_cli_json(capsys):
    main(
        [
            "check-capacity",
            "--context-length",
            "100",
            "--pool-tokens",
            "64",
            "--page-size",
            "16",
            "--json",
        ]
    )
    line = capsys.readouterr().out.strip().splitlines()[0]
    assert '"measured_tokens": 64' in line and '"ok": false' in line
