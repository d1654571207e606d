"""Every role handles every message kind that can be sent to it (messages.SENDS), through
the one dispatch scheme (a handler table per role, RankRuntime.set_handlers)."""

from __future__ import annotations

import pytest

from kvferry.cluster import messages as m
from kvferry.cluster.decode import GROUP_RECEIVES, OWNER_RECEIVES, DecodeRank
from kvferry.cluster.prefill import WRITER_RECEIVES, PrefillRank
from kvferry.cluster.router import Router
from kvferry.cluster.topology import Role
from kvferry.engine.protocol.words import Kind

# What launch adds to a worker's table: the router's SHUTDOWN stops the loop.
LOOP_KINDS = frozenset({Kind.SHUTDOWN})


def handled(role: Role) -> frozenset[Kind]:
    if role is Role.ROUTER:
        return frozenset(Router.HANDLES)
    decode = OWNER_RECEIVES | GROUP_RECEIVES
    return (decode if role is Role.DECODE else WRITER_RECEIVES) | LOOP_KINDS


@pytest.mark.parametrize("role", list(Role))
def test_every_role_handles_every_kind_sent_to_it(role):
    assert m.receives(role) <= handled(role), m.receives(role) - handled(role)


def test_every_kind_has_a_sender_and_a_receiver():
    for kind, (senders, receivers) in m.SENDS.items():
        assert senders and receivers, kind
    assert set(m.SENDS) == set(Kind)


def test_the_check_catches_a_role_that_drops_a_kind():
    """Broken mode: a decode rank without an ABORT_ACK handler fails the check."""
    assert not m.receives(Role.DECODE) <= (OWNER_RECEIVES - {Kind.ABORT_ACK}) | LOOP_KINDS


class _Installed:
    """What a role installs on its runtime."""

    rank, faults, cards = 1, None, {}

    def set_handlers(self, handlers, role) -> None:
        self.handlers, self.role = dict(handlers), role


def test_the_ranks_install_exactly_their_tables():
    from kvferry.engine.models import ReplayConfig, ReplayModel
    from kvferry.engine.pool import KVPool

    model = ReplayModel(ReplayConfig(layers=1, kv_heads=2, head_dim=32, max_positions=4096))
    owner_rt, writer_rt = _Installed(), _Installed()
    DecodeRank.serving(
        owner_rt,
        model,
        KVPool(model.pool_config(16, 8)),
        0,
        transfer_timeout_s=1,
        abort_deadline_s=1,
    )
    PrefillRank.serving(writer_rt, model, KVPool(model.pool_config(16, 8)), None, (0, 2), 0)
    assert set(owner_rt.handlers) == OWNER_RECEIVES | GROUP_RECEIVES and owner_rt.role == "decode"
    assert set(writer_rt.handlers) == WRITER_RECEIVES and writer_rt.role == "prefill"
