"""transports="rdma": refused at start-up naming what is missing (verbs in this UCX, an
RDMA device, or one that UCX_NET_DEVICES allows), the transports' failure horizons against
the abort deadline, and how an endpoint's transports are read on every UCX."""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys

import pytest

from kvferry.transfer import RdmaUnavailableError, TransferConfig, TransferEngine, horizon, ucxinfo
from kvferry.transfer.config import RC_FAILURE_OPTIONS, RC_UCX_DEFAULTS, plan_options

LABEL = "UCX 9.9.9 at /x/libucp.so.0"
NO_VERBS = ucxinfo.Inventory(components={"self": ["self"], "tcp": ["tcp"], "posix": ["posix"]})
VERBS_NO_DEVICE = ucxinfo.Inventory(components={"self": ["self"], "ib": [], "rdmacm": []})
WITH_DEVICE = ucxinfo.Inventory(
    components={"ib": ["mlx5_0"], "tcp": ["tcp"]},
    resources={"ib/mlx5_0": ["rc_verbs/mlx5_0:1", "ud_verbs/mlx5_0:1", "rc_mlx5/mlx5_0:1"]},
)


def test_refusal_names_missing_verbs():
    missing, message = ucxinfo.rdma_refusal(NO_VERBS, LABEL, {})
    assert missing == "verbs"
    assert "built with verbs" in message and LABEL in message and "KVFERRY_UCX=system" in message
    assert "self, tcp, posix" in message  # what this UCX does have


def test_refusal_names_missing_device():
    missing, message = ucxinfo.rdma_refusal(VERBS_NO_DEVICE, LABEL, {})
    assert missing == "device" and "no RDMA device" in message and LABEL in message


def test_refusal_names_net_devices_that_exclude_every_rdma_device():
    missing, message = ucxinfo.rdma_refusal(WITH_DEVICE, LABEL, {"UCX_NET_DEVICES": "eth0"})
    assert missing == "device"
    assert "UCX_NET_DEVICES=eth0" in message and "rc_verbs/mlx5_0:1" in message


def test_usable_rdma_is_not_refused():
    assert ucxinfo.rdma_refusal(WITH_DEVICE, LABEL, {}) is None
    assert ucxinfo.rdma_refusal(WITH_DEVICE, LABEL, {"UCX_NET_DEVICES": "mlx5_0:1"}) is None
    assert WITH_DEVICE.rdma_devices() == ["mlx5_0"]
    assert WITH_DEVICE.rdma_transports() == [
        "rc_verbs/mlx5_0:1",
        "ud_verbs/mlx5_0:1",
        "rc_mlx5/mlx5_0:1",
    ]


def test_inventory_parses_the_native_listing():
    inv = ucxinfo.Inventory.parse(
        "self\tself\nib\tmlx5_0 mlx5_1\nib\tmlx5_0\t rc_verbs/mlx5_0:1"
        " ud_verbs/mlx5_0:1\nib\tmlx5_1\t\n"
    )
    assert inv.components == {"self": ["self"], "ib": ["mlx5_0", "mlx5_1"]}
    assert inv.resources["ib/mlx5_0"] == ["rc_verbs/mlx5_0:1", "ud_verbs/mlx5_0:1"]
    assert inv.resources["ib/mlx5_1"] == []


def test_engine_refuses_rdma_here_naming_what_is_missing():
    """This machine: the wheel has no verbs; Debian's UCX has verbs but no device here."""
    inv = ucxinfo.inventory()
    if inv.rdma_transports():
        pytest.skip(f"this host has RDMA transports: {inv.rdma_transports()}")
    with pytest.raises(RdmaUnavailableError) as err:
        TransferEngine(TransferConfig(transports="rdma", name="rdma-probe"))
    text = str(err.value)
    assert "--transports rdma" in text and ucxinfo.versions()["running"] in text
    if inv.has_verbs():
        assert err.value.missing == "device" and "no RDMA device" in text
    else:
        assert err.value.missing == "verbs" and "built with verbs" in text


def test_cli_exits_2_with_the_refusal():
    out = subprocess.run(
        [sys.executable, "-m", "kvferry.transfer", "--transports", "rdma"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if ucxinfo.inventory().rdma_transports():
        assert out.returncode == 0, out.stderr
        return
    assert out.returncode == 2, out.stderr
    assert '"rdma_refused": "--transports rdma' in out.stdout
    assert f'"running": "{ucxinfo.versions()["running"]}"' in out.stdout


def test_serve_accepts_transports_rdma():
    from kvferry.cluster.config import add_serve_arguments

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    assert parser.parse_args(["--transports", "rdma"]).transports == "rdma"
    with pytest.raises(SystemExit):
        parser.parse_args(["--transports", "verbs"])


def test_rdma_preset_and_rc_options():
    cfg = TransferConfig(transports="rdma")
    opts = cfg.resolved_ucx_options()
    assert opts["TLS"] == "rc,ud,dc,self"
    assert opts["RC_TIMEOUT"] == RC_FAILURE_OPTIONS["RC_TIMEOUT"]
    assert "TCP_USER_TIMEOUT" not in opts
    assert "RC_TIMEOUT" not in TransferConfig(transports="shm").resolved_ucx_options()


def test_operator_environment_wins_over_engine_defaults():
    cfg = TransferConfig(transports="rdma")
    env = {"UCX_RC_TIMEOUT": "2s"}
    plan = plan_options(cfg.resolved_ucx_options(), cfg.engine_defaults(), {}, env)
    assert plan.operator == {"UCX_RC_TIMEOUT": "2s"}
    assert plan.environment["UCX_RC_RETRY_COUNT"] == "7"
    assert plan.ucp == {"TLS": "rc,ud,dc,self"}
    explicit = {"RC_TIMEOUT": "0.1s"}
    cfg = TransferConfig(transports="rdma", ucx_options=explicit)
    plan = plan_options(cfg.resolved_ucx_options(), cfg.engine_defaults(), explicit, env)
    assert plan.environment["UCX_RC_TIMEOUT"] == "0.1s" and not plan.operator


def test_rc_horizon_of_the_engine_lies_inside_the_default_deadline():
    h = horizon.rc_horizon(RC_FAILURE_OPTIONS["RC_TIMEOUT"], RC_FAILURE_OPTIONS["RC_RETRY_COUNT"])
    assert 4.0 < h.seconds < 5.0  # 0.537 s x 8
    level, message = h.log_record(5.0)
    assert level == logging.INFO and "lies past" in message and "RC_RETRY_COUNT 7" in message


def test_rc_horizon_of_ucx_defaults_exceeds_it_and_warns():
    h = horizon.rc_horizon(RC_UCX_DEFAULTS["RC_TIMEOUT"], RC_UCX_DEFAULTS["RC_RETRY_COUNT"])
    assert h.seconds == pytest.approx(4.096e-6 * 2**18 * 8)  # 8.6 s
    level, message = h.log_record(5.0)
    assert level == logging.WARNING and "does NOT lie past" in message and "8.6" in message


def test_tcp_horizon_with_and_without_user_timeout():
    h = horizon.tcp_horizon("1s", "1s", "3", "4s", True)
    assert h.seconds == 4.0 and h.log_record(5.0)[0] == logging.INFO
    h = horizon.tcp_horizon("1000000.00us", "1000000.00us", "3", None, False)
    assert h.seconds > 60 and "tcp_retries2" in h.how and "no TCP_USER_TIMEOUT" in h.how
    assert h.log_record(5.0)[0] == logging.WARNING


def test_linux_retransmission_limit():
    assert horizon.tcp_retries2_horizon_s(15) == pytest.approx(924.6)


def test_engine_reports_its_horizon_and_what_its_ucx_lacks():
    with TransferEngine(TransferConfig(transports="tcp", name="h")) as eng:
        d = eng.describe()
        assert d["failure_horizon"] == eng.failure_horizon().how
        lacks_user_timeout = any("TCP_USER_TIMEOUT" in u for u in d["ucx_unavailable"])
        if lacks_user_timeout:
            assert "tcp_retries2" in d["failure_horizon"]
        else:
            assert eng.failure_horizon().seconds == 4.0
    with TransferEngine(TransferConfig(transports="shm", name="s")) as eng:
        assert eng.failure_horizon().seconds is None


def test_lanes_from_print_info():
    text = (
        "#                 lane[0]:  2:tcp/lo.0 md[1]      -> md[1]/tcp/sysdev[255] rma_bw#0 am\n"
        "#                 lane[1]:  1:tcp/eth0.0 md[1]    -> md[1]/tcp/sysdev[255] wireup\n"
        "#                 lane[2]:  5:rc_mlx5/mlx5_0:1.0 md[4] -> md[4]/ib rma_bw#1\n"
        "#                 lane[3]:  2:tcp/lo.0 md[1]      -> md[1]/tcp am_bw#0\n"
    )
    assert ucxinfo.lanes_from_print_info(text) == "tcp/lo,tcp/eth0,rc_mlx5/mlx5_0:1"


def test_lane_transports_names_each_lanes_transport():
    assert ucxinfo.lane_transports("sysv/memory,posix/memory,cma/memory") == {
        "sysv",
        "posix",
        "cma",
    }
    assert ucxinfo.lane_transports("tcp/lo,rc_mlx5/mlx5_0:1") == {"tcp", "rc_mlx5"}
    assert ucxinfo.lane_transports("") == set()


def test_peer_transports_are_read_on_this_ucx():
    with (
        TransferEngine(TransferConfig(transports="tcp", name="a")) as a,
        TransferEngine(TransferConfig(transports="tcp", name="b")) as b,
    ):
        peer = a.connect(b.address, name="b")
        info = a.describe()["peers"]["b"]
        assert "tcp/" in info["transports"], info
        expected = "ucp_ep_query" if ucxinfo.has_feature("ep_transports") else "ucp_ep_print_info"
        assert info["transports_from"] == expected
        a.close(peer)
