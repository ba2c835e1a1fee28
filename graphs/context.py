"""What an LLM node needs at run time, reached through LangGraph's ``config["configurable"]``.

Nodes are plain LangGraph callables; the engine, the run seed and the audit log are per run, not per
graph, so they travel in the run's config rather than in closures or globals. The primitive keys
(``thread_id``, ``run_id``, ``run_seed``, ``tenant``) are what a LangGraph checkpoint metadata and
an outside caller can see; the :class:`RunContext` object rides beside them under ``elesium``.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from langchain_core.runnables import RunnableConfig

from elesium.inference.types import TextEngine
from elesium.state.acceptance_log import AcceptanceLog

CONTEXT_KEY = "elesium"


class MissingRunContextError(RuntimeError):
    """An LLM node ran without a RunContext in its config (use run_config() or WorkflowRunner)."""


@dataclass
class RunContext:
    """The run an LLM node belongs to.

    Attributes:
        run_id: the run (registry key, acceptance stream key).
        seed: the run seed; every LLM call's seed derives from it (see :mod:`elesium.graphs.seeds`).
        tenant: who the run belongs to ("default" until the API adds auth).
        engine: the loaded :class:`~elesium.inference.engine.Engine`.
        log: where LLM calls append their step records; None skips the audit (ad-hoc local runs).
        mode: decode mode for nodes that do not pin one; None: the engine's default.
        workflow: workflow name, for per-node calibration lookups.
        calibrations: calibration version used per node (filled as calls happen; pre-filled with a
            run's recorded versions when it resumes or is re-executed, so its trees are the same).
        calibrator: picks each node's tree policy (:class:`elesium.graphs.calibration.NodeCalibrator`);
            None: every node uses the engine's global policy.
        record_trees: whether the run's tree-decoding calls record every drafted node of every step in
            the acceptance log (the console's step-by-step tree view); off by default, since a tree
            costs more log bytes than the step it belongs to. It changes no token.
    """

    run_id: str
    seed: int
    engine: TextEngine
    tenant: str = "default"
    log: AcceptanceLog | None = None
    mode: str | None = None
    workflow: str = ""
    calibrations: dict[str, str] = field(default_factory=dict)
    calibrator: Any = None
    record_trees: bool = False


def run_config(
    engine: TextEngine,
    *,
    run_seed: int,
    run_id: str | None = None,
    thread_id: str | None = None,
    tenant: str = "default",
    log: AcceptanceLog | None = None,
    mode: str | None = None,
    workflow: str = "",
    calibrator: Any = None,
    calibrations: Mapping[str, str] | None = None,
    record_trees: bool = False,
    **config: Any,
) -> RunnableConfig:
    """A LangGraph config for one run: pass it to ``graph.invoke`` / ``graph.stream``.

    ``thread_id`` defaults to the run id, so a run is one checkpoint thread. Extra keyword
    arguments (``callbacks``, ``recursion_limit``, ...) go into the config as they are.
    """
    run_id = run_id or uuid.uuid4().hex
    ctx = RunContext(
        run_id=run_id, seed=int(run_seed), engine=engine, tenant=tenant, log=log, mode=mode,
        workflow=workflow, calibrations=dict(calibrations or {}), calibrator=calibrator,
        record_trees=record_trees,
    )
    configurable = dict(config.pop("configurable", None) or {})
    configurable.update(
        {
            "thread_id": thread_id or run_id,
            "run_id": run_id,
            "run_seed": int(run_seed),
            "tenant": tenant,
            CONTEXT_KEY: ctx,
        }
    )
    return RunnableConfig(**config, configurable=configurable)


def set_record_trees(config: Mapping[str, Any], on: bool = True) -> None:
    """Turn tree recording on (or off) for the run ``config`` belongs to (see ``RunContext.record_trees``):
    for drivers that build the config elsewhere and decide per run or per workflow."""
    get_run_context(config).record_trees = bool(on)


def get_run_context(config: Mapping[str, Any] | None) -> RunContext:
    """The node's :class:`RunContext`; raises :class:`MissingRunContextError` with how to fix it."""
    ctx = ((config or {}).get("configurable") or {}).get(CONTEXT_KEY)
    if not isinstance(ctx, RunContext):
        raise MissingRunContextError(
            "this LLM node needs a run context: invoke the graph with "
            "config=run_config(engine, run_seed=...) "
            "or through WorkflowRunner"
        )
    return ctx
