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

Re-execution drives the graph through :mod:`elesium.graphs.execution`, the same code a live run takes
(:class:`~elesium.graphs.execution.RunEngine` serves the record in recorded mode); this module only
compares and reports.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

from elesium.graphs.audit_chain import AuditVerdict, chain_replay_reports, verify_run
from elesium.graphs.execution import (
    Divergence,
    DivergenceError,
    LLMCall,
    RunEngine,
    command_from,
    drive,
    recorded_calibrations,
    run_config,
)
from elesium.graphs.serialization import jsonable
from elesium.inference.types import TextEngine

__all__ = ["Divergence", "LLMCall", "MessageIds", "ReplayRefused", "ReplayReport", "compare_calls",
           "compare_checkpoints", "first_difference", "is_message", "jsonable", "replay_stored_run",
           "replay_thread"]


# ---------------------------------------------------------------- serialisation and comparison
@dataclasses.dataclass
class MessageIds:
    """LangChain messages' ids, compared up to a consistent renaming.

    LangGraph's ``add_messages`` and LangChain's chat models label a message with a fresh ``uuid4`` when
    it has no id, so a re-execution cannot draw the ids its record holds, and a ``MessagesState`` graph
    would never replay identical. The ids are labels, not output: what an audit must prove is that the
    same messages stand in the same relations. So each recorded id must stand for one replayed id
    throughout a replay (a message updated or removed later is the same message), and no two recorded
    ids for one replayed id; every other field of a message still compares exactly."""

    forward: dict[str, str] = dataclasses.field(default_factory=dict)  # recorded -> replayed
    backward: dict[str, str] = dataclasses.field(default_factory=dict)  # replayed -> recorded

    def pair(self, recorded: Any, replayed: Any) -> bool:
        """Whether ``recorded`` may stand for ``replayed`` (and, if so, that it does from now on)."""
        if not isinstance(recorded, str) or not isinstance(replayed, str):
            return recorded == replayed
        if (self.forward.get(recorded, replayed) != replayed
                or self.backward.get(replayed, recorded) != recorded):
            return False
        self.forward[recorded] = replayed
        self.backward[replayed] = recorded
        return True

    def to_replayed(self, value: Any) -> Any:
        """``value`` (JSON) with the ids of the messages in it renamed as the replay named them: a recorded
        state update that names a message (to replace or remove it) must name the replayed one."""
        if isinstance(value, list):
            return [self.to_replayed(v) for v in value]
        if not isinstance(value, dict):
            return value
        out = {k: self.to_replayed(v) for k, v in value.items()}
        if is_message(value) and value.get("id") in self.forward:
            out["id"] = self.forward[value["id"]]
        return out


# LangChain's message types (``BaseMessage.type``, chunks included) and the roles a client may send: a
# state's own dict that happens to hold "id", "content" and "type" keeps its id compared exactly.
MESSAGE_KINDS = frozenset({
    "human", "ai", "system", "tool", "function", "chat", "remove", "developer", "user", "assistant",
    "AIMessageChunk", "HumanMessageChunk", "SystemMessageChunk", "ToolMessageChunk", "FunctionMessageChunk",
    "ChatMessageChunk",
})


def is_message(value: Any) -> bool:
    """A LangChain message as :func:`jsonable` writes it (``model_dump``), or as a client sends one."""
    return (isinstance(value, dict) and "id" in value and "content" in value
            and value.get("type", value.get("role")) in MESSAGE_KINDS)


def first_difference(recorded: Any, replayed: Any, path: str = "",
                     messages: MessageIds | None = None) -> tuple[str, Any, Any] | None:
    """(field path, recorded, replayed) of the first difference between two JSON-like values.

    With ``messages``, the ids of messages are compared up to its renaming (:class:`MessageIds`)."""
    if isinstance(recorded, dict) and isinstance(replayed, dict):
        renamed = messages is not None and is_message(recorded) and is_message(replayed)
        for key in sorted(set(recorded) | set(replayed)):
            sub = f"{path}.{key}" if path else str(key)
            if key not in recorded or key not in replayed:
                return sub, recorded.get(key), replayed.get(key)
            if renamed and key == "id":
                assert messages is not None
                if not messages.pair(recorded[key], replayed[key]):
                    return sub, recorded[key], replayed[key]
                continue
            found = first_difference(recorded[key], replayed[key], sub, messages)
            if found:
                return found
        return None
    if isinstance(recorded, list) and isinstance(replayed, list):
        for i, (a, b) in enumerate(zip(recorded, replayed, strict=False)):
            found = first_difference(a, b, f"{path}[{i}]", messages)
            if found:
                return found
        if len(recorded) != len(replayed):
            return f"{path}.length", len(recorded), len(replayed)
        return None
    return None if recorded == replayed else (path or "value", recorded, replayed)


# ---------------------------------------------------------------- replay
class ReplayReport(BaseModel):
    """What a replay found. ``verdict`` is "identical" only if every call and checkpoint matched."""

    replay_id: str
    run_id: str
    thread_id: str
    mode: str
    verdict: str  # identical | diverged
    divergence: Divergence | None = None  # the first finding: the audit chain's, else the replay's
    replay_divergence: Divergence | None = None  # what re-running found, even when the chain failed first
    audit: list[dict[str, Any]] = []  # the chain verdict of each run replayed, checked before replaying
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
    messages: MessageIds | None = None,
) -> tuple[Divergence | None, int]:
    """Compare a run's checkpoints position by position; fills ``id_map`` (recorded id -> replay id).

    ``messages``: the thread's message-id renaming so far (:class:`MessageIds`); a fresh one if None."""
    messages = MessageIds() if messages is None else messages
    compared = 0
    for rec_id, rep_id in zip(recorded, replayed, strict=False):
        id_map[rec_id] = rep_id
        a, step, node = read_checkpoint(graph, thread_id, rec_id)
        b, step_b, node_b = read_checkpoint(replay_graph, replay_thread, rep_id)
        if a is None:
            return Divergence(
                run_id=run_id, field="checkpoint", recorded=f"{rec_id} (missing)", replayed=rep_id
            ), compared
        found = first_difference(a, b, messages=messages)
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
    engine: TextEngine,
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
    audit: list[AuditVerdict] | None = None,
) -> ReplayReport:
    """Replay the thread's operations up to and including ``target_run`` and compare (module docstring).

    ``audit``: the chain verdicts of the runs replayed (:func:`audit_runs`); the first that fails is
    the report's first divergence, and the replay still runs so the report shows what it finds too.

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
    messages = MessageIds()  # one renaming for the whole thread: its runs share their messages
    try:
        for op in ops:
            if op.get("kind") == "update":
                cfg: dict[str, Any] = {"configurable": {"thread_id": scratch, "checkpoint_ns": ""}}
                parent = op.get("checkpoint_id")
                if parent:
                    cfg["configurable"]["checkpoint_id"] = id_map.get(parent, parent)
                values = messages.to_replayed(op.get("values"))
                new = graph.update_state(cfg, values, as_node=op.get("as_node"))
                if op.get("result_checkpoint"):
                    id_map[op["result_checkpoint"]] = new["configurable"]["checkpoint_id"]
                continue
            rec = runs.get(op.get("run_id", ""))
            if rec is None:
                continue
            if rec.status in ("pending", "running"):
                break
            tap = RunEngine(engine, recorded=rec.calls if mode == "recorded" else None, cancelled=cancelled,
                            cuts=rec.calls)
            fork = rec.request.get("checkpoint_id")
            config = run_config(
                tap,
                thread_id=scratch,
                run_id=rec.run_id,
                seed=rec.seed,
                tenant=rec.tenant,
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
                rec.run_id, graph, thread_id, rec.checkpoints, graph, scratch, outcome.checkpoints, id_map,
                messages,
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
    report.replay_divergence = first
    broken = next((v for v in audit or () if not v.ok), None)
    report.audit = [v.model_dump(mode="json") for v in audit or ()]
    if broken is not None:
        first = chain_divergence(broken)
        report.notes.insert(0, f"audit chain of run {broken.run_id} does not verify: {first.describe()}")
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
    engine: TextEngine,
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
    # A deleted run (kept for audit) is replayable: the API's replay route is the auditor's.
    target = (store.get_run_any(run_id) if tenant is None
              else store.get_run(run_id, tenant, include_deleted=True))
    if target is None:
        raise KeyError(f"run {run_id!r} not found")
    if target.status in ("pending", "running"):
        raise ReplayRefused(f"run {run_id!r} is {target.status}; replay it once it ends")
    ops = store.ops(target.thread_id)
    rows = {r.run_id: r for r in store.list_runs(target.thread_id, target.tenant, limit=100_000,
                                                 include_deleted=True)}
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
            calibrations=_pins(recorded_calibrations(runs_registry, rid)),
        )
        for rid, r in rows.items()
    }
    try:
        workflow = registry.get(target.workflow, target.workflow_version)
    except KeyError:
        workflow = registry.get(target.workflow)
    report_notes: list[str] = []
    chained = audit_runs(store, saver, [r for r in upto if r in rows], report_notes)
    recorded_mode = target.request.get("mode")
    now = fingerprint(recorded_mode) if fingerprint is not None else engine.fingerprint(recorded_mode)
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
        audit=chained,
    )
    report.notes.extend(report_notes)
    store.add_replay(run_id, report.model_dump(mode="json"))
    chain_replay_reports(store.client, thread_id=target.thread_id, run_id=run_id, store=store,
                         cp_prefix=getattr(saver, "prefix", "elesium:cp"))
    return report


def audit_runs(store: Any, saver: Any, run_ids: list[str], notes: list[str]) -> list[AuditVerdict]:
    """Verify the audit chain of each run (oldest first) before it is replayed. A run with neither
    chain nor seal was recorded before chains existed: noted, not failed."""
    out = []
    for rid in run_ids:
        verdict = verify_run(store.client, rid, store=store, cp_prefix=getattr(saver, "prefix", "elesium:cp"))
        if verdict.entries_checked == 0 and not verdict.sealed:
            notes.append(f"run {rid} has no audit chain (recorded before chains, or with chaining off)")
            continue
        out.append(verdict)
    return out


def chain_divergence(verdict: AuditVerdict) -> Divergence:
    """A failed chain verdict as a replay divergence: where (entry seq, record) and why."""
    bad = verdict.first_bad
    assert bad is not None
    node, call = None, None
    if bad.ref.startswith("call:"):
        node, _, index = bad.ref[5:].rpartition("#")
        call = int(index) if index.isdigit() else None
    return Divergence(run_id=verdict.run_id, node=node, call=call, step=bad.seq, field=f"audit.{bad.kind}",
                      recorded=bad.ref, replayed=bad.reason)


def _pins(calibrations: dict[str, str]) -> dict[str, str]:
    """Non-global versions a run's nodes decoded with (``global`` needs no pin: it is the default)."""
    return {node: label for node, label in calibrations.items() if label != "global"}
