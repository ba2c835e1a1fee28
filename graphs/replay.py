"""Audit replay: re-run a recorded run and prove every checkpoint and every LLM token is the same.

LangGraph's own "replay" re-executes nodes from a checkpoint without checking anything; Temporal
replays recorded results and fails loudly when the code takes another path. The engine here is
deterministic and exact (a seeded run reproduces token for token), so an audit can do both:

- ``reexecute``: run the recorded workflow version again, on a scratch thread, from the recorded
  inputs, resume values, state updates and seeds, through the engine; compare each LLM call's token
  sequence and each checkpoint's channel values with the record. The first difference is reported
  (node, call, step, field, recorded vs replayed).
- ``recorded``: run the graph again but serve every LLM call from the record instead of the engine;
  if the graph asks for a call the record does not have (another node, another prompt, one more
  call) the path differs and the replay stops with a divergence (Temporal's non-determinism check).

A run is replayed together with the earlier operations of its thread (an approval resume only makes
sense after the run that raised the interrupt), so the verdict covers the run and its ancestors.

This module also holds what recording needs at run time, because replay must drive the graph exactly
as the live run did: :class:`TappedEngine` (the engine as the graph sees it: records each call by
node and call index, streams token chunks, honours cancellation, serves recorded calls) and
:func:`drive` (one run of a compiled graph with stream events, returning the run's outcome).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from pydantic import BaseModel

from elesium.state.errors import StateError

Emit = Callable[[str, Any], None]


class RunCancelled(Exception):
    """The run was cancelled (client disconnect or a cancel request); raised inside the graph."""


class DivergenceError(Exception):
    """Recorded-mode replay: the graph asked for an LLM call the record does not have."""

    def __init__(self, divergence: Divergence) -> None:
        super().__init__(divergence.describe())
        self.divergence = divergence


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


def prompt_digest(engine: Any, prompt: Any, raw: bool) -> tuple[str, int]:
    """sha256 and length of the prompt's token ids: what the call actually fed the model."""
    ids = engine.encode_prompt(prompt, raw=raw)
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest(), len(ids)


def current_node() -> str:
    """The LangGraph node executing on this thread (from the runnable config), or "?" outside one."""
    try:
        from langgraph.config import get_config

        return str(get_config().get("metadata", {}).get("langgraph_node", "?"))
    except Exception:  # noqa: BLE001 - called outside a graph (plain use of the engine)
        return "?"


class TappedEngine:
    """The engine as a graph's LLM nodes see it during an API run or a replay.

    Everything but ``stream``/``generate`` is delegated to the real engine. Those two record each call
    (node, per-node call index, seed, prompt digest, tokens), forward token chunks to ``on_chunk``
    (the API's ``messages`` stream mode), report each finished call to ``on_call`` (a queued run
    persists it at once, so a worker that dies mid-run loses none), collect decode steps, stop at once
    when ``cancelled`` is set (closing the engine stream, which releases the engine), and in recorded
    mode serve ``recorded`` calls instead of generating.
    """

    def __init__(
        self,
        engine: Any,
        *,
        recorded: list[LLMCall] | None = None,
        on_chunk: Callable[[str, int, str], None] | None = None,
        cancelled: threading.Event | None = None,
        on_call: Callable[[LLMCall], None] | None = None,
    ) -> None:
        self._engine = engine
        self.on_call = on_call
        self._recorded = {(c.node, c.call): c for c in recorded} if recorded is not None else None
        self.on_chunk = on_chunk
        self.cancelled = cancelled or threading.Event()
        self.calls: list[LLMCall] = []
        self.steps: list[tuple[str, Any]] = []  # (node, StepRecord) in decode order
        self._counters: dict[str, int] = {}
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    @property
    def unserved(self) -> list[LLMCall]:
        """Recorded calls the replay never asked for (recorded mode)."""
        if self._recorded is None:
            return []
        done = {(c.node, c.call) for c in self.calls}
        return [
            c
            for k, c in sorted(self._recorded.items(), key=lambda kv: (kv[1].node, kv[1].call))
            if k not in done
        ]

    def generate(self, prompt: Any, params: Any = None, **kwargs: Any) -> Any:
        stream = self.stream(prompt, params, **kwargs)
        for _ in stream:
            pass
        return stream.result

    def stream(
        self,
        prompt: Any,
        params: Any = None,
        *,
        mode: Any = None,
        raw: bool = False,
        on_step: Callable[[Any], None] | None = None,
        **kwargs: Any,
    ) -> _TappedStream:
        node = current_node()
        with self._lock:
            index = self._counters.get(node, 0)
            self._counters[node] = index + 1
        if self.cancelled.is_set():
            raise RunCancelled("the run was cancelled")
        digest, n_prompt = prompt_digest(self._engine, prompt, raw)
        if self._recorded is not None:
            rec = self._recorded.get((node, index))
            if rec is None or rec.prompt_sha256 != digest:
                raise DivergenceError(
                    Divergence(
                        node=node,
                        call=index,
                        field="path" if rec is None else "prompt",
                        recorded=None if rec is None else rec.prompt_sha256[:16],
                        replayed=f"llm call {node}#{index}" if rec is None else digest[:16],
                    )
                )
            return _TappedStream(self, node, index, None, rec)
        inner = self._engine.stream(
            prompt, params, mode=mode, raw=raw, on_step=self._step_hook(node, on_step), **kwargs
        )
        return _TappedStream(self, node, index, inner, None, digest=digest, n_prompt=n_prompt)

    def record(self, call: LLMCall) -> None:
        self.calls.append(call)
        if self.on_call is not None:
            self.on_call(call)

    def _step_hook(self, node: str, user: Callable[[Any], None] | None) -> Callable[[Any], None]:
        def hook(record: Any) -> None:
            self.steps.append((node, record))
            if user is not None:
                user(record)

        return hook


class _TappedStream:
    """Wraps a GenerationStream (or a recorded call) with recording, chunk forwarding and cancellation."""

    def __init__(
        self,
        tap: TappedEngine,
        node: str,
        index: int,
        inner: Any,
        rec: LLMCall | None,
        *,
        digest: str = "",
        n_prompt: int = 0,
    ) -> None:
        self.tap, self.node, self.index, self.inner, self.rec = tap, node, index, inner, rec
        self.digest, self.n_prompt = digest, n_prompt
        self._result: Any = None
        self._iter = self._run()

    def __iter__(self) -> Iterator[Any]:
        return self._iter

    def __next__(self) -> Any:
        return next(self._iter)

    def close(self) -> None:
        if self.inner is not None and hasattr(self.inner, "close"):
            self.inner.close()

    @property
    def result(self) -> Any:
        if self._result is None:
            raise RuntimeError("the stream has not finished; iterate it to the end first")
        return self._result

    def _run(self) -> Iterator[Any]:
        from elesium.inference.records import Chunk, Generation

        if self.rec is not None:
            rec = self.rec
            if self.tap.on_chunk is not None and rec.text:
                self.tap.on_chunk(self.node, self.index, rec.text)
            yield Chunk(rec.text, tuple(rec.token_ids))
            self._result = Generation(
                text=rec.text,
                token_ids=tuple(rec.token_ids),
                prompt_tokens=rec.prompt_tokens,
                finish_reason=rec.finish_reason,
                mode=rec.mode,
                seed=rec.seed,
                elapsed_s=0.0,
            )
            self.tap.record(rec)
            return
        finished = False
        try:
            for chunk in self.inner:
                if self.tap.cancelled.is_set():
                    raise RunCancelled("the run was cancelled")
                if self.tap.on_chunk is not None and chunk.text:
                    self.tap.on_chunk(self.node, self.index, chunk.text)
                yield chunk
            finished = True
        finally:
            if not finished:  # stopped early (cancel, error, consumer gone): release the engine now
                self.close()
        gen = self.inner.result
        self._result = gen
        steps = len(gen.steps)
        self.tap.record(
            LLMCall(
                node=self.node,
                call=self.index,
                seed=int(gen.seed),
                mode=str(gen.mode),
                prompt_sha256=self.digest,
                prompt_tokens=gen.prompt_tokens,
                token_ids=list(gen.token_ids),
                text=gen.text,
                finish_reason=str(gen.finish_reason),
                steps=steps,
                accepted=sum(max(0, s.accepted_length - 1) for s in gen.steps),
            )
        )


# ---------------------------------------------------------------- serialisation and comparison
def jsonable(obj: Any) -> Any:
    """A JSON-ready copy of graph values (pydantic models, dataclasses, messages, interrupts)."""
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, BaseModel):
        return jsonable(obj.model_dump(mode="json"))
    type_name = type(obj).__name__
    if type_name == "Interrupt":
        return {"value": jsonable(getattr(obj, "value", None)), "id": str(getattr(obj, "id", ""))}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return jsonable(dataclasses.asdict(obj))
    if hasattr(obj, "model_dump"):
        return jsonable(obj.model_dump())
    if hasattr(obj, "_asdict"):
        return jsonable(obj._asdict())
    return repr(obj)


def first_difference(recorded: Any, replayed: Any, path: str = "") -> tuple[str, Any, Any] | None:
    """(field path, recorded, replayed) of the first difference between two JSON-like values."""
    if isinstance(recorded, dict) and isinstance(replayed, dict):
        for key in sorted(set(recorded) | set(replayed)):
            sub = f"{path}.{key}" if path else str(key)
            if key not in recorded or key not in replayed:
                return sub, recorded.get(key), replayed.get(key)
            found = first_difference(recorded[key], replayed[key], sub)
            if found:
                return found
        return None
    if isinstance(recorded, list) and isinstance(replayed, list):
        for i, (a, b) in enumerate(zip(recorded, replayed, strict=False)):
            found = first_difference(a, b, f"{path}[{i}]")
            if found:
                return found
        if len(recorded) != len(replayed):
            return f"{path}.length", len(recorded), len(replayed)
        return None
    return None if recorded == replayed else (path or "value", recorded, replayed)


# ---------------------------------------------------------------- driving one run
@dataclasses.dataclass
class Outcome:
    """How one run of a graph ended."""

    status: str  # success | interrupted | error
    values: Any
    interrupts: list[dict[str, Any]]
    checkpoints: list[str]
    error: str | None = None


def checkpoint_ids(graph: Any, thread_id: str) -> list[str]:
    """The thread's checkpoint ids (root namespace), oldest first."""
    config = {"configurable": {"thread_id": thread_id, "checkpoint_ns": ""}}
    ids = [t.config["configurable"]["checkpoint_id"] for t in graph.checkpointer.list(config)]
    return list(reversed(ids))


def run_config(
    thread_id: str,
    run_id: str,
    seed: int,
    tenant: str,
    engine: Any,
    checkpoint_id: str | None = None,
    log: Any = None,
    workflow: str = "",
    mode: str | None = None,
    calibrator: Any = None,
    calibrations: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The RunnableConfig of an API run or a replay (C4's keys and RunContext, with the tapped engine).

    ``calibrator`` / ``calibrations``: per-node tree calibrations (graphs/calibration.py); None keeps
    every node on the engine's global policy. A re-execution passes the run's recorded versions.
    """
    from elesium.graphs.context import run_config as context_config

    config = context_config(
        engine,
        run_seed=seed,
        run_id=run_id,
        thread_id=thread_id,
        tenant=tenant,
        log=log,
        workflow=workflow,
        mode=mode,
        metadata={"run_id": run_id},
        recursion_limit=50,
        calibrator=calibrator,
        calibrations=calibrations,
    )
    if checkpoint_id:
        config["configurable"]["checkpoint_id"] = checkpoint_id
    return config


def drive(
    graph: Any,
    graph_input: Any,
    config: dict[str, Any],
    *,
    emit: Emit | None = None,
    cancelled: threading.Event | None = None,
    stream_modes: tuple[str, ...] = ("values", "updates"),
) -> Outcome:
    """Run ``graph`` once (input, or a ``Command`` to resume) and report how it ended.

    ``emit(mode, chunk)`` receives each streamed part (JSON-ready). Raises :class:`RunCancelled` when
    ``cancelled`` is set between super-steps (the LLM nodes check it between tokens).
    """
    thread_id = config["configurable"]["thread_id"]
    before = set(checkpoint_ids(graph, thread_id))
    try:
        for mode, chunk in graph.stream(graph_input, config, stream_mode=list(stream_modes)):
            if cancelled is not None and cancelled.is_set():
                raise RunCancelled("the run was cancelled")
            if emit is not None:
                emit(mode, jsonable(chunk))
    except (RunCancelled, DivergenceError, StateError):
        raise  # StateError: Redis down or the lease lost, not the run's fault; the run is retried
    except Exception as exc:  # noqa: BLE001 - a node failed: the run ends in error, recorded
        after = [c for c in checkpoint_ids(graph, thread_id) if c not in before]
        return Outcome("error", None, [], after, error=f"{type(exc).__name__}: {exc}")
    state_config = {"configurable": {"thread_id": thread_id}}
    snapshot = graph.get_state(state_config)
    interrupts = [jsonable(i) for i in getattr(snapshot, "interrupts", ())]
    after = [c for c in checkpoint_ids(graph, thread_id) if c not in before]
    return Outcome("interrupted" if interrupts else "success", jsonable(snapshot.values), interrupts, after)


def command_from(request: dict[str, Any]) -> Any:
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


# ---------------------------------------------------------------- replay
class ReplayReport(BaseModel):
    """What a replay found. ``verdict`` is "identical" only if every call and checkpoint matched."""

    replay_id: str
    run_id: str
    thread_id: str
    mode: str
    verdict: str  # identical | diverged
    divergence: Divergence | None = None
    notes: list[str] = []
    fingerprint_recorded: dict[str, str] = {}
    fingerprint_replayed: dict[str, str] = {}
    fingerprint_match: bool = True
    workflow_version_recorded: str = ""
    workflow_version_replayed: str = ""
    runs_replayed: list[str] = []
    calls_compared: int = 0
    tokens_compared: int = 0
    checkpoints_compared: int = 0
    by: str = ""
    at: float = 0.0
    elapsed_s: float = 0.0


@dataclasses.dataclass
class RecordedRun:
    """What the store holds about one run of the thread, as replay needs it."""

    run_id: str
    request: dict[str, Any]
    seed: int
    tenant: str
    checkpoints: list[str]
    calls: list[LLMCall]
    status: str
    calibrations: dict[str, str] = dataclasses.field(default_factory=dict)  # node -> version decoded with


def pinned_calibrator(store: Any) -> Any:
    """A calibrator that only serves recorded versions: nodes a run did not pin use the global
    policy, nothing is learnt and nothing is written (a replay must not touch the run's record)."""
    from elesium.graphs.calibration import NodeCalibrator

    return NodeCalibrator(store, None, runs=None, use=False, learn=False, rule=None)  # type: ignore[arg-type]


def compare_calls(
    run_id: str, recorded: list[LLMCall], replayed: list[LLMCall]
) -> tuple[Divergence | None, int]:
    """First token-level difference between two runs' LLM calls, and the number of tokens compared."""
    compared = 0
    rec_by = {(c.node, c.call): c for c in recorded}
    rep_by = {(c.node, c.call): c for c in replayed}
    for r in replayed:
        if (r.node, r.call) not in rec_by:
            return Divergence(
                run_id=run_id,
                node=r.node,
                call=r.call,
                field="path",
                recorded=None,
                replayed=f"llm call {r.node}#{r.call}",
            ), compared
    for c in recorded:
        r = rep_by.get((c.node, c.call))
        if r is None:
            return Divergence(
                run_id=run_id,
                node=c.node,
                call=c.call,
                field="path",
                recorded=f"llm call {c.node}#{c.call}",
                replayed=None,
            ), compared
        if c.prompt_sha256 != r.prompt_sha256:
            return Divergence(
                run_id=run_id,
                node=c.node,
                call=c.call,
                field="prompt",
                recorded=c.prompt_sha256[:16],
                replayed=r.prompt_sha256[:16],
            ), compared
        for i, (a, b) in enumerate(zip(c.token_ids, r.token_ids, strict=False)):
            if a != b:
                return Divergence(
                    run_id=run_id, node=c.node, call=c.call, step=i, field="token_ids", recorded=a, replayed=b
                ), compared + i
        if len(c.token_ids) != len(r.token_ids):
            n = min(len(c.token_ids), len(r.token_ids))
            return Divergence(
                run_id=run_id,
                node=c.node,
                call=c.call,
                step=n,
                field="token_ids.length",
                recorded=len(c.token_ids),
                replayed=len(r.token_ids),
            ), compared + n
        compared += len(c.token_ids)
    return None, compared


def read_checkpoint(graph: Any, thread_id: str, checkpoint_id: str) -> tuple[Any, int | None, str | None]:
    """(channel values JSON, step, writing node) of one stored checkpoint."""
    tup = graph.checkpointer.get_tuple(
        {"configurable": {"thread_id": thread_id, "checkpoint_ns": "", "checkpoint_id": checkpoint_id}}
    )
    if tup is None:
        return None, None, None
    meta = tup.metadata or {}
    # The nodes that wrote this checkpoint are the tasks pending at its parent.
    node = None
    if tup.parent_config:
        try:
            node = ",".join(graph.get_state(tup.parent_config).next) or None
        except Exception:  # noqa: BLE001 - the node name is a label in the report, not a check
            node = None
    values = {
        k: v for k, v in tup.checkpoint.get("channel_values", {}).items() if not k.startswith("branch:")
    }
    return jsonable(values), meta.get("step"), node


def compare_checkpoints(
    run_id: str,
    graph: Any,
    thread_id: str,
    recorded: list[str],
    replay_graph: Any,
    replay_thread: str,
    replayed: list[str],
    id_map: dict[str, str],
) -> tuple[Divergence | None, int]:
    """Compare a run's checkpoints position by position; fills ``id_map`` (recorded id -> replay id)."""
    compared = 0
    for rec_id, rep_id in zip(recorded, replayed, strict=False):
        id_map[rec_id] = rep_id
        a, step, node = read_checkpoint(graph, thread_id, rec_id)
        b, step_b, node_b = read_checkpoint(replay_graph, replay_thread, rep_id)
        if a is None:
            return Divergence(
                run_id=run_id, field="checkpoint", recorded=f"{rec_id} (missing)", replayed=rep_id
            ), compared
        found = first_difference(a, b)
        if found is None and step != step_b:
            found = ("metadata.step", step, step_b)
        if found is not None:
            field, x, y = found
            return Divergence(
                run_id=run_id,
                node=node or node_b,
                step=step,
                field=f"checkpoint.{field}",
                recorded=x,
                replayed=y,
            ), compared
        compared += 1
    if len(recorded) != len(replayed):
        return Divergence(
            run_id=run_id, field="checkpoints.count", recorded=len(recorded), replayed=len(replayed)
        ), compared
    return None, compared


def replay_thread(
    *,
    workflow: Any,
    recorded_version: str,
    engine: Any,
    saver: Any,
    thread_id: str,
    target_run: str,
    ops: list[dict[str, Any]],
    runs: dict[str, RecordedRun],
    mode: str,
    fingerprint_recorded: dict[str, str],
    fingerprint_now: dict[str, str],
    by: str,
    cancelled: threading.Event | None = None,
    calibrations: Any = None,
) -> ReplayReport:
    """Replay the thread's operations up to and including ``target_run`` and compare (module docstring).

    ``calibrations``: the :class:`~elesium.state.calibrations.CalibrationStore` the runs' recorded
    per-node versions are read from (each run decodes with the trees it decoded with).

    ``workflow`` is the registered workflow to run (the recorded version when it is still registered);
    a version that differs from ``recorded_version`` is itself reported as the first divergence, and
    the run still proceeds so the report also shows where behaviour changed.
    """
    if mode not in ("reexecute", "recorded"):
        raise ValueError(f"unknown replay mode {mode!r}; use reexecute or recorded")
    started = time.time()
    report = ReplayReport(
        replay_id=uuid.uuid4().hex,
        run_id=target_run,
        thread_id=thread_id,
        mode=mode,
        verdict="identical",
        fingerprint_recorded=fingerprint_recorded,
        fingerprint_replayed=fingerprint_now,
        by=by,
        at=started,
        workflow_version_recorded=recorded_version,
        workflow_version_replayed=workflow.version,
    )
    if fingerprint_recorded and fingerprint_recorded != fingerprint_now:
        report.fingerprint_match = False
        diff = sorted(
            k
            for k in set(fingerprint_recorded) | set(fingerprint_now)
            if fingerprint_recorded.get(k) != fingerprint_now.get(k)
        )
        report.notes.append(
            f"engine fingerprint differs from the record ({', '.join(diff)}); replaying anyway"
        )
    first: Divergence | None = None
    if workflow.version != recorded_version:
        first = Divergence(field="workflow_version", recorded=recorded_version, replayed=workflow.version)
        report.notes.append(
            f"workflow {workflow.name} version {recorded_version} is not the one replayed "
            f"({workflow.version})"
        )
    graph = workflow.build(saver)
    pinned = pinned_calibrator(calibrations) if calibrations is not None else None
    scratch = f"replay-{report.replay_id}"
    id_map: dict[str, str] = {}
    try:
        for op in ops:
            if op.get("kind") == "update":
                cfg: dict[str, Any] = {"configurable": {"thread_id": scratch, "checkpoint_ns": ""}}
                parent = op.get("checkpoint_id")
                if parent:
                    cfg["configurable"]["checkpoint_id"] = id_map.get(parent, parent)
                new = graph.update_state(cfg, op.get("values"), as_node=op.get("as_node"))
                if op.get("result_checkpoint"):
                    id_map[op["result_checkpoint"]] = new["configurable"]["checkpoint_id"]
                continue
            rec = runs.get(op.get("run_id", ""))
            if rec is None:
                continue
            if rec.status in ("pending", "running"):
                break
            tap = TappedEngine(
                engine, recorded=rec.calls if mode == "recorded" else None, cancelled=cancelled
            )
            fork = rec.request.get("checkpoint_id")
            config = run_config(
                scratch,
                rec.run_id,
                rec.seed,
                rec.tenant,
                tap,
                checkpoint_id=id_map.get(fork, fork) if fork else None,
                workflow=workflow.name,
                mode=rec.request.get("mode"),
                calibrator=pinned if rec.calibrations else None,
                calibrations=rec.calibrations,
            )
            try:
                outcome = drive(graph, command_from(rec.request), config, cancelled=cancelled)
            except DivergenceError as exc:
                exc.divergence.run_id = rec.run_id
                first = first or exc.divergence
                break
            report.runs_replayed.append(rec.run_id)
            div, n_tokens = compare_calls(rec.run_id, rec.calls, tap.calls)
            report.calls_compared += len(tap.calls)
            report.tokens_compared += n_tokens
            if div is None and mode == "recorded" and tap.unserved:
                c = tap.unserved[0]
                div = Divergence(
                    run_id=rec.run_id,
                    node=c.node,
                    call=c.call,
                    field="path",
                    recorded=f"llm call {c.node}#{c.call}",
                    replayed=None,
                )
            cdiv, n_cp = compare_checkpoints(
                rec.run_id, graph, thread_id, rec.checkpoints, graph, scratch, outcome.checkpoints, id_map
            )
            report.checkpoints_compared += n_cp
            if div is None:
                div = cdiv
            if div is None and outcome.status != rec.status and rec.status != "interrupted_cancel":
                div = Divergence(
                    run_id=rec.run_id, field="status", recorded=rec.status, replayed=outcome.status
                )
            if div is not None:
                first = first or div
                break
            if rec.run_id == target_run:
                break
    finally:
        try:
            saver.delete_thread(scratch)
        except Exception:  # noqa: BLE001 - cleanup of the scratch thread is best effort
            pass
    if first is not None:
        report.verdict = "diverged"
        report.divergence = first
    report.elapsed_s = round(time.time() - started, 3)
    return report


class ReplayRefused(ValueError):
    """The run cannot be replayed (still running, or a cancelled run precedes it on its thread)."""


def replay_stored_run(
    *,
    store: Any,
    registry: Any,
    engine: Any,
    saver: Any,
    run_id: str,
    mode: str,
    by: str,
    tenant: str | None = None,
    fingerprint: Callable[[str | None], dict[str, str]] | None = None,
    runs_registry: Any = None,
    calibrations: Any = None,
) -> ReplayReport:
    """Replay an API run recorded in ``store`` (a ThreadStore) and store the report beside it.

    ``runs_registry`` / ``calibrations``: where the runs' recorded per-node calibration versions and
    their documents are read (without them every node replays on the global policy).

    ``tenant`` None reads the run whatever its tenant (the CLI, which has the Redis credentials anyway).
    The recorded workflow version is used when still registered, else the current one (and the report
    says so). Raises KeyError for an unknown run, :class:`ReplayRefused` for one that cannot be replayed.
    """
    from elesium.graphs.fingerprint import engine_fingerprint

    target = store.get_run_any(run_id) if tenant is None else store.get_run(run_id, tenant)
    if target is None:
        raise KeyError(f"run {run_id!r} not found")
    if target.status in ("pending", "running"):
        raise ReplayRefused(f"run {run_id!r} is {target.status}; replay it once it ends")
    ops = store.ops(target.thread_id)
    rows = {r.run_id: r for r in store.list_runs(target.thread_id, target.tenant, limit=100_000)}
    order = [op.get("run_id") for op in ops if op.get("kind") == "run"]
    upto = order[: order.index(run_id) + 1] if run_id in order else [run_id]
    if any(rows[r].error == "cancelled" for r in upto if r in rows):
        raise ReplayRefused(
            "a run up to this one on its thread was cancelled midway; its partial effects cannot be replayed"
        )
    runs = {
        rid: RecordedRun(
            run_id=rid,
            request=r.request,
            seed=r.seed,
            tenant=r.tenant,
            checkpoints=r.checkpoints,
            calls=[LLMCall(**c) for c in store.calls(rid)],
            status=r.status,
            calibrations=_recorded_calibrations(runs_registry, rid),
        )
        for rid, r in rows.items()
    }
    try:
        workflow = registry.get(target.workflow, target.workflow_version)
    except KeyError:
        workflow = registry.get(target.workflow)
    recorded_mode = target.request.get("mode")
    now = fingerprint(recorded_mode) if fingerprint is not None else engine_fingerprint(engine, recorded_mode)
    report = replay_thread(
        workflow=workflow,
        recorded_version=target.workflow_version,
        engine=engine,
        saver=saver,
        thread_id=target.thread_id,
        target_run=run_id,
        ops=ops,
        runs=runs,
        mode=mode,
        fingerprint_recorded=target.fingerprint,
        fingerprint_now=now,
        by=by,
        calibrations=calibrations,
    )
    store.add_replay(run_id, report.model_dump(mode="json"))
    return report


def _recorded_calibrations(runs_registry: Any, run_id: str) -> dict[str, str]:
    """Non-global versions a run's nodes decoded with (``global`` needs no pin: it is the default)."""
    record = runs_registry.get(run_id) if runs_registry is not None else None
    if record is None:
        return {}
    return {node: label for node, label in record.calibrations.items() if label != "global"}
