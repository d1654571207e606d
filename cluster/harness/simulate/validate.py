"""The simulator against the real local cluster: bench-abort's cluster cases (the writer
held before its write, so every abort waits for its ack; and requests cancelled at a
random moment) through a real cluster of 1 prefill x 1 decode rank and of 2 x 2, and the
same cases in the simulator, in one run. Prints one JSON line per scale and case: the
real and the simulated abort-to-release p50/p99 (the owner's, and from the router's
ABORT), and sim over real, with the service model (:mod:`.service`) and without it."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from ..benchabort import TAG, run_case
from ..faultsuite import start
from .scenarios import validation
from .world import run

SHAPES = ((1, 1), (2, 2))
CASES = ("quarantined", "random")


def _pick(s: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    return {f"{prefix}{k}": s.get(k) for k in ("count", "p50_ms", "p99_ms")}


def real(prefill: int, decode: int, requests: int, log_dir: Path) -> dict[str, dict[str, Any]]:
    out = {}
    extra = ["--prefill", str(prefill), "--fault", f"at:before-write:pause:{TAG}:1.0"]
    for case in CASES:
        cluster = start(1 + prefill + decode, extra, log_dir)
        try:
            every, quarantined, from_router = run_case(cluster, case, requests, seed=7)
        finally:
            cluster.stop()
        owner = quarantined if case == "quarantined" else every
        out[case] = {**_pick(owner), **_pick(from_router, "from_router_")}
    return out


def simulated(
    prefill: int, decode: int, requests: int, service: bool = True
) -> dict[str, dict[str, Any]]:
    out = {}
    for case in CASES:
        r = run(validation(case, prefill, decode, requests, service=service))
        owner = r["abort_release_quarantined"] if case == "quarantined" else r["abort_release"]
        out[case] = {
            **_pick(owner),
            **_pick(r["abort_from_router"], "from_router_"),
            "safe": r["safe"],
            "wall_s": r["wall_s"],
        }
    return out


def _ratio(a: Any, b: Any) -> float | None:
    if not isinstance(a, int | float) or not isinstance(b, int | float) or b <= 0:
        return None
    return round(a / b, 2)


def main(requests: int, log_dir: str | None = None) -> list[dict[str, Any]]:
    logs = Path(log_dir or tempfile.mkdtemp(prefix="kvferry-simulate-validate-"))
    logs.mkdir(parents=True, exist_ok=True)
    lines = []
    for prefill, decode in SHAPES:
        sim = simulated(prefill, decode, requests)
        off = simulated(prefill, decode, requests, service=False)
        rl = real(prefill, decode, requests, logs)
        keys = ("p50_ms", "p99_ms", "from_router_p50_ms", "from_router_p99_ms")
        for case in CASES:
            s, r, o = sim[case], rl[case], off[case]
            line = {
                "bench": "simulate-validate",
                "scale": f"{prefill}x{decode}",
                "case": case,
                "sim": s,
                "real": r,
                **{f"sim_over_real_{k}": _ratio(s.get(k), r.get(k)) for k in keys},
                # the same without the service model (--no-service-model)
                "no_service_model": {
                    f"sim_over_real_{k}": _ratio(o.get(k), r.get(k)) for k in keys
                },
            }
            print(json.dumps(line), flush=True)
            lines.append(line)
    return lines
