"""Runs spin and pan on the abort-acknowledgement model and reads pan's verdict.

Each `Check` names one model variant (the protocol or a mutant), the property it
verifies (safety: assertions and end states; liveness: the LTL property, under
weak fairness unless the check says otherwise) and the configuration switches.
`run_check` works in a fresh temporary directory because spin and pan write pan.*
and trail files.

Run as a script it prints one JSON line per check:
    {"model": ..., "property": ..., "errors": N, "states": N, "seconds": S,
     "trail": bool, "config": ...}
(liveness checks add "fair": whether only weakly fair runs counted).
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
# The writer set differs per owner (SPLIT), both owners real; aborts come from the
# owners' deadlines and the writers' failures (the front door adds states, not paths).
SPLIT = ("-DSPLIT", "-DFDOOR=0")
SPLIT_CRASHES = SPLIT + ("-DMAXFAULT=0", "-DMAXCRASH=1", "-DWFAIL=1")
SPLIT_LOSSY = SPLIT + ("-DMAXFAULT=1", "-DMAXCRASH=0", "-DWFAIL=1")
SPLIT_REDUCED = SPLIT + ("-DMAXFAULT=0", "-DMAXCRASH=0", "-DWFAIL=0")
# The pipelined path (point 6): each writer's first part, its part notice, then the rest.
PIPELINE = ("-DPIPELINE",)
# Owner 0's pages, written by both writers: a write lands in request 1's page or
# under the reader.
OWNER0_LEAK = r"assertion violated \((powner\[0\]==0|pstate\[0\]!=2)\)"


@dataclass(frozen=True)
class Check:
    model: str  # "protocol" or the mutant's name
    prop: str  # "safety" or "liveness"
    config: str  # which configuration, for the report
    spin_defines: tuple[str, ...]
    expect_errors: bool  # a mutant must yield a counterexample
    gcc_defines: tuple[str, ...] = field(default=())
    optimize: str = "-O1"  # small searches: -O0 (compiling pan costs more than it saves)
    # Liveness: only weakly fair runs count (pan -f). Without it every infinite run
    # counts, a stronger check when it verifies, and cheaper.
    fair: bool = True
    # A counterexample must match this (a regular expression over pan's output).
    witness: str = ""


@dataclass
class Verdict:
    check: Check
    errors: int
    states: int
    seconds: float
    trail: bool
    output: str

    def as_json(self) -> str:
        row = {
            "model": self.check.model,
            "property": self.check.prop,
            "errors": self.errors,
            "states": self.states,
            "seconds": round(self.seconds, 2),
            "trail": self.trail,
            "config": self.check.config,
        }
        if self.check.prop == "liveness":
            row["fair"] = self.check.fair
        return json.dumps(row)


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
    # The writer set differs per owner.
    Check("protocol", "safety", "split_crashes", SPLIT_CRASHES, False),
    Check("protocol", "safety", "split_lossy", SPLIT_LOSSY, False),
    Check(
        "protocol",
        "liveness",
        "split_reduced",
        SPLIT_REDUCED + ("-DCHECK_LIVENESS",),
        False,
        fair=False,
    ),
    Check(
        "release_first_ack",
        "safety",
        "split_reduced",
        SPLIT_REDUCED + ("-DMUTANT_RELEASE_FIRST_ACK",),
        True,
        optimize="-O0",
        witness=OWNER0_LEAK,
    ),
    Check(
        "first_page_writers",
        "safety",
        "split_reduced",
        SPLIT_REDUCED + ("-DMUTANT_FIRST_PAGE_WRITERS",),
        True,
        witness=OWNER0_LEAK,
    ),
    Check(
        "ack_one_owner",
        "liveness",
        "split_reduced",
        SPLIT_REDUCED + ("-DCHECK_LIVENESS", "-DMUTANT_ACK_ONE_OWNER"),
        True,
        optimize="-O0",
    ),
    # The same mutant keeps I4: the owner it does not ack waits, it never releases.
    Check(
        "ack_one_owner",
        "safety",
        "split_reduced",
        SPLIT_REDUCED + ("-DMUTANT_ACK_ONE_OWNER",),
        False,
    ),
    # The pipelined path: parts prove nothing; an abort between parts waits for the flush.
    Check("protocol", "safety", "pipeline_crashes", PIPELINE + CRASHES_AND_ENVIRONMENT, False),
    Check("protocol", "safety", "pipeline_lossy", PIPELINE + LOSSY_CHANNELS, False),
    Check(
        "protocol",
        "liveness",
        "pipeline_reduced",
        PIPELINE + LIVENESS + ("-DCHECK_LIVENESS",),
        False,
    ),
    Check(
        "part_proves",
        "safety",
        "pipeline_mutant_base",
        PIPELINE + MUTANT_BASE + ("-DMUTANT_PART_PROVES",),
        True,
        optimize="-O0",
        witness=OWNER0_LEAK,
    ),
    Check(
        "ack_mid_pipeline",
        "safety",
        "pipeline_mutant_base",
        PIPELINE + MUTANT_BASE + ("-DMUTANT_ACK_MID_PIPELINE",),
        True,
        optimize="-O0",
        witness=OWNER0_LEAK,
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
    pan_flags = (
        ["-m100000"] + (["-a"] if liveness else []) + (["-f"] if liveness and check.fair else [])
    )
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
        elif verdict.errors and not re.search(check.witness, verdict.output):
            wrong += 1
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
