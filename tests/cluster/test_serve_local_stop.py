"""``scripts/serve-local.sh --stop`` waits until every process of the cluster has exited.
A process that exited but is not reaped yet (a zombie: torchrun, or init once torchrun is
gone, reaps it later) has exited: counting it as running made ``--stop`` wait out its 15 s
and then kill what had already stopped. The script's ``alive`` counts a live process and
not a zombie; the broken mode (``kill -0``, which finds zombies too) is caught."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "serve-local.sh"
BROKEN_ALIVE = (
    'alive() { local p n=0; for p in "$@"; do kill -0 "$p" 2>/dev/null && n=$((n + 1)); '
    'done; echo "$n"; }'
)


def _alive_function() -> str:
    text = SCRIPT.read_text()
    match = re.search(r"^alive\(\) \{\n.*?^\}\n", text, flags=re.S | re.M)
    assert match, f"no alive() in {SCRIPT}"
    return match.group(0)


def _count(function: str, pids: list[int]) -> int:
    out = subprocess.run(
        ["bash", "-c", f"{function}\nalive {' '.join(map(str, pids))}"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    return int(out.stdout.strip())


def _zombie_and_live() -> tuple[subprocess.Popen, subprocess.Popen]:
    """A child that has exited and is not reaped (a zombie), and one still running."""
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    for _ in range(200):  # until the first has exited (its /proc entry says Z)
        state = Path(f"/proc/{zombie.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state == "Z":
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"process {zombie.pid} did not exit within 10 s")
    return zombie, live


def _counts(function: str) -> tuple[int, int]:
    zombie, live = _zombie_and_live()
    try:
        return _count(function, [zombie.pid]), _count(function, [zombie.pid, live.pid])
    finally:
        live.kill()
        live.wait()
        zombie.wait()


def test_a_zombie_has_exited_and_a_live_process_has_not():
    assert _counts(_alive_function()) == (0, 1)


def test_broken_kill_0_counts_the_zombie_as_running():
    assert _counts(BROKEN_ALIVE) == (1, 2)
