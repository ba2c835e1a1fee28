"""``elesium replay RUN_ID``: audit-replay an API run in-process and print the verdict.

Reads the run from Redis directly (operators with the Redis credentials see every tenant's runs),
re-executes it on the locally loaded engine (or serves its recorded LLM outputs with
``--mode recorded``) and stores the report beside the run, as the API's replay route does. Exit
code 0 for ``identical``, 3 for ``diverged``; bad input is one line and exit code 1.
"""

from __future__ import annotations

import argparse
import getpass
import json

from elesium.cli.commands.common import add_model_args, load_engine
from elesium.cli.projects import add_config_args, registry_from_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "replay", help="re-execute an API run and prove every token and checkpoint is the same"
    )
    p.add_argument("run_id")
    p.add_argument("--mode", choices=["reexecute", "recorded"], default="reexecute")
    p.add_argument("--json", action="store_true", help="print the whole report as JSON")
    add_config_args(p)
    add_model_args(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from elesium.cli.errors import CliError
    from elesium.graphs import replay as rp
    from elesium.state import RedisSaver, RunRegistry, connect, default_url
    from elesium.state.calibrations import CalibrationStore
    from elesium.state.threads import ThreadStore

    registry = registry_from_args(args)
    url = default_url()
    client = connect(url)
    store = ThreadStore(client)
    row = store.get_run_any(args.run_id)
    if row is None:
        raise CliError(
            f"no API run {args.run_id!r} in {url} (runs started with `elesium run` are not API runs)"
        )
    engine = load_engine(args)
    try:
        report = rp.replay_stored_run(
            store=store,
            registry=registry,
            engine=engine,
            saver=RedisSaver(client),
            run_id=args.run_id,
            mode=args.mode,
            by=f"cli/{getpass.getuser()}",
            runs_registry=RunRegistry(client),
            calibrations=CalibrationStore(client),
        )
    except (rp.ReplayRefused, KeyError) as exc:
        raise CliError(str(exc).strip("'\"")) from None
    if args.json:
        print(json.dumps(report.model_dump(mode="json"), indent=1))
    else:
        for note in report.notes:
            print(f"note: {note}")
        print(
            f"{report.verdict}: run {report.run_id} ({report.mode}) - {report.calls_compared} LLM calls, "
            f"{report.tokens_compared} tokens, {report.checkpoints_compared} checkpoints compared"
        )
        if report.divergence is not None:
            print(report.divergence.describe())
    return 0 if report.verdict == "identical" else 3
