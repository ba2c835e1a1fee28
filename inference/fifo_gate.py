"""A first-come, first-served gate that an object (not a thread) owns.

The engine has one KV cache, so one generation at a time may use it. A generation is a stream that
the caller advances chunk by chunk, possibly from different threads (a web server hands each
``next()`` to whichever worker thread is free), and between chunks the caller's own code runs. A
``threading.Lock`` held across those chunks would tie the engine to whichever thread happened to
take it and would stay held when the caller walks away. This gate is owned by a token (the
generation's state object) instead: ``acquire`` queues the token and waits until it is first in line,
``release`` removes it wherever it is (first in line or still waiting), so a generation that is
closed while it waits leaves the queue without ever running, and the next one in line proceeds.

The condition's lock is re-entrant because a release may run from a garbage-collection finaliser,
which can fire on a thread that is already inside one of these methods.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable


class FifoGate:
    """Mutual exclusion in arrival order, owned by a token object rather than by a thread."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.RLock())
        self._queue: deque[object] = deque()

    def acquire(self, token: object, *, cancelled: Callable[[], bool] = lambda: False,
                timeout: Callable[[], float | None] = lambda: None) -> bool:
        """Queue ``token`` and wait until it owns the gate.

        Returns False (and leaves the queue) when ``cancelled()`` becomes true, when ``timeout()`` (the
        seconds left to wait, None: no limit; asked again at each wake-up, e.g. a generation's deadline)
        reaches 0, or when the token was released by another thread while it waited; True once the token
        is first in line.
        """
        with self._cond:
            if token not in self._queue:
                self._queue.append(token)
            while True:
                if token not in self._queue:
                    return False  # released (cancelled) by another thread while waiting
                if self._queue[0] is token:
                    return True
                left = timeout()
                if cancelled() or (left is not None and left <= 0):
                    self._remove(token)
                    return False
                self._cond.wait(left)

    def release(self, token: object) -> None:
        """Give up ownership, or a place in the queue; a token that holds neither is ignored."""
        with self._cond:
            self._remove(token)

    def wake(self) -> None:
        """Make waiters re-check their ``cancelled`` callbacks (called after a cancellation)."""
        with self._cond:
            self._cond.notify_all()

    def _remove(self, token: object) -> None:
        try:
            self._queue.remove(token)
        except ValueError:
            return
        self._cond.notify_all()

    def owns(self, token: object) -> bool:
        with self._cond:
            return bool(self._queue) and self._queue[0] is token

    @property
    def busy(self) -> bool:
        """Whether a generation holds the engine."""
        with self._cond:
            return bool(self._queue)

    @property
    def waiting(self) -> int:
        """Generations queued behind the one that holds the engine."""
        with self._cond:
            return max(0, len(self._queue) - 1)
