"""The engine's own thread for what is not a queued run (chat completions, replays), in arrival order.

Queued workflow runs execute on queue worker threads (:mod:`elesium.api.run_executor`); both end up in
the same engine, which decodes one sequence at a time behind its FIFO gate.

The model runs on one engine that generates one sequence at a time, and a generation is CPU-bound for
seconds; on the event loop it would freeze health checks, listings and every open SSE stream. So the
server hands each job to this worker (a FIFO queue drained by one daemon thread) and awaits its
future. Jobs report progress through thread-safe callbacks (see :mod:`elesium.api.events`); a job
stops early when its cancel event is set (the tapped engine checks it between chunks and closes the
engine stream, which releases the engine at once).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class EngineWorker:
    """One daemon thread draining a FIFO of jobs."""

    def __init__(self, name: str = "elesium-engine") -> None:
        self._queue: queue.Queue[tuple[concurrent.futures.Future, Callable[[], Any]] | None] = queue.Queue()
        self._pending = 0
        self._running = 0  # 1 while a job runs
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @property
    def depth(self) -> int:
        """Jobs queued or running (the ``elesium_engine_queue_depth`` gauge)."""
        return self._pending

    @property
    def queued(self) -> int:
        """Jobs waiting for the thread, not yet started (part of ``elesium_num_requests_waiting``)."""
        return max(0, self._pending - self._running)

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            self._pending += 1
        # The caller's context (its trace span among others) goes with the work to the worker thread.
        context = contextvars.copy_context()
        self._queue.put((future, lambda: context.run(fn)))
        return future

    async def run(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the worker and await its result without blocking the loop."""
        return await asyncio.wrap_future(self.submit(fn))

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, fn = item
            self._running = 1
            try:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn())
                    except BaseException as exc:  # noqa: BLE001 - handed to the awaiting request
                        future.set_exception(exc)
            finally:
                with self._lock:
                    self._pending -= 1
                    self._running = 0

    def stop(self, timeout: float = 10.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout)
