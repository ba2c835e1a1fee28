"""The shipped workflows: small prompts, with constrained choices, fields and rules carrying the logic.

The bundled model has 135M parameters. It can pick one of a few labels under a grammar and write a
sentence or two; it cannot be trusted with policy, arithmetic or routing. So each workflow puts
those in deterministic nodes and conditional edges, and asks the model only what it can answer.
"""

from __future__ import annotations

from elesium.graphs.registry import Registry, Workflow

_DEFAULT: Registry | None = None


def shipped() -> list[Workflow]:
    """``ticket-triage``, ``expense-approval`` and ``incident-summary``, freshly defined."""
    from elesium.graphs.workflows import expense_approval, incident_summary, ticket_triage

    return [ticket_triage.workflow(), expense_approval.workflow(), incident_summary.workflow()]


def default_registry() -> Registry:
    """The shipped workflows (built once per process): what the CLI and a server without a registry of
    their own serve."""
    global _DEFAULT
    if _DEFAULT is None:
        registry = Registry()
        for workflow in shipped():
            registry.register(workflow)
        _DEFAULT = registry
    return _DEFAULT
