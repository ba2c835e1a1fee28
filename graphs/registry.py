"""The workflow registry: named, versioned graphs with a typed input.

A :class:`Workflow` pairs a ``StateGraph`` factory with what a service needs to run it safely: an
input model (validated before anything is written), a description, and a content-hash version
(:mod:`elesium.graphs.versioning`) that run records store, so an audit can tell whether the code
that ran is the code that is deployed. A registry may hold several versions of a name; ``get``
without a version returns the one registered last.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from langgraph.graph import StateGraph
from langgraph.graph.state import CompiledStateGraph
from pydantic import BaseModel, TypeAdapter

from elesium.errors import UserError
from elesium.graphs.llm import CALLS_KEY
from elesium.graphs.versioning import graph_version


class UnknownWorkflowError(UserError, KeyError):
    """No workflow (or no such version of it) in the registry."""

    def __str__(self) -> str:  # KeyError's str() would quote the message
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class Workflow:
    """A registered workflow.

    Attributes:
        name: the registry key (also ``graph_id``).
        version: 16 hex chars of the content hash of graph, prompts and node code.
        label: an optional human label ("2026-11 policy"), not part of the version.
        input_model: validates a run's input; its fields seed the initial state.
        state_schema: the graph's state type.
        resume_model: validates the value a human sends to resume an ``interrupt`` (None: any JSON).
        record_trees: every run of the workflow records each decode step's whole drafted tree in the
            acceptance log (a run can also ask for it: ``configurable.record_trees``). Not part of the
            version: it changes what is logged, never a token.
    """

    name: str
    version: str
    label: str | None
    description: str
    input_model: type[BaseModel]
    state_schema: type
    graph_id: str
    factory: Callable[[], StateGraph] = field(repr=False, compare=False)
    resume_model: type[BaseModel] | None = None
    record_trees: bool = False

    @classmethod
    def define(
        cls,
        name: str,
        factory: Callable[[], StateGraph],
        input_model: type[BaseModel],
        *,
        description: str,
        label: str | None = None,
        resume_model: type[BaseModel] | None = None,
        record_trees: bool = False,
    ) -> Workflow:
        """Build the graph once to check it and hash it."""
        builder = factory()
        state = builder.state_schema
        fields = _state_fields(state)
        missing = [k for k in input_model.model_fields if k not in fields]
        if missing:
            raise ValueError(
                f"workflow {name!r}: input fields {missing} are not keys of the state {state.__name__}"
            )
        if CALLS_KEY not in fields:
            raise ValueError(
                f"workflow {name!r}: the state {state.__name__} lacks {CALLS_KEY!r}; subclass "
                "elesium.graphs.WorkflowState so LLM calls get deterministic indices"
            )
        builder.compile()  # structural errors surface at registration, not at the first run
        return cls(
            name=name,
            version=graph_version(builder, input_model),
            label=label,
            description=description,
            input_model=input_model,
            state_schema=state,
            graph_id=name,
            factory=factory,
            resume_model=resume_model,
            record_trees=record_trees,
        )

    def build(self, checkpointer: Any = None) -> CompiledStateGraph:
        """A fresh compiled graph on ``checkpointer`` (None: no persistence)."""
        return self.factory().compile(checkpointer=checkpointer, name=self.name)

    def json_schema(self) -> dict[str, Any]:
        """The input, state and resume schemas, for API clients."""
        try:
            state: dict[str, Any] = TypeAdapter(self.state_schema).json_schema()
        except Exception:  # noqa: BLE001 - an exotic state type: still list the keys
            state = {"type": "object", "properties": {k: {} for k in _state_fields(self.state_schema)}}
        return {
            "input": self.input_model.model_json_schema(),
            "state": state,
            "resume": self.resume_model.model_json_schema() if self.resume_model else None,
        }

    def summary(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "version": self.version,
            "label": self.label,
            "description": self.description,
            "input_fields": list(self.input_model.model_fields),
        }


def _state_fields(state: type) -> set[str]:
    if hasattr(state, "model_fields"):
        return set(state.model_fields)
    try:
        return set(typing.get_type_hints(state, include_extras=True))
    except Exception:  # noqa: BLE001 - unresolvable forward refs: fall back to raw annotations
        return set(getattr(state, "__annotations__", {}))


class Registry:
    """Workflows by name and version."""

    def __init__(self) -> None:
        self._by_name: dict[str, dict[str, Workflow]] = {}
        self._latest: dict[str, str] = {}

    def register(self, workflow: Workflow) -> Workflow:
        self._by_name.setdefault(workflow.name, {})[workflow.version] = workflow
        self._latest[workflow.name] = workflow.version
        return workflow

    def list(self) -> list[Workflow]:
        """The latest version of each workflow, by name."""
        return [self._by_name[n][self._latest[n]] for n in sorted(self._by_name)]

    def get(self, name: str, version: str | None = None) -> Workflow:
        versions = self._by_name.get(name)
        if not versions:
            known = ", ".join(sorted(self._by_name)) or "none"
            raise UnknownWorkflowError(f"unknown workflow {name!r} (registered: {known})")
        if version is None:
            return versions[self._latest[name]]
        if version not in versions:
            raise UnknownWorkflowError(
                f"workflow {name!r} has no version {version!r} (registered: {', '.join(sorted(versions))})"
            )
        return versions[version]
