"""One generation as a stream of chunks, and how it holds its part of the engine while it runs.

A generation's context lives in a KV cache: a slot of the batcher's pool (``inference/batcher.py``,
many generations at once) or, on an engine that does not batch, the engine's one cache, which a second
generation must not touch until the first is finished or abandoned. Yet the caller's code runs between
chunks, and a stream may be dropped half-way (a client disconnects, a ``for`` loop breaks). So:

* the generation holds its slot (or the engine's :class:`FifoGate`) through its state object, not
  through a thread lock: it takes it on its first chunk and gives it back when it finishes, fails, is
  closed (``close()``, ``with``), when the ``for`` loop that iterated it is left early, or when the
  stream is garbage-collected. Waiting generations proceed in arrival order. With a batcher each chunk
  is the step loop's work (possibly one row of a shared forward), handed to the consumer's thread;
* ``torch.inference_mode()`` is entered around each decoder call only, never across a ``yield``, so
  the caller's code (and ``on_step``) never runs in inference mode;
* ``close()`` from another thread while the owner is inside a decoding step marks the run cancelled;
  the step finishes (the cache must stay consistent) and the stream ends right after it.

The run's state lives in :class:`_Run`, which holds no reference back to the :class:`GenerationStream`
or to its iterators, so that dropping the last reference to either finalises it at once under
CPython's reference counting instead of waiting for the cycle collector.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import torch

from elesium.inference.decoding.vanilla import VanillaDecoder
from elesium.inference.records import (
    Chunk,
    DecodeMode,
    FinishReason,
    Generation,
    GenerationTiming,
    StepRecord,
)
from elesium.inference.sampling import Sampler, SamplingParams
from elesium.inference.text_stream import TextStream

if TYPE_CHECKING:
    from elesium.inference.engine import Decoder, Engine

RunState = Literal["new", "running", "done", "closed", "failed"]
_LIVE: tuple[RunState, ...] = ("new", "running")


class _Run:
    """The state of one generation: decoder, detokeniser, queued chunks, and the engine's gate."""

    def __init__(self, engine: Engine, prompt_ids: list[int], params: SamplingParams, mode: DecodeMode,
                 seed: int, on_step: Callable[[StepRecord], None] | None, constraint: Any = None,
                 policy: Any = None, arrived_at: float | None = None, tenant: str | None = None) -> None:
        self.engine = engine
        self.tenant = tenant  # fair admission to the step loop's slots (Batcher._admit)
        self.prompt_ids = prompt_ids
        self.params = params
        self.mode = mode
        self.seed = seed
        self.on_step = on_step
        self.constraint = constraint
        self.policy = policy  # a tree policy in place of the engine's (None: the engine's)
        self.state: RunState = "new"
        self.result: Generation | None = None
        # Re-entrant: close() may run from a finaliser on a thread that is already inside next_chunk().
        self._mutex = threading.RLock()
        self._busy = False  # a thread is inside next_chunk() (waiting for the gate, or in a step)
        self._cancel = False
        self._chunks: deque[Chunk] = deque()
        self._decoder: Decoder | None = None
        self._text = TextStream(engine.tokenizer, params.stop)
        self._steps: list[StepRecord] = []
        self._finish: FinishReason | None = None
        # What the prefill and the steps produced and the consumer has not published yet (tokens, the
        # step's record or None for the prefill, when), oldest first: one entry, or several where the
        # batcher decodes ahead of a slow consumer (``Batcher.LOOKAHEAD``). Appended on the thread
        # driving the model, taken on the consumer's. And an error raised doing it on the batcher's
        # thread, for this stream's consumer to raise.
        self._produced: deque[tuple[list[int], StepRecord | None, float]] = deque()
        self._error: BaseException | None = None
        self._start = 0.0
        # Serving latency, handed to the engine's observers when the run ends (Engine.add_observer).
        # From the request's arrival where the caller queued it first (GenerationRequest.arrived_at).
        now = time.perf_counter()
        self.timing = GenerationTiming(now if arrived_at is None else min(arrived_at, now), len(prompt_ids),
                                       mode)
        # ``params.deadline_s`` counts from the arrival too: time queued before the engine is time spent.
        self.deadline = None if params.deadline_s is None else self.timing.created_at + params.deadline_s

    def past_deadline(self) -> bool:
        return self.deadline is not None and time.perf_counter() >= self.deadline

    def wait_s(self) -> float | None:
        """How long a thread waiting for this generation's turn may sleep before its deadline (None: no
        deadline)."""
        return None if self.deadline is None else max(0.0, self.deadline - time.perf_counter())

    # -- consumer side ------------------------------------------------------------------------
    def next_chunk(self) -> Chunk:
        with self._mutex:
            if self._busy:
                raise RuntimeError("this stream is already being advanced on another thread; "
                                   "iterate a stream from one consumer at a time")
            self._busy = True
        try:
            while True:
                if self._cancel and self.state in _LIVE:
                    self._end("closed")
                if self._chunks:
                    return self._chunks.popleft()
                if self.state not in _LIVE:
                    raise StopIteration
                if self.past_deadline():
                    self._cut()
                    continue
                self._advance()
        except StopIteration:
            raise
        except BaseException:
            self._end("failed")  # the cache is reset by the next prefill; give the engine back now
            raise
        finally:
            with self._mutex:
                self._busy = False
                cancelled_meanwhile = self._cancel and self.state in _LIVE
            if cancelled_meanwhile:
                self._end("closed")

    def close(self) -> None:
        """Stop the generation and give the engine back (after the current step, if one is running)."""
        with self._mutex:
            if self.state not in _LIVE:
                return
            self._cancel = True
            in_step = self._busy
        if in_step:
            # The owner thread ends the run when its step returns; a thread still queued for the gate
            # (or for the batcher) must wake up to notice the cancellation.
            self.engine._wake()
        else:
            self._end("closed")

    # -- producer side ------------------------------------------------------------------------
    def _advance(self) -> None:
        """Have the prefill or one decoding step run, then queue what became final.

        With a batcher (``inference/batcher.py``) the engine's step loop does the work, possibly as one
        row of a shared forward; without one this thread takes the engine's gate and does it itself.
        """
        engine = self.engine
        batcher = engine.batcher
        if batcher is not None:
            if not batcher.run(self):
                self._end("closed") if self._cancel else self._cut()
                return
            if self._error is not None:
                error, self._error = self._error, None
                raise error
            self._publish()
            batcher.drained()
            return
        else:
            if self.state == "new" and not engine._gate.acquire(self, cancelled=lambda: self._cancel,
                                                                 timeout=self.wait_s):
                self._end("closed") if self._cancel else self._cut()
                return
            self._work()
        self._publish()

    def _work(self) -> None:
        """The prefill or one step, on the thread driving the model; the outcome waits in ``_produced``."""
        engine = self.engine
        if self.state == "new":
            self.state = "running"
            if self.timing.gate_at is None:  # the step loop may have prefilled part of the prompt already
                self.timing.gate_at = time.perf_counter()
            self._start = self.timing.gate_at
            kwargs: dict[str, Any] = {} if self.constraint is None else {"constraint": self.constraint}
            if self.policy is not None:
                kwargs["policy"] = self.policy
            with torch.inference_mode():
                self._decoder = engine.make_decoder(self.mode, self.params, Sampler(self.seed), **kwargs)
                first = self._decoder.prefill(self.prompt_ids)
            self.timing.first_token_at = time.perf_counter()
            self._produced.append(([first], None, 0.0))
            return
        assert self._decoder is not None
        room = engine.context_length - self._decoder.offset
        if room < 1:
            self._finish = "length"
            return
        with torch.inference_mode():
            tokens, record = self._decoder.step(room)
        self._produced.append((tokens, record, time.perf_counter()))

    def _take_row(self, logits: torch.Tensor | None, greedy: int, start: float) -> None:
        """Finish a step that ran as one row of the batcher's shared forward."""
        decoder = self._decoder
        if decoder is None:  # closed from another thread while its row was in the forward
            return
        assert isinstance(decoder, VanillaDecoder)
        tokens, record = decoder.take(logits, greedy, start)
        self._produced.append((tokens, record, time.perf_counter()))

    def _take_chain(self, tokens: list[int], start: float) -> None:
        """Finish a greedy chain's steps that ran as one row of the batcher's shared forwards."""
        decoder = self._decoder
        if decoder is None:  # closed from another thread while its row was in the forward
            return
        assert isinstance(decoder, VanillaDecoder)
        now = time.perf_counter()
        self._produced.extend((taken, record, now) for taken, record in decoder.take_chain(tokens, start))

    def _publish(self) -> None:
        """Apply what ``_work`` produced: stop conditions, chunks, ``on_step``, the result at the end."""
        while self._produced and self._finish is None:
            tokens, record, stepped_at = self._produced.popleft()
            if record is None:  # the prefill's first token
                kept, out = self._commit(tokens)
                if kept:
                    self._chunks.append(Chunk(out, tuple(kept)))
            else:
                self._steps.append(record)
                if self.on_step is not None:
                    self.on_step(record)  # the caller's code: outside inference mode
                kept, out = self._commit(tokens)
                if kept:
                    self.timing.token_at.append(stepped_at)
                    self.timing.token_counts.append(len(kept))
                if kept or out:
                    self._chunks.append(Chunk(out, tuple(kept), record))
        if self._finish is not None:
            tail = self._text.flush()
            if tail:
                self._chunks.append(Chunk(tail, ()))
            self.result = Generation(
                text=self._text.text, token_ids=tuple(self._text.token_ids),
                prompt_tokens=len(self.prompt_ids), finish_reason=self._finish, mode=self.mode,
                seed=self.seed, elapsed_s=time.perf_counter() - self._start, steps=tuple(self._steps))
            self._end("done")

    def _commit(self, tokens: list[int]) -> tuple[list[int], str]:
        """Apply stop conditions token by token: a stop can land mid-way through a step."""
        text, params = self._text, self.params
        eos = self.engine.tokenizer.eos_ids
        kept: list[int] = []
        out = ""
        for t in tokens:
            if t in eos:
                self._finish = "eos"
                break
            kept.append(t)
            out += text.push(t)
            if text.stopped:
                self._finish = "stop"
                break
            if len(text.token_ids) >= params.max_tokens:
                self._finish = "length"
                break
        return kept, out

    def _cut(self) -> None:
        """The deadline passed: end with the tokens published so far (none if it never started).

        Tokens the step loop decoded ahead (``LOOKAHEAD``) and the consumer has not published are dropped,
        as past a stop string: the output is what was published, and the record keeps its length.
        """
        with self._mutex:
            if self.state not in _LIVE:
                return
        if self._finish is None:
            self._finish = "deadline"
        self._produced.clear()
        if not self._start:
            self._start = time.perf_counter()
        self._publish()

    def _end(self, state: RunState) -> None:
        """Enter a final state once and give the engine back (or leave its queue)."""
        with self._mutex:
            if self.state not in _LIVE:
                return
            self.state = state
            if state != "done":
                self._chunks.clear()
            self._decoder = None
            timing = self.timing
            timing.finished_at = time.perf_counter()
            timing.state = state
            timing.output_tokens = len(self._text.token_ids)
        if self.engine.batcher is not None:
            self.engine.batcher.release(self)
        else:
            self.engine._gate.release(self)
        # After the release: observers run on this thread, but the next generation need not wait.
        self.engine._notify(timing)


class GenerationStream:
    """Iterator of ``Chunk``s; ``result`` holds the ``Generation`` once it is exhausted.

    Iterate it once. Leaving the ``for`` loop early, ``close()``, the ``with`` block's end, or dropping
    the stream ends the generation and frees the engine for the next one at once. ``next(stream)``
    advances it without tying its life to a loop.
    """

    def __init__(self, engine: Engine, prompt_ids: list[int], params: SamplingParams, mode: DecodeMode,
                 seed: int, on_step: Callable[[StepRecord], None] | None, constraint: Any = None,
                 policy: Any = None, *, arrived_at: float | None = None, tenant: str | None = None) -> None:
        self._run = _Run(engine, prompt_ids, params, mode, seed, on_step, constraint, policy, arrived_at,
                         tenant)
        finalizer = weakref.finalize(self, self._run.close)
        finalizer.atexit = False

    @property
    def engine(self) -> Engine:
        return self._run.engine

    @property
    def prompt_ids(self) -> list[int]:
        return self._run.prompt_ids

    @property
    def params(self) -> SamplingParams:
        return self._run.params

    @property
    def mode(self) -> DecodeMode:
        return self._run.mode

    @property
    def seed(self) -> int:
        return self._run.seed

    @property
    def timing(self) -> GenerationTiming:
        """When this generation arrived, took the engine, produced tokens and ended (complete at its end)."""
        return self._run.timing

    @property
    def state(self) -> RunState:
        """"new", "running", "done" (finished normally), "closed" (stopped early) or "failed"."""
        return self._run.state

    def __iter__(self) -> _Cursor:
        return _Cursor(self)

    def __next__(self) -> Chunk:
        return self._run.next_chunk()

    def close(self) -> None:
        """End the generation now (or right after the step another thread is running) and free the engine."""
        self._run.close()

    def __enter__(self) -> GenerationStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def result(self) -> Generation:
        run = self._run
        if run.result is not None:
            return run.result
        if run.state == "closed":
            raise RuntimeError("the stream was closed before it finished; it has no result")
        if run.state == "failed":
            raise RuntimeError("the generation failed; see the exception its iteration raised")
        raise RuntimeError("the stream has not finished; iterate it to the end first")


class _Cursor:
    """One pass over a stream: what a ``for`` loop holds. Dropping it before the end closes the stream.

    A ``for`` loop that breaks (or raises) releases its iterator at once; making that iterator a
    separate object is what lets ``break`` free the engine even while the caller still holds the
    stream itself, e.g. to read its ``state``.
    """

    __slots__ = ("_stream", "_started")

    def __init__(self, stream: GenerationStream) -> None:
        self._stream = stream
        self._started = False

    def __iter__(self) -> _Cursor:
        return self

    def __next__(self) -> Chunk:
        self._started = True
        return self._stream._run.next_chunk()

    def __del__(self) -> None:
        if self._started:
            # A finaliser must not raise (e.g. at interpreter exit, when modules are half torn down).
            with contextlib.suppress(Exception):
                self._stream._run.close()
