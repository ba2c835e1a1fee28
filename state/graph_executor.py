"""Running a queued run's LangGraph graph under its lease: start it, or resume it where it stopped.

LangGraph's durable execution does the resuming: each super-step's checkpoint (and each finished
task's pending writes) is in Redis, so invoking the graph with input ``None`` on a thread that has a
checkpoint continues from the last one, re-running only the tasks that had not finished. This
module decides between "start" and "resume", fences every write with the lease, and checks the
lease between super-steps so a cancel, a timeout or a lost lease stops the run at a step boundary.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from elesium.state.queue import Lease

GraphFactory = Callable[[Lease, Any], Any]
"""(lease, checkpointer) -> compiled graph."""


def drive(graph: Any, lease: Lease, input: Any, config: Mapping[str, Any]) -> str:
    """Start ``graph`` on ``input`` or resume it on ``config``'s thread; returns "succeeded" or
    "interrupted" (stopped at a LangGraph ``interrupt``, waiting for a human).

    The thread's latest checkpoint decides: none -> start with ``input``; one with tasks still to
    run -> resume with ``None``; one with no tasks at all -> the run had finished before its worker
    died (only the queue's acknowledgement was missing), so nothing is executed again.

    "No tasks" is ``state.tasks``, not ``state.next``: LangGraph leaves a task out of ``next`` once
    its pending writes are saved, so a super-step whose tasks all finished but whose checkpoint was
    never written (Redis lost between the two) has an empty ``next`` and still work to do.
    """
    state = graph.get_state(config)
    if state.created_at is not None and not state.tasks:
        return "succeeded"
    if state.created_at is not None and any(task.interrupts for task in state.tasks):
        return "interrupted"
    first = input if state.created_at is None else None
    for _update in graph.stream(first, dict(config), stream_mode="updates"):
        lease.check()
    lease.check()
    after = graph.get_state(config)
    return "interrupted" if after.tasks else "succeeded"


class GraphExecutor:
    """An executor (C6) for graphs built per run.

    Args:
        build: ``(lease, checkpointer) -> compiled graph``; the checkpointer is the lease's
            :class:`~elesium.state.fenced.FencedSaver`.
        config: ``(lease) -> RunnableConfig`` (thread id, run id, context, ...); by default the
            lease's thread and run ids.
        input_of: the graph input from the payload (default: ``payload["input"]``).
        saver_options: passed to the fenced saver (``prefix``, ``ttl_s``, ``keep_last``, ``serde``).
    """

    def __init__(self, build: GraphFactory, *, config: Callable[[Lease], Mapping[str, Any]] | None = None,
                 input_of: Callable[[Mapping[str, Any]], Any] | None = None,
                 saver_options: Mapping[str, Any] | None = None) -> None:
        self.build = build
        self.config = config or (lambda lease: {"configurable": {"thread_id": lease.thread_id,
                                                                 "run_id": lease.run_id}})
        self.input_of = input_of or (lambda payload: payload.get("input"))
        self.saver_options = dict(saver_options or {})

    def __call__(self, run_id: str, lease: Lease) -> str:
        graph = self.build(lease, lease.saver(**self.saver_options))
        return drive(graph, lease, self.input_of(lease.payload), self.config(lease))
