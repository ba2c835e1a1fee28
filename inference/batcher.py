"""Continuous batching: every generation that wants its next step gets it in one shared forward.

Without it the engine served one generation at a time: ten workflow runs started together finished
one after another. With it, each generation holds a slot of a :class:`SlotPool` (its own KV cache)
from its prefill to its end, and one thread, the step loop, owns the model:

1. consumers ask for their next step (``GenerationStream`` pulls chunks as before, so nothing runs
   ahead of what its caller reads); the loop gathers the asks for a few milliseconds, until every
   running generation has asked or ``GATHER_S`` passes, so that a slow consumer delays the others by
   at most that;
2. new generations are admitted while slots are free, fairly between tenants (``_admit``), and
   prefilled one by one;
   while others are decoding, a long prompt's prefill is spread over iterations, at most
   ``PREFILL_BLOCKS`` blocks of prompt per iteration between their steps, so a newcomer delays each
   running generation's next token by a bounded amount (two 64-token blocks, ~0.2 s on 2 cores),
   not by its whole prompt; the blocks are the prefill's own (``ForwardRunner.prefill_blocks``),
   so the bits are the same however the prompt was spread;
3. every running vanilla generation contributes one row to **one** batched forward
   (``runtime/batched_step.py`` on the CPU, ``runtime/batched_cuda_step.py`` on CUDA); on the CPU a
   generation alone, a tree step (speculative decoding), and a device chain run their own forward on
   their own slot, through the same graphs the one-at-a-time engine always used; on CUDA a generation
   alone is a batch of one (the one-sequence graphs are bound to the engine's cache), newcomers' prompt
   blocks share a forward, and a tree step replays the pool's node graph for its slot;
4. each row's logits go back to its own decoder, which picks the token exactly as it would alone.

Joining and leaving happen between steps (a closed stream leaves at the next one, and its slot is
free for the next request). Exactness: a batched row computes bit for bit what the one-sequence step
computes (``tests/test_batched_step.py``), prefill is the same eager call into a cache of the same
layout, and sampling is per generation, so a generation's tokens do not depend on what else runs.

Work that needs the model but is not a generation (``Engine.hidden_states``) runs on the loop too,
between steps (:meth:`Batcher.call`), so only one thread ever drives torch.

On CUDA the loop also decodes vanilla generations up to ``LOOKAHEAD`` tokens ahead of their consumers,
whose threads would otherwise set its pace, runs a batch whose rows all decode greedily as a chain of
``CHAIN_STEPS`` steps in one graph replay (the picks fed back on the device), prefills a newcomer's
consecutive prompt blocks as rows of one forward, has newcomers pick their first token before the batch's
step so that they join it at once (``join_early``), wakes the consumers of rows it decoded ahead only once the
next step is running on the device (``defer_wakes``: their Python then overlaps the GPU's work), can launch a
greedy batch's next chain before handing the last one's tokens out (``overlap``, off until measured on a GPU:
the GPU would compute while the host hands tokens out and starts the next iteration), and can run
the newcomers' first round of blocks inside the batch's decode step (``fold_prefill``, off: on the H100 a
block cost as much riding on a step as in a forward of its own, BENCHMARKS §25, and its graphs lengthen
warm-up).

A greedy speculative generation admitted while others hold slots decodes plainly, as a row
(``PLAIN_WHEN_SHARING``): the same tokens, and no solo tree step for the batch to wait on.

Not here yet (``docs/design/batched-serving.md``): on the CPU, prefill blocks as rows of the batched
forward (they run as their own forward between steps); speculative trees inside the batch (on CUDA a tree
step is host-driven on its slot, without the self-feeding tree chains, which is why CUDA batches only when
``max_batch`` asks for it).

Deadlines (``SamplingParams.deadline_s``) end a generation at the first step boundary after them: its
consumer stops asking, and a consumer still waiting for a slot or a step wakes at its deadline and leaves
the queue (``run`` returns False), so the slot is free for the next iteration's admission.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar, cast

import torch

from elesium.errors import UserError
from elesium.inference.decoding.vanilla import VanillaDecoder
from elesium.inference.runtime.batched_step import BatchedCpuStep
from elesium.inference.runtime.cpu_step import window_for
from elesium.inference.runtime.forward import PREFILL_CHUNK, CudaGraphRunner, PartialPrefill
from elesium.inference.runtime.slot_pool import SlotPool

if TYPE_CHECKING:
    from elesium.inference.engine import Engine
    from elesium.inference.generation_stream import _Run
    from elesium.inference.runtime.batched_cuda_step import BatchedCudaStep, PromptBlock

T = TypeVar("T")
log = logging.getLogger("elesium")

GATHER_S = 0.004
"""How long the loop waits for running generations that have not asked for their next step yet."""
IDLE_EXIT_S = 30.0
"""The loop's thread ends after this long without work (it starts again on the next request), so an
engine that is dropped is not kept alive by its thread."""
PREFILL_BLOCKS = 2
"""Prompt blocks (``PREFILL_CHUNK`` tokens each) the loop prefills per iteration while generations are
decoding: their next token waits for these, so this bounds what a newcomer costs them. When nothing
is decoding, a prompt is prefilled whole at once."""
CUDA_PREFILL_FACTOR = 8
"""On CUDA a prompt block is one graph replay (~1 ms), not ~0.1 s of CPU work: eight times the blocks per
iteration keep a newcomer's cost to the running generations about the same fraction of a step's time."""
LOOKAHEAD = 16
"""Tokens the CUDA loop may decode for a vanilla generation before its consumer asks for them. On a GPU a
step of 32 rows takes ~1.3 ms, less than 32 consumer threads take to publish a token each and ask again
under the GIL, so a loop that waited for every ask ran at the consumers' pace (~5 ms a step, BENCHMARKS
§19). Decoding ahead is exact (the tokens are the ones the consumer would have asked for, published in
order) and wastes at most this many tokens of a generation that a stop string or a close ends. The CPU
loop does not: there a step costs tens of milliseconds and every row costs compute. 16 with
``WAKE_EVERY`` 8 and ``CHAIN_STEPS`` 8 served 32 concurrent requests 1.31x faster than 8 / 4 / 1 side by
side (BENCHMARKS §23)."""
WAKE_EVERY = 8
"""Tokens decoded ahead (``LOOKAHEAD``) that wake a waiting consumer: its stream then gets them eight at a
time (one chain, ~11 ms on an H100 at 32 rows) instead of one thread switch per token."""
CHAIN_STEPS = 8
"""Steps the CUDA loop runs in one replay when every row of its batch decodes greedily with room for them
(``BatchedCudaStep.decode_greedy``): each step's tokens go back in on the device, so the host stages the
batch, reads it back and takes the GIL from the consumers once per eight tokens instead of every token (at
32 concurrent the loop's time per step fell from 2.5 to 1.4 ms, the step's own GPU time, BENCHMARKS §23).
The same tokens (rows are independent and greedy picks the argmax either way); a row may end up to
``CHAIN_STEPS - 1`` tokens past ``LOOKAHEAD``, and tokens past an end of sequence or a stop are dropped as
for any token decoded ahead. A batch with a sampled or grammar-constrained row takes single steps. Off (1)
on the CPU, where a step is compute and chaining saves nothing."""
PLAIN_WHEN_SHARING = 1
"""A greedy speculative generation admitted while at least this many others hold slots decodes plainly, as a
row of the shared forward: its tokens are the same (greedy speculative decoding is token-identical to
vanilla decoding), and a row costs the batch little where a solo tree step makes every other row wait for it
(on the 2-core CPU a tree step costs ~75 ms and serving four speculative requests at once ran no faster than
one, BENCHMARKS §22). Sampled generations keep their trees: their seeded draws depend on the steps taken."""
RESERVE_AHEAD = 512
"""Positions past a generation's offset zeroed before its solo work (``SlotPool.reserve``): more than
any prefill chunk's or tree's reach within one step."""


class EngineBusyError(UserError, RuntimeError):
    """More generations are waiting for the engine than it queues (``max_waiting``)."""


class _Job:
    """A function to run on the loop's thread, and its outcome."""

    __slots__ = ("done", "error", "fn", "ready", "value")

    def __init__(self, fn: Callable[[], Any], ready: threading.Condition) -> None:
        self.fn = fn
        self.ready = ready  # its caller waits on it (the batcher's lock)
        self.done = False
        self.value: Any = None
        self.error: BaseException | None = None


class _InFlight(NamedTuple):
    """A greedy chain one iteration launched and a later one reads back (``Batcher.overlap``)."""

    rows: list[_Run]
    decoders: list[VanillaDecoder]
    steps: int
    collect: Callable[[], list[list[int]]]
    start: float


class Batcher:
    """The step loop of one engine: admission to slots, one batched forward per step, solo work between."""

    def __init__(self, engine: Engine, slots: int, *, max_waiting: int = 1024, compiled: bool = True) -> None:
        self.engine = engine
        self.slots = slots
        self.max_waiting = max_waiting
        self._compiled = compiled
        self._pool: SlotPool | None = None  # taken on first use: an idle engine reserves nothing
        self._step: BatchedCpuStep | BatchedCudaStep | None = None
        # On CUDA every vanilla row, a lone one too, takes the batched step: the one-sequence graphs are
        # bound to the engine's own cache, not to pool slots. On the CPU a lone row keeps its own graph.
        self._cuda = engine.model.device.type == "cuda"
        self._min_rows = 1 if self._cuda else 2
        self.lookahead = LOOKAHEAD if self._cuda else 0  # settable: tests run it on the CPU
        self.chain_steps = CHAIN_STEPS if self._cuda else 1  # settable, like lookahead
        self.chained_steps = 0  # batched steps run inside greedy chains (metrics, tests)
        self.plain_when_sharing: int | None = PLAIN_WHEN_SHARING  # None: speculative requests always draft
        self.plain_rows = 0  # greedy speculative generations decoded plainly because they shared the batch
        self.ahead_rows = 0  # rows decoded before their consumer asked (metrics, tests)
        self.prefill_rows = 0  # prompt blocks prefilled as rows of a shared forward (CUDA)
        self.consecutive_blocks = True  # a prompt's next blocks join its first in one prefill forward (CUDA)
        # Newcomers' first round of blocks rides in the decode step's forward (CUDA; set before warm-up,
        # which then captures the block-carrying graphs). Off: no gain measured (BENCHMARKS §25).
        self.fold_prefill = False
        self.folded_blocks = 0  # prompt blocks that rode in a decode step's forward (metrics, tests)
        # Newcomers' first tokens before the batch's step, so that they join it in the iteration that
        # prefilled them (CUDA, without ``fold_prefill``). On the H100, side by side: 1.04x the tokens/s at
        # 32 concurrent and 1.06x at 64, time to first token p50 69 -> 46 ms at 32 (BENCHMARKS §27e).
        self.join_early = True
        self.joined_early = 0  # newcomers that joined the step of the iteration that prefilled them (tests)
        # Consumers an iteration finished are woken when the next batched step has started on the device,
        # not at once (CUDA; settable: tests run it on the CPU). Woken at once, they run their Python while
        # the loop stages and replays the next prefill and picks first tokens, and every torch op there
        # hands them the GIL and waits to get it back (~2.7 ms a prefill forward at 32 concurrent on the
        # H100, BENCHMARKS §28c). Woken at the launch, they run while the GPU computes. Only rows the loop
        # decodes ahead are held: nothing waits for their consumers (a tree step's consumer must ask first).
        self.defer_wakes = self._cuda
        self._held_wakes: list[_Run] = []  # finished by the last iteration, to wake (``_flush_wakes``)
        # A batch of greedy rows keeps a chain on the device while the host works (for CUDA; tests run
        # it on the CPU step, whose chains run at their launch): once the loop has read a chain's tokens back
        # it launches the batch's next chain at once, from those tokens, and only then hands them to their
        # rows, finishes the iteration and starts the next one (admission, newcomers' prefill staging) while
        # the GPU computes. Without it the GPU waited for all of that between two chains (handing 32 rows
        # their tokens alone is ~1 ms a chain of ~9 ms, BENCHMARKS §29b). A row's tokens are the same: its
        # next chain starts from its last token at its next position, as it would after the hand-out.
        # Off until measured on a GPU (BENCHMARKS §30: no device was lent when it was written).
        self.overlap = False
        self._in_flight: _InFlight | None = None
        # The prompts that arrived while a greedy chain ran are admitted once its tokens are read back, and
        # their first blocks launched before those tokens are handed out (CUDA): the GPU computes them while
        # the host hands out, instead of while the next iteration waits on their first tokens (0.30 s a level
        # at 32 concurrent on the H100, mostly the prefill's GPU time, BENCHMARKS §29c). On the H100, side by
        # side, 10 repetitions in three calls: 1.04x the tokens/s at 32 concurrent, 1.03-1.07x at 64 (§31).
        self.prefill_early = self._cuda
        self.early_prefills = 0  # newcomers whose first blocks were launched that way (metrics, tests)
        self._early: set[_Run] = set()  # prefilled early, not yet seen by ``_prefill_together``
        self._settled_free: set[int] = set()  # the free slots when this iteration's work was taken
        self.overlapped_chains = 0  # chains launched before the last one's tokens were handed out (tests)
        self._warm_lock = threading.Lock()
        # One lock, one condition per waiter: the loop waits on ``_cond`` (asks, jobs, releases), and
        # each consumer and ``call`` on its own, so a finished step wakes only the threads whose
        # work it finished. With one shared condition every notify woke every waiting consumer:
        # ~16 asks a step times ~30 waiters, each taking the lock and the GIL from the loop.
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._waiters: dict[_Run, threading.Condition] = {}
        self._free: list[int] = list(range(slots - 1, -1, -1))
        self._slot: dict[_Run, int] = {}  # generations holding a slot (running or being prefilled)
        self._wanted: dict[_Run, None] = {}  # generations whose consumer waits for their next step, in order
        self._taken: set[_Run] = set()  # asks the loop is working on now
        self._done: set[_Run] = set()
        self._partial: dict[_Run, PartialPrefill] = {}  # prompts prefilled part of the way
        # Whose drafting state the runner's drafter cache holds, and the others' saved (``_own_drafter``).
        self._drafter_owner: _Run | None = None
        self._drafter_saved: dict[_Run, tuple[torch.Tensor, torch.Tensor]] = {}
        self.drafter_swaps = 0  # turns handed from one speculative generation to another (metrics, tests)
        self._jobs: deque[_Job] = deque()
        self._work_slots: dict[_Run, int] = {}  # the slots of this iteration's work, read in _next
        self._thread: threading.Thread | None = None
        # Counters for metrics and tests: forwards run, and rows of the batched ones.
        self.batched_steps = 0
        self.batched_rows = 0
        self.solo_steps = 0
        self.last_batch = 0
        self.largest_batch = 0
        self.split_prefills = 0  # prompts whose prefill was spread over more than one iteration
        # Seconds the loop spent on each kind of work since it was built (metrics: where serving time goes).
        # "batched_step" is the forward and "take_rows" the rows' tokens handed to their generations. On
        # CUDA a newcomer's prompt splits three ways: "prefill_forward" (its blocks in the shared prefill
        # forwards), "first_token" (its decoder picking the first token once every block is done) and
        # "prefill" (blocks left past the iteration's budget, run on its own; all of a prompt on the CPU).
        self.busy_s: dict[str, float] = dict.fromkeys(
            ("jobs", "prefill", "prefill_forward", "first_token", "solo_step", "batched_step", "take_rows",
             "gather"), 0.0)

    # -- what the engine and its streams call ------------------------------------------------------
    @property
    def pool(self) -> SlotPool:
        """``slots`` slots for generations plus one scratch slot for the warm-up's writes."""
        if self._pool is None:
            model = self.engine.model
            self._pool = SlotPool(model.config, self.slots + 1, self.engine.context_length, model.device,
                                  model.dtype)
        return self._pool

    def warm_up(self) -> None:
        """Compile the batched step now (once), on the calling thread: servers call it at start.

        Why ahead: compiling takes ~10 s with a warm inductor cache and minutes without. Left to the
        first step that could batch, it runs on the step loop and every running generation waits for
        it. Compiling on a thread beside the loop was tried and is worse: the trace holds the GIL,
        and the loop's solo steps ran about 7x slower for the whole compile (88 s against 12 s for
        twelve short generations, BENCHMARKS §16).
        """
        with self._warm_lock:
            if self._step is not None:
                return
            started = time.perf_counter()
            step: BatchedCpuStep | BatchedCudaStep
            if self._cuda:
                # Imported here: it imports Triton, which a CPU process never needs (and the kernel tests
                # must be able to switch to Triton's interpreter before anything imports it).
                from elesium.inference.runtime.batched_cuda_step import BatchedCudaStep

                runner = self.engine.runner
                buckets = runner.buckets if isinstance(runner, CudaGraphRunner) else ()
                step = BatchedCudaStep(self.engine.model, self.pool, self.slots, graphs=self._compiled,
                                       node_buckets=buckets, block=PREFILL_CHUNK, chain=self.chain_steps,
                                       fold=self.fold_prefill)
                step.warm_up()
            else:
                step = BatchedCpuStep(self.engine.model, self.pool, compiled=self._compiled,
                                      precompile=self.engine.precompile)
                scratch = self.slots  # never handed to a generation
                step.decode([0, 0], [0, 1], [scratch, scratch])
            step.on_launch = self._flush_wakes
            self._step = step  # set last: a step that sees it may use the compiled graph
            log.info("batched step ready in %.1f s", time.perf_counter() - started)

    @property
    def batching(self) -> bool:
        """Whether the batched step is compiled (before that, no step has had two rows)."""
        return self._step is not None

    @property
    def running(self) -> int:
        """Generations holding a slot."""
        with self._cond:
            return len(self._slot)

    @property
    def waiting(self) -> int:
        """Generations that asked to start and have no slot yet."""
        with self._cond:
            return sum(1 for r in self._wanted if r not in self._slot)

    def check_room(self) -> None:
        """Refuse a new generation when the queue is full (the caller should retry later)."""
        if self.waiting >= self.max_waiting:
            raise EngineBusyError(f"the engine is busy: {self.max_waiting} generations are already waiting "
                                  "for it; retry later")

    def run(self, run: _Run) -> bool:
        """Have the loop do ``run``'s next piece of work (its prefill or one step); wait for it.

        Returns False, without doing it, when the run was cancelled or its deadline passed before the
        loop took it (a queued generation leaves the queue at its deadline, not when a slot frees).
        """
        with self._lock:
            if run._produced or run._error is not None:  # decoded ahead (LOOKAHEAD): nothing to wait for
                return True
            self._start_thread()
            self._wanted[run] = None
            self._cond.notify()
            mine = self._waiters[run] = threading.Condition(self._lock)
            try:
                while True:
                    if run in self._done:
                        self._done.discard(run)
                        return True
                    if (run._cancel or run.past_deadline()) and run not in self._taken:
                        self._wanted.pop(run, None)
                        self._cond.notify()
                        return False
                    mine.wait(run.wait_s())  # wakes at the deadline, to leave the queue then
            finally:
                self._waiters.pop(run, None)

    def release(self, run: _Run) -> None:
        """``run`` ended: free its slot and forget its asks."""
        with self._cond:
            slot = self._slot.pop(run, None)
            if slot is not None:
                self._free.append(slot)
            self._wanted.pop(run, None)
            self._done.discard(run)
            self._partial.pop(run, None)
            self._early.discard(run)
            self._drafter_saved.pop(run, None)
            if self._drafter_owner is run:
                self._drafter_owner = None
            self._cond.notify()
            self._wake_run(run)

    def drained(self) -> None:
        """A consumer took what was decoded ahead for it: the loop may decode ahead again."""
        if self.lookahead:
            with self._lock:
                self._cond.notify()

    def wake(self) -> None:
        """Make waiting consumers re-check their cancellation."""
        with self._lock:
            self._cond.notify()
            for waiter in list(self._waiters.values()):
                waiter.notify()

    def _wake_run(self, run: _Run) -> None:
        """Wake ``run``'s consumer if it waits in :meth:`run` (called under the lock)."""
        waiter = self._waiters.get(run)
        if waiter is not None:
            waiter.notify()

    def _flush_wakes(self) -> None:
        """Wake the consumers held by ``defer_wakes``: called by the step once its forward is launched, and
        by the loop before it waits for anything and at the end of an iteration with no step, so a
        consumer is never held past the next iteration."""
        if not self._held_wakes:
            return
        with self._lock:
            held, self._held_wakes = self._held_wakes, []
            for run in held:
                self._wake_run(run)

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the loop's thread between two steps and return its value (or raise its error)."""
        with self._lock:
            job = _Job(fn, threading.Condition(self._lock))
            self._start_thread()
            self._jobs.append(job)
            self._cond.notify()
            while not job.done:
                job.ready.wait()
        if job.error is not None:
            raise job.error
        return job.value  # type: ignore[no-any-return]

    # -- the loop ---------------------------------------------------------------------------------------
    def _start_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="elesium-step-loop", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while True:
            jobs: list[_Job] = []
            work: list[_Run] = []
            deferred: set[_Run] = set()
            try:
                taken = self._next(jobs, work)
                if not taken:
                    return
                started = time.perf_counter()
                for job in jobs:
                    try:
                        job.value = job.fn()
                    except BaseException as exc:  # handed to the caller, which raises it
                        job.error = exc
                self.busy_s["jobs"] += time.perf_counter() - started
                deferred = self._execute(work)
            except BaseException as exc:  # a bug here must fail these generations, not hang everyone
                log.exception("the engine's step loop failed an iteration")
                for job in jobs:
                    job.error = job.error or exc
                for run in work:
                    run._error = run._error or exc
                self._drop_in_flight(exc)
            finally:
                with self._lock:
                    self._flush_wakes()  # the last iteration's, if this one launched no step
                    for job in jobs:
                        job.done = True
                        job.ready.notify()
                    for run in work:
                        self._taken.discard(run)
                        if run in deferred:  # prefilled part of the way: still asking
                            continue
                        if run in self._wanted and self._wakes_later(run):
                            continue
                        if run in self._wanted:  # else released meanwhile (a finaliser): nobody waits
                            del self._wanted[run]
                            self._done.add(run)
                            # Held for the next launch unless a chain already runs (``overlap``): then
                            # the GPU is busy now, and the consumer's Python is best run now.
                            if (self.defer_wakes and self._ahead_capable(run)  # decoded ahead meanwhile
                                    and self._in_flight is None):
                                self._held_wakes.append(run)
                            else:
                                self._wake_run(run)

    def _next(self, jobs: list[_Job], work: list[_Run]) -> bool:
        """Wait for work, gather the running generations' asks, admit new ones; fill ``jobs`` and ``work``.

        Returns False when the loop should end (idle for ``IDLE_EXIT_S``). Every walk over the shared
        collections goes over a copy: a stream's finaliser may release a run on this very thread (the
        lock is re-entrant) while one of them is being walked.
        """
        with self._cond:
            idle_since = time.monotonic()
            while not self._wanted and not self._jobs and not self._any_ahead() and self._in_flight is None:
                left = IDLE_EXIT_S - (time.monotonic() - idle_since)
                if left <= 0:
                    self._thread = None
                    return False
                self._flush_wakes()
                self._cond.wait(left)
            gather_from = time.monotonic()
            deadline = gather_from + GATHER_S
            while not self._jobs and any(r not in self._wanted and not self._ahead_capable(r)
                                         for r in list(self._slot)):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._flush_wakes()  # the runs it waits for may be among them
                self._cond.wait(left)
            self.busy_s["gather"] += time.monotonic() - gather_from
            jobs.extend(self._jobs)
            self._jobs.clear()
            self._admit()
            self._settled_free = set(self._free)
            work.extend(r for r in list(self._wanted) if r in self._slot)
            ahead = [r for r in list(self._slot) if r not in self._wanted and self._runs_ahead(r)]
            self.ahead_rows += len(ahead)
            work.extend(ahead)
            self._taken.update(work)
            # Read under the lock: a run decoded ahead may be closed (and its slot freed) while the step
            # runs; its slot is handed out again only by the next iteration's admission.
            self._work_slots = {r: self._slot[r] for r in work}
            return True

    def _prefill_together(self, new: list[_Run], budget: int | None,
                          carry: Callable[[list[PromptBlock]], list[torch.Tensor]] | None = None
                          ) -> tuple[int | None, set[_Run], bool]:
        """CUDA: the newcomers' next prompt blocks as rows of one forward (``BatchedCudaStep.prefill``),
        round after round while ``budget`` (blocks; None: no limit) lasts. Their decoders' ``prefill``
        then finds the blocks done (``ForwardRunner.partial``). Returns the budget left, the runs whose
        prefill started in this call, and whether ``carry`` ran.

        ``carry`` (the batch's decode step, ``_decode_batch``) takes the first round instead of a prefill
        forward of its own: the blocks ride in the step's forward (``BatchedCudaStep.decode_rows``), which
        costs little more than the step, where a prefill forward costs about a whole step's launches.

        A round takes each newcomer's next block, then each one's block after that, and so on, up to the
        forward's rows: consecutive blocks of one prompt share a forward, because each layer writes every
        row's keys before any row attends (``pool_forward``), so a later block sees the earlier ones'. A
        two-block prompt then costs one replay, not two (prompt prefills were a quarter of the wall at 32
        concurrent, BENCHMARKS §21c)."""
        step = cast("BatchedCudaStep", self._step)
        started = time.perf_counter()
        fresh = {r for r in new if r not in self._partial or r in self._early}
        self._early.difference_update(new)
        partials = [(r, self._partial.setdefault(r, PartialPrefill(list(r.prompt_ids)))) for r in new]
        for run, _ in partials:
            if run.timing.gate_at is None:
                run.timing.gate_at = started  # its prefill starts now, whatever its pieces
        chunk, most = step.block, step.max_prefill_blocks
        carried_s, offered = 0.0, carry is not None
        while budget is None or budget > 0:
            rows = most if budget is None else min(budget, most)
            picked: list[tuple[int, int]] = []  # (newcomer, a block's first position)
            for depth in range(rows if self.consecutive_blocks else 1):
                for i, (_, partial) in enumerate(partials):
                    at = partial.done + depth * chunk
                    if len(picked) < rows and at < len(partial.ids) and step.fits_prefill(at):
                        picked.append((i, at))
            if not picked:
                break
            group = [(*partials[i], at) for i, at in sorted(picked)]  # a prompt's blocks in order
            blocks = [(self._work_slots[r], p.ids[at:at + chunk], at) for r, p, at in group]
            if carry is not None:
                carried_from = time.perf_counter()
                hidden = carry(blocks)
                carried_s += time.perf_counter() - carried_from  # the step's time, counted there
                self.folded_blocks += len(group)
                carry = None
            else:
                hidden = step.prefill(blocks)
            for (_, partial, _), h in zip(group, hidden, strict=True):
                partial.parts.append(h)
                partial.done += h.shape[0]
            self.prefill_rows += len(group)
            if budget is not None:
                budget -= len(group)
        self.busy_s["prefill_forward"] += time.perf_counter() - started - carried_s
        return budget, fresh, offered and carry is None

    def _ahead_capable(self, run: _Run) -> bool:
        """Whether ``run`` is a generation the loop decodes ahead of its consumer (see ``LOOKAHEAD``)."""
        if (not self.lookahead or run.state != "running" or run._cancel or run._error is not None
                or run.past_deadline()):
            return False
        decoder = run._decoder
        return isinstance(decoder, VanillaDecoder) and decoder.grammar is None and _batchable(run)

    def _runs_ahead(self, run: _Run) -> bool:
        """Whether the loop decodes ``run``'s next token now, unasked: it is capable, its consumer is fewer
        than ``LOOKAHEAD`` tokens behind, and the token can still be part of its output (no end of
        sequence yet, ``max_tokens`` not reached; a stop string is found only as the consumer publishes)."""
        decoder = run._decoder  # read once: a close on another thread sets it to None
        if (not isinstance(decoder, VanillaDecoder) or not self._ahead_capable(run) or run._finish is not None
                or len(run._produced) >= self.lookahead):
            return False
        eos = run.engine.tokenizer.eos_ids
        return 1 + decoder.steps < run.params.max_tokens and decoder.pending not in eos

    def _wakes_later(self, run: _Run) -> bool:
        """Whether ``run``'s waiting consumer is left asleep until more tokens are ready: a run decoded ahead
        wakes its consumer every ``WAKE_EVERY`` tokens (or at its end), not every step, because each
        wake-up is a thread switch under the GIL, which on CUDA costs more than the step's work for
        the token (BENCHMARKS §19). Its first token is the exception: a consumer that has published nothing
        yet is woken at once, so its time to first token is the prefill's, not ``WAKE_EVERY`` more steps
        (a sampled row takes one token a step, so that wait was seven steps on CUDA)."""
        produced = run._produced
        if produced and produced[0][1] is None:  # the prefill's first token waits, unpublished
            return False
        return len(produced) < WAKE_EVERY and self._runs_ahead(run)

    def _any_ahead(self) -> bool:
        return bool(self.lookahead) and any(self._runs_ahead(r) for r in list(self._slot))

    def _admit(self) -> None:
        """Give free slots to new generations, fairly between tenants (called under the lock).

        Each free slot goes to the waiting generation whose tenant holds the fewest slots now, the
        earliest arrival among equals: one tenant's burst takes the slots nobody else asks for, and a
        second tenant's request gets the next free slot however many the first has queued. Within a
        tenant it is first come, first served. A slot is the unit because it is what a generation
        holds for its whole life, whatever its speed.
        """
        waiting = [r for r in list(self._wanted) if r not in self._slot and not r._cancel]
        held = Counter(r.tenant for r in list(self._slot))
        while self._free and waiting:
            run = min(waiting, key=lambda r: held[r.tenant])  # min keeps the earliest of equals
            waiting.remove(run)
            if self._goes_plain(run):
                run.mode = run.timing.mode = "vanilla"
                run.policy = None
                self.plain_rows += 1
            held[run.tenant] += 1
            self._slot[run] = self._free.pop()

    def _own_drafter(self, run: _Run) -> None:
        """Make the runner's drafter cache hold ``run``'s drafting state before its tree work.

        Heads with a drafter of their own (the shipped ones: an attention drafter) keep its keys and values
        in one cache on the runner, position for position beside the sequence's; the captured graphs read
        that cache where it is. So the speculative generations sharing the engine take turns in it: the
        one whose state it holds keeps it, and another's turn first saves the holder's positions written so
        far and copies its own back. Before this, one speculative generation at a time could hold a slot,
        and a sampled speculative request waited for as long as another one's client took to read its
        stream. Exact: positions from a decoder's ``offset`` on are written before they are read (each
        draft first writes the rows accepted since the last), so the saved prefix is the whole state, and
        a generation drafts from the bits it would have alone. A copy is ~0.1 MB per 100 positions.
        """
        cache = self.engine.runner.drafter_cache
        if cache is None or self._drafter_owner is run:
            return
        with self._lock:
            owner, self._drafter_owner = self._drafter_owner, run
            decoder = None if owner is None else owner._decoder
            if owner is not None and owner in self._slot and decoder is not None:
                n = decoder.offset
                self._drafter_saved[owner] = (cache[0][..., :n, :].clone(), cache[1][..., :n, :].clone())
            saved = self._drafter_saved.pop(run, None)
            self.drafter_swaps += owner is not None
        if saved is not None:
            n = saved[0].shape[-2]
            cache[0][..., :n, :].copy_(saved[0])
            cache[1][..., :n, :].copy_(saved[1])

    def _goes_plain(self, run: _Run) -> bool:
        """Whether a newcomer admitted now decodes plainly (``PLAIN_WHEN_SHARING``; called under the lock).

        Decided once, at admission, before its decoder exists: the same tokens either way, and its result
        says "vanilla", the mode it decoded in (a replay compares tokens, which do not change)."""
        return (self.plain_when_sharing is not None and run.mode == "speculative" and run.params.greedy
                and len(self._slot) >= self.plain_when_sharing)

    def _execute(self, work: list[_Run]) -> set[_Run]:
        """Run this iteration's work; return the new generations whose prefill is only partly done."""
        rows = [r for r in work if r.state == "running" and _batchable(r)]
        if len(rows) < self._min_rows:
            rows = []
        if self._step is None and (rows or self._cuda):  # on CUDA prefills and tree steps use its graphs too
            log.warning("compiling the batched step on the step loop: %d generations wait for it "
                        "(warm the engine up at start: Engine.warm_up)", len(work))
            self.warm_up()
        # While anything decodes, newcomers' prompts share a budget of blocks per iteration.
        budget = (PREFILL_BLOCKS * (CUDA_PREFILL_FACTOR if self._cuda else 1)
                  if any(r.state == "running" for r in list(self._slot)) else None)
        deferred: set[_Run] = set()
        fresh: set[_Run] = set()
        alone: set[_Run] = set()  # done before the batch's step
        stepped = False
        flying = self._in_flight  # a chain the last iteration left running (``overlap``)
        if self._cuda and self._step is not None:
            # With ``fold_prefill`` the batch's step first, carrying the newcomers' first round of prompt
            # blocks (their first tokens, in the loop below, then wait for one forward, not for a prefill
            # forward and a step); without it the prefill forwards, then (``join_early``) the newcomers'
            # first tokens, then the step.
            new = [r for r in work if r.state == "new"]
            batch = self._held(rows)
            carry = functools.partial(self._decode_batch, batch) if batch and self.fold_prefill else None
            budget, fresh, carried = self._prefill_together(new, budget, carry)
            if self.join_early and not carried:
                # The newcomers' first tokens before the step, and those it can decode ahead join it: a
                # newcomer then decodes from the iteration that prefilled it, not from the next one.
                for run in new:
                    budget = self._work_alone(run, budget, fresh, deferred)
                alone.update(new)
                joining = [r for r in new if r not in deferred and _batchable(r) and self._runs_ahead(r)]
                self.joined_early += len(joining)
                batch = self._held(rows + joining)
            if batch and not carried:
                self._decode_batch(batch, [])
            stepped = True
        for run in work:
            if (rows and run in rows) or run in alone:
                continue
            budget = self._work_alone(run, budget, fresh, deferred)
        batch = [] if stepped else self._held(rows)
        if batch:
            self._decode_batch(batch, [])
        if flying is not None and self._in_flight is flying:  # no batch took its rows over: hand them out
            self._land()
        return deferred

    def _work_alone(self, run: _Run, budget: int | None, fresh: set[_Run], deferred: set[_Run]) -> int | None:
        """``run``'s work on its own slot: a newcomer's prompt (what ``budget`` leaves of it; a prompt past
        the budget goes on in a later iteration and joins ``deferred``) and its first token, or a step
        outside the batch (a tree step). Returns the budget left."""
        engine, pool = self.engine, self.pool
        runner = engine.runner
        if self._in_flight is not None and run in self._in_flight.rows:
            self._land()  # its decoder must hold the tokens in flight before it works alone
        slot = self._work_slots[run]
        kind = "prefill" if run.state == "new" else "solo_step"
        offset = run._decoder.offset if run._decoder is not None else len(run.prompt_ids)
        started = time.perf_counter()
        pool.reserve(slot, window_for(offset + RESERVE_AHEAD, pool.max_len))
        runner.cache = pool.cache(slot)
        if isinstance(runner, CudaGraphRunner) and self._cuda and self._step is not None:
            runner.slot_step = (self._step, slot)  # type: ignore[assignment]
        try:
            if kind == "prefill":
                resumed = run in self._partial and run not in fresh
                partial = self._partial.setdefault(run, PartialPrefill(list(run.prompt_ids)))
                if run.timing.gate_at is None:
                    run.timing.gate_at = started  # its prefill starts now, whatever its pieces
                if budget is not None:
                    with torch.inference_mode():
                        runner.prefill_blocks(partial, 0)  # prefix-cache hits cost nothing
                    need = -(-partial.left // PREFILL_CHUNK)
                    if need > budget:
                        with torch.inference_mode():
                            runner.prefill_blocks(partial, min(budget, need - 1))
                        budget -= min(budget, need - 1)
                        deferred.add(run)
                        return budget
                    budget -= need
                self.split_prefills += resumed
                runner.partial = partial
                if self._cuda and partial.left == 0:
                    kind = "first_token"
            if run.mode != "vanilla":
                self._own_drafter(run)
            run._work()
        except BaseException as exc:
            run._error = exc
            deferred.discard(run)
        finally:
            runner.cache = engine.cache
            if isinstance(runner, CudaGraphRunner):
                runner.slot_step = None
            runner.partial = None
            if run not in deferred:
                self._partial.pop(run, None)
            self.solo_steps += 1
            self.busy_s[kind] += time.perf_counter() - started
        return budget

    def _held(self, rows: list[_Run]) -> list[tuple[_Run, VanillaDecoder]]:
        """The batch: ``rows`` with their decoders, each read once (one decoded ahead may be closed on its
        consumer's thread meanwhile); empty if fewer than ``_min_rows`` are left."""
        held = [(r, r._decoder) for r in rows]
        batch = [(r, d) for r, d in held if isinstance(d, VanillaDecoder)]
        return batch if len(batch) >= self._min_rows else []

    def _decode_batch(self, batch: list[tuple[_Run, VanillaDecoder]],
                      blocks: list[PromptBlock]) -> list[torch.Tensor]:
        """One batched step, or a chain of them (``_chain_length``), for ``batch``, with ``blocks`` (CUDA)
        riding in its first forward; hand each row its tokens. Returns the blocks' hidden states.

        With ``overlap`` a greedy batch's chain is left running (``_decode_overlapped``); anything else first
        lands the chain in flight, so that every decoder holds its tokens."""
        assert self._step is not None
        if self.overlap and not blocks and self._overlappable(batch):
            self._decode_overlapped(batch)
            return []
        landed = self._land()
        # Rows whose tokens were in flight are stepped again only if they still decode ahead (one may have
        # reached its end of sequence or its max_tokens there).
        batch = [(r, d) for r, d in batch if r not in landed or self._runs_ahead(r)]
        if len(batch) < self._min_rows:
            return cast("BatchedCudaStep", self._step).prefill(blocks) if blocks else []
        rows = [r for r, _ in batch]
        decoders = [d for _, d in batch]
        tokens, offsets = [d.pending for d in decoders], [d.offset for d in decoders]
        slots = [self._work_slots[r] for r in rows]
        cuda = cast("BatchedCudaStep", self._step)  # blocks are only ever given on CUDA
        hidden: list[torch.Tensor] = []
        start = time.perf_counter()
        steps = self._chain_length(batch)
        if steps > 1:
            if blocks:
                out = cuda.decode_rows(tokens, offsets, slots, steps, blocks)
                chains, hidden = out.picks, out.hidden
            else:
                chains = self._step.decode_greedy(tokens, offsets, slots, steps)
            self._count_batch(len(rows), steps)
            self.chained_steps += steps
            self.busy_s["batched_step"] += time.perf_counter() - start
            if self.prefill_early and self._cuda and not self.fold_prefill and not blocks:  # fold: they ride
                self._prefill_arrivals()
            self._take_chains(rows, decoders, chains, start)
            return hidden
        logits: torch.Tensor | None
        if blocks:
            out = cuda.decode_rows(tokens, offsets, slots, 1, blocks)
            logits, picks, hidden = out.logits, [p[0] for p in out.picks], out.hidden
        else:
            logits, greedy = self._step.decode(tokens, offsets, slots)
            picks = greedy if isinstance(greedy, list) else greedy.tolist()  # one read-back, not one per row
        assert logits is not None
        self._count_batch(len(rows), 1)
        taking = time.perf_counter()
        self.busy_s["batched_step"] += taking - start
        with torch.inference_mode():
            for b, run in enumerate(rows):
                try:
                    run._take_row(logits[b], picks[b], start)
                except BaseException as exc:
                    run._error = exc
        self.busy_s["take_rows"] += time.perf_counter() - taking
        return hidden

    def _prefill_arrivals(self) -> None:
        """``prefill_early``: admit the generations that arrived while the chain ran and launch their first
        prompt blocks (the iteration's prefill budget), without waiting for them.

        The next iteration's ``_prefill_together`` finds those blocks done (the same forward, so the same
        bits) and its first tokens wait only for what is left. Only slots that were free when this
        iteration took its work are handed out: one freed since (its consumer closed it) may still be used
        by this iteration's later work. A failed launch forgets the newcomers' blocks; they start again
        in the next iteration."""
        with self._lock:
            later = [s for s in self._free if s not in self._settled_free]
            self._free = [s for s in self._free if s in self._settled_free]
            try:
                self._admit()
            finally:
                self._free.extend(later)
            self._settled_free.intersection_update(self._free)
            new = [r for r in list(self._wanted) if r in self._slot and r.state == "new"
                   and r not in self._taken and r not in self._partial and not r._cancel]
            for run in new:
                self._work_slots[run] = self._slot[run]
        if not new:
            return
        try:
            self._prefill_together(new, PREFILL_BLOCKS * CUDA_PREFILL_FACTOR)
        except Exception:
            log.exception("prefilling %d arrivals early failed; they start again next iteration", len(new))
            for run in new:
                self._partial.pop(run, None)
            return
        self._early.update(r for r in new if r in self._partial)
        self.early_prefills += len(new)

    def _take_chains(self, rows: list[_Run], decoders: list[VanillaDecoder], chains: list[list[int]],
                     start: float) -> None:
        """Hand each row its chain's tokens, up to its max_tokens and its end of sequence: the rest were
        decoded past its end (their keys lie past its output, in a slot it leaves when it finishes)."""
        taking = time.perf_counter()
        for run, decoder, chain in zip(rows, decoders, chains, strict=True):
            try:
                eos = run.engine.tokenizer.eos_ids
                kept = chain[:max(1, run.params.max_tokens - 1 - decoder.steps)]
                end = next((i + 1 for i, token in enumerate(kept) if token in eos), len(kept))
                run._take_chain(kept[:end], start)
            except BaseException as exc:
                run._error = exc
        self.busy_s["take_rows"] += time.perf_counter() - taking

    def _overlappable(self, batch: list[tuple[_Run, VanillaDecoder]]) -> bool:
        """Whether ``batch`` may run as an overlapped chain: chains and decoding ahead on, every row greedy,
        and every row whose tokens are not in flight has room for a chain (a row in flight is checked at its
        position after them, in ``_decode_overlapped``, which leaves it out if it has no room)."""
        if self.chain_steps <= 1 or not self.lookahead or not batch:
            return False
        flying = () if self._in_flight is None else self._in_flight.rows
        return all(d.greedy and (r in flying or d.offset + self.chain_steps <= r.engine.context_length)
                   for r, d in batch)

    def _decode_overlapped(self, batch: list[tuple[_Run, VanillaDecoder]]) -> None:
        """Read the chain in flight back, launch ``batch``'s next chain, then hand the read-back tokens out
        while it runs; the new chain is read back by a later iteration (``overlap``).

        A row whose tokens were in flight starts its next chain from its last token there, one position past
        them, if those tokens leave it decoding ahead (``_continues``); a row that joined since starts from
        its decoder's state. The tokens a row is handed are those of one chain after another, so they are the
        ones it gets without the overlap."""
        assert self._step is not None
        prev, self._in_flight = self._in_flight, None
        start = time.perf_counter()
        landed = prev.collect() if prev is not None else []
        after = {} if prev is None else dict(zip(prev.rows, landed, strict=True))
        prev_steps = 0 if prev is None else prev.steps
        steps = self.chain_steps
        rows: list[_Run] = []
        decoders: list[VanillaDecoder] = []
        tokens: list[int] = []
        offsets: list[int] = []
        for run, decoder in batch:
            if run in after:
                nxt = self._continues(run, decoder, after[run], prev_steps)
                if nxt is None or nxt[1] + steps > run.engine.context_length:
                    continue
                token, offset = nxt
            else:
                token, offset = decoder.pending, decoder.offset
            rows.append(run)
            decoders.append(decoder)
            tokens.append(token)
            offsets.append(offset)
        if len(rows) >= self._min_rows:
            slots = [self._work_slots[r] for r in rows]
            collect = self._step.launch_greedy(tokens, offsets, slots, steps)
            self._in_flight = _InFlight(rows, decoders, steps, collect, start)
            self._count_batch(len(rows), steps)
            self.chained_steps += steps
            self.overlapped_chains += prev is not None
        self.busy_s["batched_step"] += time.perf_counter() - start
        if prev is not None:
            self._take_chains(prev.rows, prev.decoders, landed, prev.start)

    def _continues(self, run: _Run, decoder: VanillaDecoder, chain: list[int],
                   steps: int) -> tuple[int, int] | None:
        """The next input token and position of ``run`` once it takes ``chain`` (not taken yet), if it still
        decodes ahead then (``_runs_ahead``, as it will read after the hand-out), else None."""
        eos = run.engine.tokenizer.eos_ids
        taken = chain[:max(1, run.params.max_tokens - 1 - decoder.steps)]
        if (len(taken) < steps or any(t in eos for t in taken)
                or 1 + decoder.steps + steps >= run.params.max_tokens or not self._ahead_capable(run)
                or run._finish is not None or len(run._produced) >= self.lookahead):
            return None
        return taken[-1], decoder.offset + steps

    def _land(self) -> set[_Run]:
        """Read the chain in flight back and hand its rows their tokens; return those rows."""
        prev, self._in_flight = self._in_flight, None
        if prev is None:
            return set()
        started = time.perf_counter()
        chains = prev.collect()
        self.busy_s["batched_step"] += time.perf_counter() - started
        self._take_chains(prev.rows, prev.decoders, chains, prev.start)
        return set(prev.rows)

    def _drop_in_flight(self, error: BaseException) -> None:
        """A failed iteration: the chain in flight is read back (so that the step may launch again) and its
        rows fail with the iteration's error."""
        prev, self._in_flight = self._in_flight, None
        if prev is None:
            return
        for run in prev.rows:
            run._error = run._error or error
        try:
            prev.collect()
        except BaseException:  # the device failed: the rows already carry the error
            log.exception("reading back the chain in flight failed")

    def _count_batch(self, rows: int, steps: int) -> None:
        self.batched_steps += steps
        self.batched_rows += rows * steps
        self.last_batch = rows
        self.largest_batch = max(self.largest_batch, rows)

    def _chain_length(self, batch: list[tuple[_Run, VanillaDecoder]]) -> int:
        """``chain_steps`` if every row of ``batch`` picks greedily (no grammar) and its slot has room for
        that many more positions, else 1 (a shorter chain would be a graph of its own). A row with fewer
        tokens left to its ``max_tokens`` rides along and keeps only those: at 32 rows of 128 tokens some
        row is almost always within a few tokens of its end."""
        steps = self.chain_steps
        if steps <= 1:
            return 1
        for run, decoder in batch:
            if not decoder.greedy or decoder.offset + steps > run.engine.context_length:
                return 1
        return steps


def _batchable(run: _Run) -> bool:
    """Whether ``run``'s next step can be a row of the batched forward: a vanilla step with room left."""
    decoder = run._decoder
    return (isinstance(decoder, VanillaDecoder) and decoder.batchable
            and decoder.offset < run.engine.context_length)
