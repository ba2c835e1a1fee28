"""Writing an LLM call's decode steps to the run's acceptance stream.

Each call writes one ``kind="call"`` entry first (the prefill, which commits the first token; the
call's seed; every token the call produced), then its verification steps, keyed by run, node,
call index and step. A LangGraph node re-runs from its start when a run resumes after an
``interrupt`` in it, and produces the same call again (same seed, same tokens): a per-run set of
recorded (node, call) pairs keeps that second execution out of the audit trail.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from elesium.inference.records import Generation, StepRecord
from elesium.state.acceptance_log import AcceptanceEntry, AcceptanceLog, LoggedStep


def calls_key(log: AcceptanceLog, run_id: str) -> str:
    """The set of recorded calls; shares the stream's ``{run_id}`` hash tag (one cluster slot)."""
    return f"{log.key(run_id)}:calls"


def call_entries(
    run_id: str,
    node: str,
    call_index: int,
    call_seed: int,
    gen: Generation,
    first_step_id: int,
    *,
    prompt_ids: Sequence[int] | None = None,
    temperature: float | None = None,
) -> list[AcceptanceEntry]:
    """The entries of one call: its ``call`` entry (with the prompt's token ids, when given), then one
    per verification step."""
    prefill = StepRecord(
        step=0,
        mode=gen.mode,
        tree_size=1,
        tree_depth=0,
        accepted_length=1,
        accepted_nodes=(0,),
        tokens=tuple(gen.token_ids[:1]),
    )
    head = AcceptanceEntry(
        run_id=run_id,
        node_id=node,
        step_id=first_step_id,
        record=LoggedStep.from_dict(prefill.to_dict()),
        kind="call",
        call_index=call_index,
        call_seed=call_seed,
        tokens=tuple(gen.token_ids),
        prompt=tuple(prompt_ids) if prompt_ids is not None else None,
        temperature=temperature,
    )
    steps = [
        AcceptanceEntry(
            run_id=run_id,
            node_id=node,
            step_id=first_step_id + 1 + i,
            record=LoggedStep.from_dict(rec.to_dict()),
            call_index=call_index,
            call_seed=call_seed,
        )
        for i, rec in enumerate(gen.steps)
    ]
    return [head, *steps]


def record_call(
    log: AcceptanceLog,
    run_id: str,
    node: str,
    call_index: int,
    call_seed: int,
    gen: Generation,
    *,
    prompt_ids: Sequence[int] | None = None,
    temperature: float | None = None,
) -> bool:
    """Append the call's entries unless this (node, call) is already recorded; True when written.

    The "recorded" marker and the entries are one script (fenced under a lease): a worker that dies
    or loses its lease between the two cannot leave a call marked but missing.
    """
    first = log.length(run_id)
    entries = call_entries(
        run_id, node, call_index, call_seed, gen, first, prompt_ids=prompt_ids, temperature=temperature
    )
    return bool(log.append_many(entries, once=(calls_key(log, run_id), f"{node}\x1f{call_index}")))


def call_heads(log: AcceptanceLog, run_id: str) -> list[AcceptanceEntry]:
    """The ``call`` entries of the run (one per LLM call, in call order), without their steps."""
    return [e for e in log.iter_entries(run_id) if e.kind == "call"]


def call_tokens(log: AcceptanceLog, run_id: str) -> list[tuple[str, int, int, tuple[int, ...]]]:
    """(node, call index, call seed, tokens) of every call of the run, in call order."""
    return [(e.node_id, e.call_index or 0, e.call_seed or 0, e.tokens or ()) for e in call_heads(log, run_id)]


def comparable_entries(log: AcceptanceLog, run_id: str) -> list[dict[str, Any]]:
    """The run's entries without what differs between identical runs (stream ids, run id, timings)."""
    out = []
    for e in log.iter_entries(run_id):
        rec = e.record.to_dict()
        rec.pop("elapsed_s", None)
        out.append(
            {
                "node": e.node_id,
                "step_id": e.step_id,
                "kind": e.kind,
                "call_index": e.call_index,
                "call_seed": e.call_seed,
                "tokens": list(e.tokens) if e.tokens is not None else None,
                "record": rec,
            }
        )
    return out
