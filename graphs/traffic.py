"""Self-distillation data from the service's own traffic: the finished runs' LLM calls.

Draft heads predict what this model says next, so the best training text for a deployment is what the
model said in that deployment's workflows. Every LLM call of a run leaves a ``call`` entry in the run's
acceptance stream with the prompt's token ids (chat template applied) and every token it produced
(:mod:`elesium.graphs.audit`); those pairs are exactly the records ``elesium train-heads`` distils
into (``inference/training/distill.py``: ``prompt_ids``, ``response_ids``), with no generation needed.

Only succeeded runs count (a failed or cancelled run's last call may be cut short), and only runs that
decoded with the loaded model: heads trained on another model's answers would predict that model.
``include_prompts=False`` keeps the prompts out, for deployments whose policy forbids training on
them: each record is then the answer alone (its first token stands in as the context), and no prompt
token reaches the data file.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from elesium.graphs.audit import call_heads
from elesium.state.acceptance_log import AcceptanceLog
from elesium.state.runs import RunRegistry, RunStatus


@dataclass
class TrafficData:
    """The records, and what was passed over and why (for the command's report)."""

    records: list[dict[str, Any]] = field(default_factory=list)
    runs: int = 0
    skipped: Counter[str] = field(default_factory=Counter)

    def describe(self) -> str:
        skipped = ", ".join(f"{n} {why}" for why, n in sorted(self.skipped.items()))
        return f"{len(self.records)} LLM calls from {self.runs} succeeded runs" + (
            f" (skipped: {skipped})" if skipped else ""
        )


def records_from_log(
    runs: RunRegistry,
    log: AcceptanceLog,
    *,
    model_sha256: str,
    workflow: str | None = None,
    include_prompts: bool = True,
    limit: int = 1_000_000,
) -> TrafficData:
    """Distillation records, one per LLM call of every succeeded run (of ``workflow``, if given).

    A run's calls share its run id as the record id, so the training split keeps a run on one side.
    Calls recorded before prompts were logged, and empty answers, are skipped and counted.
    """
    out = TrafficData()
    for run in sorted(runs.list_by_status(RunStatus.SUCCEEDED, limit=limit), key=lambda r: r.run_id):
        if workflow is not None and run.workflow != workflow:
            continue
        if (run.engine or {}).get("model_sha256", model_sha256) != model_sha256:
            out.skipped["runs of another model"] += 1
            continue
        out.runs += 1
        for call in call_heads(log, run.run_id):
            answer = list(call.tokens or ())
            if call.prompt is None:
                out.skipped["calls without a recorded prompt"] += 1
                continue
            if len(answer) < 2:
                out.skipped["calls of fewer than 2 tokens"] += 1
                continue
            context, answer = (list(call.prompt), answer) if include_prompts else (answer[:1], answer[1:])
            out.records.append({
                "id": run.run_id,
                "task": f"{run.workflow}/{call.node_id}",
                "prompt_ids": context,
                "response_ids": answer,
                "sampling": {
                    "temperature": call.temperature if call.temperature is not None else 0.0,
                    "max_new_tokens": len(call.tokens or ()),
                    "seed": call.call_seed,
                },
                "model_sha256": model_sha256,
                "source": {"run_id": run.run_id, "node": call.node_id, "call": call.call_index,
                           "prompts": include_prompts},
            })
    return out
