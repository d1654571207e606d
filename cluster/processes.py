"""What a host reads of a writer's process, for the proof that it is gone (I4).

The facts only: whether a pid on this host has exited, and how long a host keeps driving
its worker after seeing it gone (``DRAIN_S``) before the proof holds. The rule that turns
facts into a proof is :func:`kvferry.engine.protocol.gone_proof`; every host (the rank
runtime, the vLLM connector) gathers its facts here.
"""

from __future__ import annotations

DRAIN_S = 0.2  # progress after a writer's death before its quarantined pages are released


def process_gone(pid: int) -> bool:
    """True when ``pid`` has exited (a zombie has already dropped its mappings)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state in (b"Z", b"X")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True
