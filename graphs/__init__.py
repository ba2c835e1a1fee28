"""The workflow layer: LangGraph workflows whose LLM nodes run on the engine, seeded and audited.

Authoring: :func:`llm_node` and :class:`WorkflowState` (the state base) in plain ``StateGraph`` code;
:func:`run_config` to run a graph by hand. Serving: :class:`Workflow`, :class:`Registry` and
:class:`WorkflowRunner`.
"""

from elesium.graphs.context import RunContext, get_run_context, run_config
from elesium.graphs.llm import LLMNode, WorkflowState, call_llm, llm_node
from elesium.graphs.registry import Registry, UnknownWorkflowError, Workflow
from elesium.graphs.runner import InputValidationError, RunResult, WorkflowRunner
from elesium.graphs.seeds import derive_seed
from elesium.graphs.workflows import default_registry

__all__ = [
    "InputValidationError",
    "LLMNode",
    "Registry",
    "RunContext",
    "RunResult",
    "UnknownWorkflowError",
    "Workflow",
    "WorkflowRunner",
    "WorkflowState",
    "call_llm",
    "default_registry",
    "derive_seed",
    "get_run_context",
    "llm_node",
    "run_config",
]
