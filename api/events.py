"""Per-run event channels: the worker thread appends, any number of async readers follow.

A run's events (metadata, values, updates, messages, end) are kept for the life of the process so that
``join``, a late ``GET .../stream`` and the original streaming request all see the same sequence from
the start. The producer is the engine thread, the consumers are coroutines on the event loop, so
appends wake readers through ``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from typing import Any


class RunChannel:
    """Append-only list of (event, data) with async followers."""

    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []
        self.closed = False
        self.closed_at: float | None = None
        self.cancel = threading.Event()
        self._lock = threading.Lock()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    def publish(self, event: str, data: Any) -> None:
        with self._lock:
            if self.closed:
                return
            self.events.append((event, data))
            waiters = list(self._waiters)
        for loop, ev in waiters:
            loop.call_soon_threadsafe(ev.set)

    def close(self) -> None:
        with self._lock:
            self.closed = True
            self.closed_at = time.monotonic()
            waiters = list(self._waiters)
        for loop, ev in waiters:
            loop.call_soon_threadsafe(ev.set)

    async def follow(self, start: int = 0) -> AsyncIterator[tuple[str, Any]]:
        """Every event from index ``start`` on, until the channel closes."""
        loop = asyncio.get_running_loop()
        ev = asyncio.Event()
        with self._lock:
            self._waiters.append((loop, ev))
        try:
            i = start
            while True:
                ev.clear()
                while i < len(self.events):
                    yield self.events[i]
                    i += 1
                if self.closed and i >= len(self.events):
                    return
                await ev.wait()
        finally:
            with self._lock:
                self._waiters.remove((loop, ev))

    async def wait_closed(self) -> None:
        async for _ in self.follow(len(self.events)):
            pass
