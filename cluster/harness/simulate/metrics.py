"""What a run measures, and the safety checks: collected while the world runs, summed up
into one JSON-able dict per scenario, and printed as a table."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kvferry.cluster.router import latency_summary
from kvferry.engine.protocol.proof import is_justified
from kvferry.engine.protocol.words import Answer, Release


@dataclass
class Metrics:
    answers: Counter[str] = field(default_factory=Counter)
    messages: Counter[str] = field(default_factory=Counter)
    counts: Counter[str] = field(default_factory=Counter)
    releases: Counter[str] = field(default_factory=Counter)  # owner releases by reason
    justifications: Counter[str] = field(default_factory=Counter)  # ... by their proof
    abort_release_ms: list[float] = field(default_factory=list)  # owner's, every abort
    quarantined_release_ms: list[float] = field(default_factory=list)  # those that waited
    severed_pairs: set[tuple[int, int]] = field(default_factory=set)
    severed_writers: set[int] = field(default_factory=set)
    q_share: list[float] = field(default_factory=list)  # fleet quarantine share, per sample
    q_worst: list[float] = field(default_factory=list)  # worst rank's share, per sample

    def on_release(self, how: Release, abort_ms: float | None, justification: str) -> None:
        self.releases[how.value] += 1
        self.justifications[justification] += 1
        if abort_ms is not None:
            self.abort_release_ms.append(abort_ms)
            if how is not Release.FREED:
                self.quarantined_release_ms.append(abort_ms)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))]


def _ms(values: list[float]) -> dict[str, Any]:
    s = latency_summary(values)
    return {k: s[k] for k in ("count", "p50_ms", "p99_ms", "max_ms") if k in s}


def summary(
    scenario: Any, world: Any, wall_s: float, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    mt: Metrics = world.metrics
    truth = world.truth
    submitted = world.submitted
    answered = sum(mt.answers.values())
    control = sum(mt.messages.values())
    end = world.end_state()
    checks = {
        "no_release_while_landing": truth.released_while_landing == 0,
        "no_page_overwritten": truth.overwritten == 0 and truth.landed_in_free == 0,
        "every_page_free_at_end": end["held_pages"] == end["stranded_pages"],
        "every_request_answered": answered == submitted and not world.unanswered(),
        "every_release_justified": all(is_justified(label) for label in mt.justifications),
    }
    out: dict[str, Any] = {
        "bench": "simulate",
        "scenario": scenario.name,
        "scale": scenario.scale,
        "mode": scenario.mode,
        "seed": scenario.seed,
        "tp": scenario.tp,
        "network": scenario.net.latency.source,
        "requests": submitted,
        "served": mt.answers[Answer.OK.value],
        "failed": mt.answers[Answer.FAILED.value],
        "aborted": mt.answers[Answer.ABORTED.value],
        "unavailable": mt.answers[Answer.UNAVAILABLE.value],
        "rejected": mt.answers[Answer.REJECTED.value],
        "quarantine_peak_share": round(max(mt.q_share, default=0.0), 5),
        "quarantine_p99_share": round(_pct(mt.q_share, 0.99), 5),
        "quarantine_worst_rank_peak_share": round(max(mt.q_worst, default=0.0), 4),
        "abort_release": _ms(mt.abort_release_ms),
        "abort_release_quarantined": _ms(mt.quarantined_release_ms),
        "abort_from_router": _ms(world.router.abort_from_router_ms),
        "releases": dict(mt.releases),
        "release_justifications": dict(mt.justifications),
        "unjustified_releases": sum(
            n for label, n in mt.justifications.items() if not is_justified(label)
        ),
        "severed_ranks": len(mt.severed_writers),
        "sever_events": len(mt.severed_pairs),
        "unhealthy_ranks": len(world.router.unhealthy),
        "control_messages_per_request": round(control / max(1, submitted), 2),
        "messages": dict(sorted(mt.messages.items())),
        "net": {**vars(world.net.counters)},
        "released_while_landing_pages": truth.released_while_landing,
        "released_while_landing_requests": truth.released_while_landing_requests,
        "overwritten_pages": truth.overwritten,
        "overwritten_requests": len(truth.overwritten_requests),
        "landed_in_free_pages": truth.landed_in_free,
        "held_pages_at_end": end["held_pages"],
        "stranded_pages": end["stranded_pages"],
        "stranded_requests": end["stranded_requests"],
        "ledger_held_at_end": end["ledger_held"],
        "unanswered": len(world.unanswered()),
        "checks": checks,
        "safe": all(checks.values()),
        "leak": truth.released_while_landing > 0 or truth.overwritten > 0,
        "examples": truth.examples,
        "sim_span_s": round(world.clock.now, 3),
        "events": world.clock.events,
        "wall_s": round(wall_s, 3),
        "events_per_s": round(world.clock.events / max(wall_s, 1e-9)),
        **(extra or {}),
        **world.notes,
    }
    return out


COLUMNS = [
    ("scenario", "scenario", "{}"),
    ("scale", "scale", "{}"),
    ("mode", "mode", "{}"),
    ("requests", "req", "{}"),
    ("served", "ok", "{}"),
    ("failed", "fail", "{}"),
    ("aborted", "abrt", "{}"),
    ("unavailable", "503", "{}"),
    ("quarantine_peak_share", "q peak", "{:.4f}"),
    ("quarantine_p99_share", "q p99", "{:.4f}"),
    ("abort_release.p50_ms", "a2r p50", "{:.2f}"),
    ("abort_release.p99_ms", "a2r p99", "{:.1f}"),
    ("abort_release.max_ms", "a2r max", "{:.0f}"),
    ("abort_release_quarantined.count", "q-rel", "{}"),
    ("abort_release_quarantined.p99_ms", "q-a2r p99", "{:.0f}"),
    ("severed_ranks", "sev", "{}"),
    ("control_messages_per_request", "msg/req", "{:.1f}"),
    ("released_while_landing_pages", "rel!land", "{}"),
    ("overwritten_pages", "overwr", "{}"),
    ("landed_in_free_pages", "late", "{}"),
    ("stranded_pages", "strand", "{}"),
    ("safe", "safe", "{}"),
    ("wall_s", "wall s", "{:.1f}"),
    ("events_per_s", "ev/s", "{}"),
]


def _get(row: dict[str, Any], key: str) -> Any:
    value: Any = row
    for part in key.split("."):
        value = value.get(part, "-") if isinstance(value, dict) else "-"
    return value


def table(rows: list[dict[str, Any]]) -> str:
    cells = [[h for _, h, _ in COLUMNS]]
    for row in rows:
        line = []
        for key, _, fmt in COLUMNS:
            v = _get(row, key)
            line.append(fmt.format(v) if v != "-" else "-")
        cells.append(line)
    widths = [max(len(r[i]) for r in cells) for i in range(len(COLUMNS))]
    return "\n".join(" ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells)
