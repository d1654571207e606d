"""The service's clock port: the process's monotonic clock.

The ranks read time only through a :class:`kvferry.engine.protocol.driver.Clock`; this is
the one the service passes them (the simulator passes its simulated clock, tests a clock
they move by hand).
"""

from __future__ import annotations

import time


class MonotonicClock:
    """``time.monotonic``, in seconds."""

    def now(self) -> float:
        return time.monotonic()
