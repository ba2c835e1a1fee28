"""The worker loop: take runs from the :class:`~elesium.state.queue.RunQueue`, execute, heartbeat.

Used by ``elesium worker`` and, in-process, by ``elesium serve`` (the single-machine default). One
:class:`QueueWorker` runs up to ``concurrency`` runs at once on threads (the engine serialises LLM
calls itself; the other steps of other runs overlap them), plus:

* a fetch loop: new entries (``XREADGROUP``) and, every half lease, entries whose worker died
  (``XAUTOCLAIM``), only while a slot is free, so a busy worker never hoards runs; every ten leases
  it also removes consumer names of exited workers (idle 20 leases, nothing pending);
* a heartbeat thread: every ``lease_ttl / 4`` (at most 0.5 s) it renews each held lease and resets its
  entry's idle time, and turns what it learns into flags :meth:`Lease.check` raises on: lease lost, cancel
  requested (from any machine, through Redis), per-run timeout passed;
* graceful stop (SIGTERM in ``elesium worker``): no new runs; in-flight ones get ``grace_s`` to
  finish; the rest are handed back (lease released, entry left pending and marked idle, so another
  worker resumes them from their last checkpoint within half a lease TTL, not after a lease timeout).

The executor: ``execute(run_id, lease) -> None``. Returning means the run succeeded
(returning the string "interrupted" means it stopped at a LangGraph ``interrupt``);
:class:`RunCancelledError` / :class:`RunTimeoutError` end it cancelled / failed; :class:`LeaseLostError`
means another worker owns it now (nothing is recorded); a Redis outage (``RedisUnavailableError``, or
redis-py's own connection / timeout errors) leaves the entry pending for a retry; any other exception
fails the run with its one-line message. The worker takes the executor as an argument, and has no
default: the layers that know how to run a payload (the API, the CLI) sit above this one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import redis.exceptions

from elesium.state.errors import RedisUnavailableError, StateError
from elesium.state.queue import (
    Delivery,
    Lease,
    LeaseLostError,
    LeaseReleasedError,
    RunCancelledError,
    RunQueue,
    RunTimeoutError,
    _now_ms,
    new_worker_id,
)

Executor = Callable[[str, Lease], object]
_OUTAGE = (RedisUnavailableError, redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
"""What an executor raises when the server was lost: the run is retried, not failed."""
log = logging.getLogger("elesium.worker")


class QueueWorker:
    """Executes queued runs until :meth:`stop`.

    Args:
        queue: the run queue (its lease TTL sets the heartbeat and reclaim cadence).
        execute: the executor callback (see the module docstring).
        concurrency: runs executed at once.
        worker_id: the consumer name; unique per process by default.
        block_ms: how long one XREADGROUP waits for new entries.
    """

    def __init__(self, queue: RunQueue, execute: Executor, *, concurrency: int = 1,
                 worker_id: str | None = None, block_ms: int = 500) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self.queue = queue
        self.execute = execute
        self.concurrency = concurrency
        self.worker_id = worker_id or new_worker_id()
        self.block_ms = block_ms
        self._leases: dict[str, Lease] = {}
        self._futures: set[Future[None]] = set()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._stopped = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="elesium-run")
        self._threads: list[threading.Thread] = []
        self.completed = 0

    # ------------------------------------------------------------ lifecycle
    def start(self) -> QueueWorker:
        """Start the fetch loop and the heartbeat in background threads."""
        self.queue.ensure_group()
        loops = ((self._fetch_loop, "elesium-fetch"), (self._heartbeat_loop, "elesium-heartbeat"))
        for target, name in loops:
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def run_forever(self) -> None:
        """Start and block until :meth:`stop` has finished (from a signal handler or another thread)."""
        self.start()
        while not self._stopped.wait(0.5):
            pass

    def stop(self, grace_s: float = 30.0) -> list[str]:
        """Stop taking runs; wait up to ``grace_s`` for in-flight ones; hand back the rest.

        Returns the ids of the runs handed back.
        """
        self._stopping.set()
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and self.in_flight():
            time.sleep(0.05)
        handed: list[str] = []
        with self._lock:
            leases = list(self._leases.values())
        for lease in leases:
            lease.abort(LeaseReleasedError, "worker shutting down: run handed back")
            try:
                if self.queue.release(lease):
                    handed.append(lease.run_id)
            except StateError:
                pass  # the lease expires by itself; the fence keeps the next owner safe
        # Executors see the hand-back at their next step; don't wait for a long LLM call.
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._stopped.set()
        for thread in self._threads:  # the fetch loop returns after its current blocking read
            if thread is not threading.current_thread():
                thread.join(self.block_ms / 1000 + 1.0)
        return handed

    def join(self, timeout_s: float) -> bool:
        """After :meth:`stop`: wait for executor threads to return; False if some still run."""
        deadline = time.monotonic() + timeout_s
        while self.in_flight() and time.monotonic() < deadline:
            time.sleep(0.05)
        return not self.in_flight()

    def in_flight(self) -> int:
        with self._lock:
            return len(self._futures)

    # ------------------------------------------------------------ loops
    def _free(self) -> int:
        return 0 if self._stopping.is_set() else self.concurrency - self.in_flight()

    def _fetch_loop(self) -> None:
        next_reclaim = next_prune = 0.0
        while not self._stopping.is_set():
            if time.monotonic() >= next_prune:  # exited workers' consumer names, idle for 20 lease TTLs
                next_prune = time.monotonic() + self.queue.lease_ttl_ms * 10 / 1000
                try:
                    self.queue.prune_consumers(self.queue.lease_ttl_ms * 20)
                except StateError:
                    pass
            free = self._free()
            if free <= 0:
                time.sleep(0.02)
                continue
            try:
                deliveries: list[Delivery] = []
                if time.monotonic() >= next_reclaim:
                    deliveries = self.queue.reclaim(self.worker_id, free)
                    next_reclaim = time.monotonic() + self.queue.lease_ttl_ms / 2000
                if not deliveries:
                    deliveries = self.queue.read_new(self.worker_id, free, self.block_ms)
                for delivery in deliveries:
                    self._start(delivery)
            except StateError as exc:
                log.warning("queue unavailable, retrying: %s", str(exc).splitlines()[0])
                time.sleep(0.5)

    def _start(self, delivery: Delivery) -> None:
        if self._stopping.is_set():
            return  # left pending: reclaimed by another worker
        claimed = self.queue.claim(delivery, self.worker_id)
        if isinstance(claimed, str):
            if claimed.startswith("done:"):
                self.queue.ack(delivery.entry_id)
            return  # "busy": the owner is alive; it acknowledges the entry when it finishes
        lease = claimed
        log.info("run %s: claimed (attempt %d, token %d)", lease.run_id, lease.attempt, lease.token)
        with self._lock:
            try:
                future = self._pool.submit(self._run, lease)
            except RuntimeError:  # stopping: the pool is shut down; hand the run straight back
                self._release_quietly(lease)
                return
            self._leases[lease.run_id] = lease
            self._futures.add(future)
        future.add_done_callback(lambda f: self._discard(f))

    def _discard(self, future: Future[None]) -> None:
        with self._lock:
            self._futures.discard(future)

    def _run(self, lease: Lease) -> None:
        try:
            self._execute_one(lease)
        finally:
            with self._lock:
                self._leases.pop(lease.run_id, None)

    def _execute_one(self, lease: Lease) -> None:
        status, error = "succeeded", ""
        try:
            lease.check()
            if self.execute(lease.run_id, lease) == "interrupted":
                status = "interrupted"
        except LeaseReleasedError:
            return
        except LeaseLostError as exc:
            log.warning("run %s: lease lost (%s); another worker owns it", lease.run_id, exc)
            return
        except RunCancelledError:
            status, error = "cancelled", "cancelled"
        except RunTimeoutError as exc:
            status, error = "failed", str(exc)
        except _OUTAGE as exc:
            # redis-py's own errors too: a saver or log that does not translate them still lost the
            # server, not the run; recording "failed" would end a run that a retry resumes.
            log.warning("run %s: Redis unavailable (%s); it will be retried", lease.run_id, exc)
            self._release_quietly(lease)
            return
        # Broad on purpose: this is the executor contract's "any other exception fails the run". The
        # failure is what gets recorded (status "failed", its first line as the error, the traceback
        # logged), so nothing is hidden; what must not end the run that way is caught above.
        except Exception as exc:
            log.exception("run %s failed", lease.run_id)
            status, error = "failed", (str(exc).splitlines() or [type(exc).__name__])[0] or type(exc).__name__
        self._finish(lease, status, error)

    def _finish(self, lease: Lease, status: str, error: str) -> None:
        for delay in (0.0, 0.2, 0.5, 1.0, 2.0, 4.0):
            time.sleep(delay)
            try:
                if self.queue.finish(lease, status, error):
                    self.completed += 1
                    log.info("run %s: %s%s", lease.run_id, status, f" ({error})" if error else "")
                return
            except RedisUnavailableError:
                continue  # the outcome is re-derived from the checkpoint by whoever reclaims it
        self._release_quietly(lease)

    def _release_quietly(self, lease: Lease) -> None:
        try:
            self.queue.release(lease)
        except StateError:
            pass

    def _heartbeat_loop(self) -> None:
        # Every TTL/4 keeps a lease alive through three missed beats; at most every 0.5 s so that a cancel
        # (which the renewal reports) stops a run within about half a second wherever it runs.
        interval = min(self.queue.lease_ttl_ms / 4000, 0.5)
        while not self._stopped.wait(interval):
            with self._lock:
                leases = list(self._leases.values())
            for lease in leases:
                if lease.aborted:
                    continue
                deadline = lease.deadline_ms
                if deadline is not None and _now_ms() > deadline:
                    limit = lease.timeout_ms / 1000
                    lease.abort(RunTimeoutError, f"run exceeded its time limit of {limit:g} s")
                    continue
                try:
                    held, cancelled = self.queue.renew(lease)
                    if not held:
                        lease.abort(LeaseLostError, f"run {lease.run_id!r}: another worker took the lease")
                    elif cancelled:
                        lease.abort(RunCancelledError, f"run {lease.run_id!r} was cancelled")
                    else:
                        self.queue.touch(lease, self.worker_id)
                except StateError as exc:
                    log.warning("heartbeat failed for run %s: %s", lease.run_id, str(exc).splitlines()[0])
