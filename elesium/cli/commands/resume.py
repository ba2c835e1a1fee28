"""``elesium resume RUN_ID --value JSON``: answer a run's interrupt and continue it.

The run must be interrupted, its workflow version registered here, and the engine the same one it
started on (fingerprint); the value is validated against the workflow's resume schema. Each failure
is one line on stderr and exit code 1, with nothing written.
"""

from __future__ import annotations

import argparse

from elesium.cli.commands.common import add_model_args, add_state_args, load_engine, settings_from_args
from elesium.cli.commands.run import parse_json_arg, print_result, token_printer
from elesium.cli.errors import CliError
from elesium.cli.projects import add_config_args, load_project_env, registry_from_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("resume", help="continue a run stopped at an interrupt")
    p.add_argument("run_id")
    p.add_argument(
        "--value",
        required=True,
        help="the interrupt's answer as JSON (or @FILE), e.g. '{\"approved\": true}'",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object with the final state")
    add_model_args(p)
    add_state_args(p)
    add_config_args(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from elesium.graphs.registry import UnknownWorkflowError
    from elesium.graphs.runner import RunStateError, WorkflowRunner, validate
    from elesium.state import RunRegistry, RunStatus, default_url

    load_project_env(args)
    value = parse_json_arg(args.value, "--value")
    # Check the run before loading the model: a wrong id or state should fail in a second.
    record = RunRegistry.from_url(default_url(settings_from_args(args)), prefix="elesium:runs").get(
        args.run_id
    )
    if record is None:
        raise CliError(f"no run {args.run_id!r} in the registry")
    if record.status != RunStatus.INTERRUPTED:
        raise RunStateError(
            f"run {args.run_id!r} is {record.status.value}; only an interrupted run can be resumed"
        )
    registry = registry_from_args(args)  # the project's graphs (--config), as `elesium run` started it with
    try:
        workflow = registry.get(record.workflow, record.workflow_version)
    except UnknownWorkflowError as exc:
        raise CliError(str(exc)) from None
    if workflow.resume_model is not None:
        validate(workflow.resume_model, value, f"invalid resume value for workflow {workflow.name!r}")
    runner = WorkflowRunner(load_engine(args), registry=registry)
    return print_result(runner.resume(args.run_id, value, on_event=token_printer(args.json)), args.json)
