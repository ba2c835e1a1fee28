"""The engine's threads for what is not a queued run (chat completions, replays), started in arrival order.

Queued workflow runs execute on queue worker threads (:mod:`elesium.api.run_executor`); both end up in
the same engine. An engine that batches (``inference/batcher.py``) decodes many generations in each
step, so it gets as many threads here as it has batch slots: each thread drives one generation and
the engine's step loop puts them all in one forward. An engine without a batcher gets one thread.

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
    """``threads`` daemon threads draining a FIFO of jobs."""

    def __init__(self, name: str = "elesium-engine", threads: int = 1) -> None:
        self._queue: queue.Queue[tuple[concurrent.futures.Future, Callable[[], Any]] | None] = queue.Queue()
        self._pending = 0
        self._running = 0  # jobs running now
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._loop, name=f"{name}-{i}", daemon=True)
                         for i in range(max(1, threads))]
        for thread in self._threads:
            thread.start()

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
            with self._lock:
                self._running += 1
            try:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn())
                    except BaseException as exc:  # noqa: BLE001 - handed to the awaiting request
                        future.set_exception(exc)
            finally:
                with self._lock:
                    self._pending -= 1
                    self._running -= 1

    def stop(self, timeout: float = 10.0) -> None:
        for _ in self._threads:
            self._queue.put(None)
        for thread in self._threads:
            thread.join(timeout)
