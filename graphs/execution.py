"""Run execution: the one place that drives a workflow run, for the CLI, the API's queue workers,
background runs and audit replay alike.

A run is: its config (:func:`run_config`: run id, thread, seed, tenant, the engine its nodes decode
on, the acceptance log, calibrations), the engine as its LLM nodes see it (:class:`RunEngine`:
records every call, stops on cancel, serves recorded calls during a replay), and one pass of the
compiled graph (:func:`drive`). The callers differ only in where they write what happened (a run
registry, the API's run rows and event stream, a replay report), which they pass in as callbacks or
read from the returned :class:`Outcome`.

What must be the same on every path, and so is written once here:

- the engine check (:func:`check_engine`): a run recorded on one engine fingerprint is never
  resumed or re-executed on another (its tokens would differ);
- the calibration versions a run's nodes decoded with (:func:`recorded_calibrations`), which a
  retried attempt or a re-execution must reuse, or its trees and so its sampled tokens would differ;
- the call index of every LLM call: taken from the request's :class:`~elesium.inference.types.CallTag`
  (the node's count in the checkpointed state), so a run resumed after its worker died numbers its
  calls as the dead attempt did;
- learning from a succeeded run (:func:`learn`), which must never fail the run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from langchain_core.runnables import RunnableConfig
from pydantic import BaseModel

from elesium.errors import UserError
from elesium.graphs.context import run_config as context_config
from elesium.graphs.serialization import jsonable
from elesium.inference.records import Chunk, Generation, StepRecord
from elesium.inference.types import (
    CallTag,
    GenerationHandle,
    GenerationRequest,
    Prompt,
    StepHook,
    TextEngine,
)
from elesium.state.errors import StateError

if TYPE_CHECKING:
    import torch

    from elesium.inference.decoding.tree_policy import TreePolicy

log = logging.getLogger("elesium.graphs")

Emit = Callable[[str, Any], None]


class RunCancelled(Exception):
    """The run was cancelled (client disconnect, a cancel request, a timeout); raised inside the graph."""


class EngineMismatchError(UserError, ValueError):
    """The run was recorded on an engine whose fingerprint differs from this one's."""

    def __init__(self, message: str, differing: Sequence[str]) -> None:
        super().__init__(message)
        self.differing = list(differing)


class LLMCall(BaseModel):
    """One recorded generation: where it ran, from what, and every token it produced."""

    node: str
    call: int
    seed: int
    mode: str
    prompt_sha256: str
    prompt_tokens: int
    token_ids: list[int]
    text: str
    finish_reason: str
    steps: int = 0
    accepted: int = 0  # draft tokens accepted over the call (tokens minus steps minus the prefill token)


class Divergence(BaseModel):
    """The first place a replay differs from its record."""

    run_id: str | None = None
    node: str | None = None
    call: int | None = None
    step: int | None = None
    field: str
    recorded: Any = None
    replayed: Any = None

    def describe(self) -> str:
        where = ", ".join(
            f"{k}={v}"
            for k, v in (("run", self.run_id), ("node", self.node), ("call", self.call), ("step", self.step))
            if v is not None
        )
        return (
            f"diverged at {where or 'start'} field {self.field}: recorded {self.recorded!r}, "
            f"replayed {self.replayed!r}"
        )


class DivergenceError(Exception):
    """Recorded-mode replay: the graph asked for an LLM call the record does not have."""

    def __init__(self, divergence: Divergence) -> None:
        super().__init__(divergence.describe())
        self.divergence = divergence


# ---------------------------------------------------------------- the engine as a run sees it
def prompt_digest(ids: Sequence[int]) -> str:
    """sha256 of the prompt's token ids: what the call actually fed the model."""
    return hashlib.sha256(json.dumps(list(ids)).encode()).hexdigest()


def _graph_position() -> tuple[str, int | None, str]:
    """(node, super-step, task namespace) of the LangGraph task running on this thread; ("?", None, "")
    outside a graph (a plain use of the engine)."""
    from langgraph.config import get_config

    try:
        config = get_config()
    except RuntimeError:  # not inside a runnable: langgraph's own signal for "no config here"
        return "?", None, ""
    meta = config.get("metadata") or {}
    step = meta.get("langgraph_step")
    return (str(meta.get("langgraph_node", "?")), int(step) if step is not None else None,
            str(meta.get("langgraph_checkpoint_ns", "")))


def _run_context() -> Any:
    """The :class:`~elesium.graphs.context.RunContext` of the LangGraph task running on this thread, or
    None (outside a graph, or a graph run without ``run_config``)."""
    from langgraph.config import get_config

    from elesium.graphs.context import CONTEXT_KEY, RunContext

    try:
        config = get_config()
    except RuntimeError:
        return None
    ctx = (config.get("configurable") or {}).get(CONTEXT_KEY)
    return ctx if isinstance(ctx, RunContext) else None


UNTAGGED_STEP_STRIDE = 1000
"""Call index of an untagged call (``ChatElesium`` inside a node): super-step × this + its order within
the task. Both survive a crash (a resumed run re-runs the unfinished task at the same step from its
first call), so an untagged call is numbered from the checkpointed position, not a process counter."""


class RunEngine:
    """The engine as one run's LLM nodes see it: it records each call, forwards token chunks, stops when
    the run is cancelled, and during a recorded replay serves the record instead of decoding.

    It implements :class:`~elesium.inference.types.TextEngine` with explicit methods, so what a node
    can reach is exactly the engine interface. A call's identity (node, index) is the request's
    :class:`~elesium.inference.types.CallTag`, set by ``llm_node`` from the checkpointed state.

    Args:
        engine: the engine that decodes.
        recorded: a run's recorded calls: serve them (recorded replay); a call the record does not
            have, or whose prompt differs, raises :class:`DivergenceError`.
        on_chunk: ``(node, index, text)`` per decoded chunk (the API's ``messages`` stream mode).
        on_call: each finished call, as it finishes (a queued run persists it at once).
        cancelled: an event shared with the caller (a client disconnect sets it); by default its own,
            set by :meth:`cancel`.
        cuts: a run's recorded calls, for re-executing it: a call its deadline ended
            (``finish_reason`` "deadline") is decoded again up to the recorded length instead of
            against the clock, so the replay cuts at the same token however fast this machine is; a
            call cut before its first token is served from the record (there is nothing to decode).
    """

    def __init__(
        self,
        engine: TextEngine,
        *,
        recorded: Sequence[LLMCall] | None = None,
        on_chunk: Callable[[str, int, str], None] | None = None,
        on_call: Callable[[LLMCall], None] | None = None,
        cancelled: threading.Event | None = None,
        cuts: Sequence[LLMCall] | None = None,
    ) -> None:
        self.engine = engine
        self._cuts = {(c.node, c.call): c for c in cuts or () if c.finish_reason == "deadline"}
        self.on_chunk = on_chunk
        self.on_call = on_call
        self._recorded = {(c.node, c.call): c for c in recorded} if recorded is not None else None
        self.cancelled = cancelled or threading.Event()
        self.calls: list[LLMCall] = []
        self.steps: list[tuple[str, StepRecord]] = []  # (node, step) in decode order
        self._open: set[_RecordingHandle] = set()
        self._task_calls: dict[str, int] = {}
        self._lock = threading.Lock()

    # -- cancellation
    def cancel(self) -> None:
        """Stop the run: every open generation is closed now (the engine is released after its current
        step) and the next call or chunk raises :class:`RunCancelled`. Safe from any thread."""
        self.cancelled.set()
        with self._lock:
            handles = list(self._open)
        for handle in handles:
            handle.close()

    # -- the TextEngine interface
    def start(self, request: GenerationRequest, *, on_step: StepHook | None = None) -> GenerationHandle:
        if self.cancelled.is_set():
            raise RunCancelled("the run was cancelled")
        tag = request.tag or self._untagged()
        # An untagged call (``ChatElesium`` inside a node) gets what ``llm_node`` does for itself: a seed
        # derived from the run seed and its (node, index), and its entries in the acceptance log.
        ctx = _run_context() if request.tag is None else None
        if ctx is not None and request.sampling.seed is None:
            from elesium.graphs.seeds import derive_seed

            request = dataclasses.replace(request, sampling=dataclasses.replace(
                request.sampling, seed=derive_seed(ctx.seed, tag.node, tag.index)))
        ids = self.engine.encode_prompt(request.prompt, raw=request.raw)
        digest = prompt_digest(ids)
        if self._recorded is not None:
            rec = self._recorded.get((tag.node, tag.index))
            if rec is None or rec.prompt_sha256 != digest:
                raise DivergenceError(Divergence(
                    node=tag.node, call=tag.index, field="path" if rec is None else "prompt",
                    recorded=None if rec is None else rec.prompt_sha256[:16],
                    replayed=f"llm call {tag.node}#{tag.index}" if rec is None else digest[:16]))
            return _RecordingHandle(self, tag, None, rec, digest, len(ids))
        cut = self._cuts.get((tag.node, tag.index))
        if cut is not None and cut.prompt_sha256 != digest:
            cut = None  # another prompt: decoded as asked; the comparison reports the prompt's divergence
        if cut is not None and not cut.token_ids:
            return _RecordingHandle(self, tag, None, cut, digest, len(ids))
        if cut is not None:
            request = dataclasses.replace(request, sampling=dataclasses.replace(
                request.sampling, max_tokens=len(cut.token_ids), deadline_s=None))

        def hook(record: StepRecord) -> None:
            self.steps.append((tag.node, record))
            if on_step is not None:
                on_step(record)

        # The tag goes along (engines ignore it): a traced engine (api/tracing.py) labels its span with it.
        inner = self.engine.start(dataclasses.replace(request, prompt=ids, raw=True, tag=tag), on_step=hook)
        handle = _RecordingHandle(self, tag, inner, None, digest, len(ids))
        handle.cut_at = None if cut is None else len(cut.token_ids)
        if ctx is not None and ctx.log is not None:
            handle.log_to = (ctx.log, ctx.run_id, ids, request.sampling.temperature)
        with self._lock:
            self._open.add(handle)
        if self.cancelled.is_set():  # cancelled while it started: do not leave it holding the engine
            handle.close()
        return handle

    def encode_prompt(self, prompt: Prompt, *, raw: bool = False) -> list[int]:
        return self.engine.encode_prompt(prompt, raw=raw)

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        return self.engine.encode_with_offsets(text)

    def hidden_states(self, prompt_ids: list[int], layers: Sequence[int]) -> torch.Tensor:
        if self.cancelled.is_set():
            raise RunCancelled("the run was cancelled")
        return self.engine.hidden_states(prompt_ids, layers)

    def describe(self) -> dict[str, str]:
        return self.engine.describe()

    def fingerprint(self, mode: str | None = None) -> dict[str, str]:
        return self.engine.fingerprint(mode)

    def resolve_mode(self, mode: str | None) -> str:
        return self.engine.resolve_mode(mode)

    def step_cost(self, nodes: int) -> float:
        return self.engine.step_cost(nodes)

    @property
    def policy(self) -> TreePolicy:
        return self.engine.policy

    @property
    def modes(self) -> tuple[str, ...]:
        return self.engine.modes

    @property
    def default_mode(self) -> str:
        return self.engine.default_mode

    @property
    def context_length(self) -> int:
        return self.engine.context_length

    # -- recording
    @property
    def unserved(self) -> list[LLMCall]:
        """Recorded calls the replay never asked for (recorded mode)."""
        if self._recorded is None:
            return []
        done = {(c.node, c.call) for c in self.calls}
        return [c for k, c in sorted(self._recorded.items(), key=lambda kv: (kv[1].node, kv[1].call))
                if k not in done]

    def _untagged(self) -> CallTag:
        node, step, task = _graph_position()
        with self._lock:
            k = self._task_calls.get(task, 0)
            self._task_calls[task] = k + 1
        return CallTag(node, (step or 0) * UNTAGGED_STEP_STRIDE + k)

    def _finished(self, handle: _RecordingHandle, call: LLMCall | None) -> None:
        with self._lock:
            self._open.discard(handle)
        if call is not None:
            self.calls.append(call)
            if self.on_call is not None:
                self.on_call(call)


class _RecordingHandle:
    """One call of a run: the engine's handle (or a recorded call), with recording, chunk forwarding and
    cancellation."""

    def __init__(self, owner: RunEngine, tag: CallTag, inner: GenerationHandle | None, rec: LLMCall | None,
                 digest: str, n_prompt: int) -> None:
        self.owner, self.tag, self.inner, self.rec = owner, tag, inner, rec
        self.digest, self.n_prompt = digest, n_prompt
        self.log_to: tuple[Any, str, list[int], float] | None = None  # (acceptance log, run id, prompt, T)
        self.cut_at: int | None = None  # re-executing a call its deadline cut after this many tokens
        self._result: Generation | None = None
        self._iter = self._run()

    def __iter__(self) -> Iterator[Chunk]:
        return self._iter

    def __next__(self) -> Chunk:
        return next(self._iter)

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()

    @property
    def result(self) -> Generation:
        if self._result is None:
            raise RuntimeError("the stream has not finished; iterate it to the end first")
        return self._result

    def _run(self) -> Iterator[Chunk]:
        owner, tag = self.owner, self.tag
        if self.rec is not None:
            rec = self.rec
            if owner.on_chunk is not None and rec.text:
                owner.on_chunk(tag.node, tag.index, rec.text)
            yield Chunk(rec.text, tuple(rec.token_ids))
            self._result = Generation(text=rec.text, token_ids=tuple(rec.token_ids),
                                      prompt_tokens=rec.prompt_tokens,
                                      finish_reason=rec.finish_reason,  # type: ignore[arg-type]  # recorded
                                      mode=rec.mode, seed=rec.seed, elapsed_s=0.0)  # type: ignore[arg-type]
            owner._finished(self, rec)
            return
        assert self.inner is not None
        finished = False
        try:
            for chunk in self.inner:
                if owner.cancelled.is_set():
                    raise RunCancelled("the run was cancelled")
                if owner.on_chunk is not None and chunk.text:
                    owner.on_chunk(tag.node, tag.index, chunk.text)
                yield chunk
            if owner.cancelled.is_set():  # closed by cancel(): the engine stopped early, not finished
                raise RunCancelled("the run was cancelled")
            finished = True
        finally:
            if not finished:  # stopped early (cancel, error, consumer gone): release the engine now
                self.close()
                owner._finished(self, None)
        gen = self.inner.result
        if self.cut_at is not None and gen.finish_reason == "length" and gen.new_tokens == self.cut_at:
            gen = dataclasses.replace(gen, finish_reason="deadline")  # where the record's deadline cut it
        self._result = gen
        if self.log_to is not None:
            from elesium.graphs.audit import record_call

            log, run_id, prompt_ids, temperature = self.log_to
            record_call(log, run_id, tag.node, tag.index, int(gen.seed), gen, prompt_ids=prompt_ids,
                        temperature=temperature)
        owner._finished(self, LLMCall(
            node=tag.node, call=tag.index, seed=int(gen.seed), mode=str(gen.mode),
            prompt_sha256=self.digest, prompt_tokens=gen.prompt_tokens, token_ids=list(gen.token_ids),
            text=gen.text, finish_reason=str(gen.finish_reason), steps=len(gen.steps),
            accepted=sum(max(0, s.accepted_length - 1) for s in gen.steps)))


# ---------------------------------------------------------------- what every path checks the same way
def check_engine(engine: TextEngine, recorded: Mapping[str, str], mode: str | None, *, what: str) -> None:
    """Raise :class:`EngineMismatchError` when ``engine`` (in ``mode``) is not the one ``recorded``.

    An empty record (a run recorded before fingerprints existed) passes."""
    if not recorded:
        return
    current = engine.fingerprint(mode)
    if current == dict(recorded):
        return
    diff = sorted(k for k in set(current) | set(recorded) if current.get(k) != recorded.get(k))
    raise EngineMismatchError(
        f"{what} was recorded on a different engine ({', '.join(diff)} differ); run it where the same "
        "model, heads, profile, dtype and device are loaded", diff)


class CalibrationRecord(Protocol):
    calibrations: dict[str, str]


class RunRecords(Protocol):
    """Where a run's per-node calibration versions are read (the run registry)."""

    def get(self, run_id: str) -> CalibrationRecord | None: ...


def recorded_calibrations(runs: RunRecords | None, run_id: str) -> dict[str, str]:
    """The calibration version each node of the run decoded with so far (an earlier attempt's).

    Raises what the registry raises: a retried attempt that went on with current calibrations could
    decode other trees and so, sampled, other tokens than the attempt it continues. No registry at
    all (self-tuning off) means every node uses the engine's global policy, as the attempt did."""
    if runs is None:
        return {}
    record = runs.get(run_id)
    return dict(record.calibrations) if record is not None else {}


class RunChain(Protocol):
    """The run's hash chain as :func:`drive` uses it (``graphs/audit_chain.RunAudit``)."""

    def begin(self, config: Mapping[str, Any], *, checkpointer: Any = None) -> None: ...

    def sync(self) -> int: ...

    def seal(self, status: str) -> Any: ...

    def close(self) -> None: ...


class Learner(Protocol):
    learn: bool

    def fold_run(self, workflow: str, run_id: str) -> Any: ...


def learn(calibrator: Learner | None, workflow: str, run_id: str) -> None:
    """Fold a succeeded run into its nodes' calibrations (self-tuning on).

    It never fails the run: the run's outcome and records are already written, and what tuning
    missed is redone by ``elesium tune --from-log`` from the same records."""
    if calibrator is None or not calibrator.learn:
        return
    try:
        calibrator.fold_run(workflow, run_id)
    except Exception:  # noqa: BLE001 - changes no record of the run (see docstring)
        log.warning("calibration update after run %s failed", run_id, exc_info=True)


def run_config(
    engine: TextEngine,
    *,
    run_id: str,
    thread_id: str,
    seed: int,
    tenant: str = "default",
    log: Any = None,
    workflow: str = "",
    mode: str | None = None,
    calibrator: Any = None,
    calibrations: Mapping[str, str] | None = None,
    checkpoint_id: str | None = None,
    recursion_limit: int = 50,
) -> RunnableConfig:
    """The LangGraph config of one run (the keys and :class:`~elesium.graphs.context.RunContext` its
    nodes read; ``metadata.run_id`` goes into every checkpoint it writes)."""
    config = context_config(engine, run_seed=seed, run_id=run_id, thread_id=thread_id, tenant=tenant, log=log,
                            workflow=workflow, mode=mode, metadata={"run_id": run_id},
                            recursion_limit=recursion_limit, calibrator=calibrator, calibrations=calibrations)
    if checkpoint_id:
        config["configurable"]["checkpoint_id"] = checkpoint_id
    return config


# ---------------------------------------------------------------- driving one run
@dataclasses.dataclass
class Outcome:
    """How one pass of a graph ended: ``success``, ``interrupted`` (waiting at a LangGraph
    ``interrupt``) or ``error`` (a node raised; ``error`` says what)."""

    status: str
    values: Any
    interrupts: list[dict[str, Any]]
    checkpoints: list[str]
    error: str | None = None
    exception: BaseException | None = dataclasses.field(default=None, repr=False, compare=False)


def checkpoint_ids(graph: Any, thread_id: str, run_id: str | None = None) -> list[str]:
    """The thread's checkpoint ids (root namespace), oldest first; only ``run_id``'s when given."""
    config = {"configurable": {"thread_id": thread_id, "checkpoint_ns": ""}}
    ids = [t.config["configurable"]["checkpoint_id"] for t in graph.checkpointer.list(config)
           if run_id is None or (t.metadata or {}).get("run_id") == run_id]
    return list(reversed(ids))


def resume_point(graph: Any, config: RunnableConfig, run_id: str) -> str:
    """Where an attempt of ``run_id`` starts: "start" (no checkpoint of this run on its thread), "resume"
    (an earlier attempt got as far as the thread's newest checkpoint: continue from it with input
    None, re-running only the tasks without a checkpointed result) or "done" (that attempt finished
    the graph, or stopped at an interrupt, and died before recording it: nothing is executed again).

    "No tasks" is ``state.tasks``, not ``state.next``: LangGraph leaves a task out of ``next`` once
    its pending writes are saved, so a super-step whose tasks all finished but whose checkpoint was
    never written has an empty ``next`` and still work to do."""
    thread = {"configurable": {"thread_id": config["configurable"]["thread_id"], "checkpoint_ns": ""}}
    latest = graph.checkpointer.get_tuple(thread)
    if latest is None or (latest.metadata or {}).get("run_id") != run_id:
        return "start"
    state = graph.get_state(thread)
    if not state.tasks or any(task.interrupts for task in state.tasks):
        return "done"
    return "resume"


def drive(
    graph: Any,
    graph_input: Any,
    config: RunnableConfig,
    *,
    emit: Emit | None = None,
    cancelled: threading.Event | None = None,
    between_steps: Callable[[], None] | None = None,
    stream_modes: Sequence[str] = ("values", "updates"),
    audit: RunChain | None = None,
) -> Outcome:
    """Run ``graph`` once (an input, a ``Command`` to resume, or None to continue) and say how it ended.

    ``emit(mode, chunk)`` receives each streamed part, JSON-ready. ``between_steps`` runs after every
    super-step (a lease check that raises when the run was cancelled, timed out or lost). Raises
    :class:`RunCancelled` when ``cancelled`` is set; :class:`DivergenceError` and
    :class:`~elesium.state.errors.StateError` (Redis down, lease lost: not the run's fault, so it is
    retried) propagate; any other exception from a node ends the run in ``error``.

    ``audit`` (the run's hash chain) is attached to the graph's checkpointer for the run, so the
    checkpoints, writes, LLM calls and acceptance entries are chained as they are written (else it
    chains each super-step's records when its update arrives), and is sealed with the outcome:
    success, error, interrupted or cancelled. A Redis failure or a lost lease leaves it unsealed:
    the retried attempt continues the same chain.
    """
    thread_id = config["configurable"]["thread_id"]
    before = set(checkpoint_ids(graph, thread_id))
    if audit is not None:
        audit.begin(config, checkpointer=graph.checkpointer)
    try:
        return _drive(graph, graph_input, config, thread_id, before, emit=emit, cancelled=cancelled,
                      between_steps=between_steps, stream_modes=stream_modes, audit=audit)
    finally:
        if audit is not None:
            audit.close()  # an attempt that raised leaves the chain unsealed: the retry continues it


def _drive(graph: Any, graph_input: Any, config: RunnableConfig, thread_id: str, before: set[str], *,
           emit: Emit | None, cancelled: threading.Event | None, between_steps: Callable[[], None] | None,
           stream_modes: Sequence[str], audit: RunChain | None) -> Outcome:
    try:
        for mode, chunk in graph.stream(graph_input, config, stream_mode=list(stream_modes)):
            if cancelled is not None and cancelled.is_set():
                raise RunCancelled("the run was cancelled")
            if audit is not None and mode == "updates":
                audit.sync()
            if between_steps is not None and mode == "updates":
                between_steps()
            if emit is not None:
                emit(mode, jsonable(chunk))
        if between_steps is not None:
            between_steps()
    except RunCancelled:
        _seal(audit, "cancelled")
        raise
    except (DivergenceError, StateError):
        raise
    except Exception as exc:  # noqa: BLE001 - a node failed: the outcome "error", recorded by the caller
        if cancelled is not None and cancelled.is_set():
            _seal(audit, "cancelled")
            raise RunCancelled("the run was cancelled") from exc  # a stream closed by cancel() broke the node
        after = [c for c in checkpoint_ids(graph, thread_id) if c not in before]
        _seal(audit, "error")
        return Outcome("error", None, [], after, error=f"{type(exc).__name__}: {exc}", exception=exc)
    outcome = outcome_now(graph, thread_id, before)
    _seal(audit, outcome.status)
    return outcome


def _seal(audit: RunChain | None, status: str) -> None:
    """Seal the run's chain with how it ended (after chaining its last records). A failure to write
    it is the state layer's error and propagates: the run is retried, and sealed then."""
    if audit is not None:
        audit.seal(status)


def outcome_now(graph: Any, thread_id: str, before: set[str] | frozenset[str] = frozenset()) -> Outcome:
    """The outcome the thread's latest checkpoint shows: interrupted when a task waits at an interrupt,
    else success; ``checkpoints`` are those not in ``before``. What a run whose last attempt finished
    the graph but died before recording it ended with (:func:`resume_point` "done")."""
    snapshot = graph.get_state({"configurable": {"thread_id": thread_id}})
    interrupts = [jsonable(i) for i in getattr(snapshot, "interrupts", ())]
    after = [c for c in checkpoint_ids(graph, thread_id) if c not in before]
    return Outcome("interrupted" if interrupts else "success", jsonable(snapshot.values), interrupts, after)


def command_from(request: Mapping[str, Any]) -> Any:
    """The graph input of a protocol run request: its ``input``, or its ``command`` as a Command."""
    from langgraph.types import Command

    command = request.get("command")
    if command:
        kwargs: dict[str, Any] = {}
        if "resume" in command:
            kwargs["resume"] = command["resume"]
        if command.get("update") is not None:
            kwargs["update"] = command["update"]
        if command.get("goto") is not None:
            kwargs["goto"] = command["goto"]
        return Command(**kwargs)
    return request.get("input")
