"""Sleeping in an asyncio loop until the transfer engine has work.

The router serves HTTP on asyncio and drives its engine from the same thread. Polling the
engine on a fixed tick costs a wake-up per tick and delays every message by up to a tick;
instead the loop watches the engine's event fd (armed before each sleep) and wakes the
moment a message or a completion arrives, or when the runtime gets new work from an HTTP
handler (a watched send, a timer).
"""

from __future__ import annotations

import asyncio

from kvferry.transfer import TransferEngine


class EngineWaker:
    def __init__(self, engine: TransferEngine, loop: asyncio.AbstractEventLoop) -> None:
        self._engine = engine
        self._loop = loop
        self._waiter: asyncio.Future | None = None
        self._fd = engine.fileno()
        loop.add_reader(self._fd, self.wake)

    def wake(self) -> None:
        """End the current :meth:`sleep` (no-op when none)."""
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def sleep(self, timeout_s: float) -> None:
        """Until the engine has work, :meth:`wake` is called, or ``timeout_s`` passed.
        Returns after one turn of the loop when work is already pending."""
        if timeout_s <= 0 or not self._engine.arm():
            await asyncio.sleep(0)
            return
        self._waiter = waiter = self._loop.create_future()
        timer = self._loop.call_later(timeout_s, self.wake)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None

    def close(self) -> None:
        self._loop.remove_reader(self._fd)
