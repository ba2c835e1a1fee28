"""Per-run event channels: a producer thread appends (the event pump relaying a queued run's Redis events,
or the engine thread for a chat completion), any number of async readers follow.

A channel keeps its run's events (metadata, values, updates, messages, end) from the first one, so that
``join``, a late ``GET .../stream`` and the original streaming request all see the same sequence; ended
channels are dropped after 10 minutes (a queued run's events stay in Redis for an hour). The producer
is a thread, the consumers are coroutines on the event loop, so appends wake readers through
``loop.call_soon_threadsafe``.
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


class EventPump:
    """Relays runs' events from Redis (:class:`~elesium.state.run_events.RunEvents`) into local channels.

    Whichever process executes a queued run, its events reach this server's SSE readers through one
    daemon thread that polls every followed run's stream (non-blocking reads, so one thread serves
    any number of runs on a plain Redis or a Cluster) and closes the channel at the run's end. One tick
    reads every followed run in one round trip (:meth:`RunEvents.read_many`).
    """

    def __init__(self, events: Any, *, interval_s: float = 0.02) -> None:
        self.events = events
        self.interval_s = interval_s
        self._subs: dict[str, tuple[str, RunChannel, str]] = {}  # run -> (thread, channel, last id)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="elesium-events", daemon=True)
        self._thread.start()

    def follow(self, thread_id: str, run_id: str, channel: RunChannel) -> RunChannel:
        """Feed ``channel`` with the run's events from the first one on."""
        with self._lock:
            self._subs[run_id] = (thread_id, channel, "0")
        self._wake.set()
        return channel

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(2.0)

    def _loop(self) -> None:
        from elesium.state.errors import StateError
        from elesium.state.run_events import END

        while not self._stop.is_set():
            with self._lock:
                subs = list(self._subs.items())
            try:
                batches = self.events.read_many([(thread_id, run_id, last)
                                                 for run_id, (thread_id, _, last) in subs])
            except StateError:
                batches = []  # Redis unavailable: retry on the next tick
            for (run_id, (thread_id, channel, last)), rows in zip(subs, batches, strict=False):
                for entry_id, event, data in rows:
                    last = entry_id
                    if event == END:
                        channel.close()
                        break
                    channel.publish(event, data)
                with self._lock:
                    if channel.closed:
                        self._subs.pop(run_id, None)
                    elif run_id in self._subs:
                        self._subs[run_id] = (thread_id, channel, last)
            self._wake.wait(self.interval_s)
            self._wake.clear()
