"""Runs spin and pan on the abort-acknowledgement model and reads pan's verdict.

Each `Check` names one model variant (the protocol or a mutant), the property it
verifies (safety: assertions and end states; liveness: the LTL property under
weak fairness) and the configuration switches. `run_check` works in a fresh
temporary directory because spin and pan write pan.* and trail files.

Run as a script it prints one JSON line per check:
    {"model": ..., "property": ..., "errors": N, "states": N, "seconds": S,
     "trail": bool, "config": ...}
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

MODEL = Path(__file__).with_name("abort_ack.pml")

# Configurations (see README.md): each keeps one pan run well under a minute.
CRASHES_AND_ENVIRONMENT = ("-DMAXFAULT=0", "-DMAXCRASH=1", "-DWFAIL=1", "-DOTHER_ACTS=1")
LOSSY_CHANNELS = ("-DMAXFAULT=2", "-DMAXCRASH=0", "-DWFAIL=1", "-DOTHER_ACTS=0")
LIVENESS = ("-DMAXFAULT=0", "-DMAXCRASH=0", "-DWFAIL=0", "-DOTHER_ACTS=0")
LIVENESS_CRASH = ("-DMAXFAULT=0", "-DMAXCRASH=1", "-DWFAIL=0", "-DOTHER_ACTS=0")
MUTANT_BASE = ("-DMAXFAULT=0", "-DMAXCRASH=0", "-DWFAIL=0", "-DOTHER_ACTS=1")
CRASH_BASE = ("-DMAXFAULT=0", "-DMAXCRASH=1", "-DWFAIL=0", "-DOTHER_ACTS=0")


@dataclass(frozen=True)
class Check:
    model: str  # "protocol" or the mutant's name
    prop: str  # "safety" or "liveness"
    config: str  # which configuration, for the report
    spin_defines: tuple[str, ...]
    expect_errors: bool  # a mutant must yield a counterexample
    gcc_defines: tuple[str, ...] = field(default=())
    optimize: str = "-O1"  # small searches: -O0 (compiling pan costs more than it saves)


@dataclass
class Verdict:
    check: Check
    errors: int
    states: int
    seconds: float
    trail: bool
    output: str

    def as_json(self) -> str:
        return json.dumps(
            {
                "model": self.check.model,
                "property": self.check.prop,
                "errors": self.errors,
                "states": self.states,
                "seconds": round(self.seconds, 2),
                "trail": self.trail,
                "config": self.check.config,
            }
        )


CHECKS: tuple[Check, ...] = (
    Check("protocol", "safety", "crashes_and_environment", CRASHES_AND_ENVIRONMENT, False),
    Check("protocol", "safety", "lossy_channels", LOSSY_CHANNELS, False),
    Check("protocol", "liveness", "reduced", LIVENESS + ("-DCHECK_LIVENESS",), False),
    Check("protocol", "liveness", "reduced_crash", LIVENESS_CRASH + ("-DCHECK_LIVENESS",), False),
    # A crashed remote writer keeps the page quarantined forever: no proof can come.
    Check(
        "remote_crash_quarantines",
        "liveness",
        "reduced_crash",
        LIVENESS_CRASH + ("-DCHECK_LIVENESS", "-DREMOTE_WRITERS"),
        True,
        optimize="-O0",
    ),
    Check(
        "release_on_sever",
        "safety",
        "mutant_base",
        MUTANT_BASE + ("-DMUTANT_RELEASE_ON_SEVER",),
        True,
        optimize="-O0",
    ),
    Check(
        "single_ack",
        "safety",
        "mutant_base",
        MUTANT_BASE + ("-DMUTANT_SINGLE_ACK",),
        True,
        optimize="-O0",
    ),
    Check(
        "free_source_at_abort",
        "safety",
        "mutant_base",
        MUTANT_BASE + ("-DMUTANT_FREE_SOURCE_AT_ABORT",),
        True,
        optimize="-O0",
    ),
    Check(
        "drop_severed_ack",
        "liveness",
        "reduced",
        LIVENESS + ("-DCHECK_LIVENESS", "-DMUTANT_DROP_SEVERED_ACK"),
        True,
        optimize="-O0",
    ),
    # The transport assumption behind "process gone" as proof, broken on purpose.
    Check(
        "lands_after_exit",
        "safety",
        "crash_base",
        CRASH_BASE + ("-DLANDS_AFTER_EXIT",),
        True,
        optimize="-O0",
    ),
)


class SpinError(RuntimeError):
    """spin or gcc failed before pan could give a verdict."""


def tools_missing() -> str | None:
    """The reason checks cannot run here, or None when spin and gcc exist."""
    for tool in ("spin", "gcc"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (Debian package: {tool})"
    return None


def _run(cmd: list[str], cwd: Path, timeout: float) -> str:
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    out = done.stdout + done.stderr
    if done.returncode != 0 and cmd[0] != "./pan":
        raise SpinError(f"{' '.join(cmd)} exited {done.returncode}:\n{out[-4000:]}")
    return out


def run_check(check: Check, timeout: float = 120.0) -> Verdict:
    liveness = check.prop == "liveness"
    gcc_flags = list(check.gcc_defines) + (["-DNFAIR=4"] if liveness else ["-DSAFETY"])
    pan_flags = ["-m100000"] + (["-a", "-f"] if liveness else [])
    with tempfile.TemporaryDirectory(prefix="kvferry-spin-") as tmp:
        work = Path(tmp)
        shutil.copy(MODEL, work / MODEL.name)
        start = time.monotonic()
        _run(["spin", *check.spin_defines, "-a", MODEL.name], work, timeout)
        _run(["gcc", check.optimize, "-w", *gcc_flags, "-o", "pan", "pan.c"], work, timeout)
        out = _run(["./pan", *pan_flags], work, timeout)
        seconds = time.monotonic() - start
        errors = re.search(r"errors:\s*(\d+)", out)
        states = re.search(r"(\d+)\s+states, stored", out)
        if errors is None or states is None:
            raise SpinError(f"pan gave no verdict for {check}:\n{out[-4000:]}")
        trail = (work / f"{MODEL.name}.trail").exists()
        return Verdict(check, int(errors.group(1)), int(states.group(1)), seconds, trail, out)


def main() -> int:
    reason = tools_missing()
    if reason:
        print(json.dumps({"skipped": reason}))
        return 2
    wrong = 0
    for check in CHECKS:
        verdict = run_check(check)
        print(verdict.as_json(), flush=True)
        if (verdict.errors > 0) != check.expect_errors:
            wrong += 1
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
