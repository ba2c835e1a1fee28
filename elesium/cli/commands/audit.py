"""``elesium audit verify RUN_ID``: verify a run's hash chain and print the verdict.

An API run is found by its run row (``ThreadStore``); any other run (``elesium run`` without
``--server``, a background run) by its run registry record or its seal under ``--prefix`` (the
``WorkflowRunner``'s key root, ``elesium`` by default), whose checkpoints, acceptance stream and chain
keys are then read.

Reads the run's records from Redis directly (operators with the Redis credentials see every
tenant's runs), recomputes every digest and link, and checks the seal's signature with the key this
process is configured with (``ELESIUM_AUDIT_KEY`` / ``ELESIUM_AUDIT_SIGNING_KEY_FILE``). Exit code 0
when the chain verifies, 3 when something was tampered with (the first entry that does not verify is
named), 1 with one line for an unknown run.
"""

from __future__ import annotations

import argparse
import json

from elesium.cli.commands.common import settings_from_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("audit", help="verify a run's tamper-evident record (hash chain and signed seal)")
    actions = p.add_subparsers(dest="audit_command", metavar="ACTION", required=True)
    v = actions.add_parser("verify", help="re-hash every record of a run and check its chain and seal")
    v.add_argument("run_id")
    v.add_argument("--json", action="store_true", help="print the whole verdict as JSON")
    v.add_argument("--redis-url", default=None, help="Redis/Valkey URL (default: $REDIS_URL, else the "
                   "embedded Valkey)")
    v.add_argument("--prefix", default="elesium", help="key root of runs made without --server (the "
                   "WorkflowRunner's; default: elesium)")
    v.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from elesium.cli.errors import CliError
    from elesium.graphs.audit_chain import verify_run
    from elesium.state import connect, default_url
    from elesium.state.acceptance_log import AcceptanceLog
    from elesium.state.audit_chain import AuditChain, signer_for
    from elesium.state.runs import RunRegistry
    from elesium.state.threads import ThreadStore

    settings = settings_from_args(args)
    url = default_url(settings)
    client = connect(url)
    store, signer = ThreadStore(client), signer_for(settings)
    try:
        if store.get_run_any(args.run_id) is not None:  # an API run
            verdict = verify_run(client, args.run_id, store=store, signer=signer)
        else:  # a WorkflowRunner run (elesium run without --server, a background run)
            prefix = args.prefix
            verdict = verify_run(client, args.run_id, signer=signer, cp_prefix=f"{prefix}:cp",
                                 registry=RunRegistry(client, prefix=f"{prefix}:runs"),
                                 acceptance=AcceptanceLog(client, prefix=f"{prefix}:acc"),
                                 chain=AuditChain(client, prefix=f"{prefix}:audit"))
    except KeyError:
        raise CliError(f"no run {args.run_id!r} in {url}") from None
    if args.json:
        print(json.dumps(verdict.model_dump(mode="json"), indent=1))
    else:
        for note in verdict.notes:
            print(f"note: {note}")
        seal = ("unsealed" if not verdict.sealed else "sealed, unsigned" if not verdict.signed else
                f"sealed, signature {'ok' if verdict.signature_ok else 'BAD'} ({verdict.key_id})")
        state = "ok" if verdict.ok else "tampered"
        print(f"{state}: run {verdict.run_id} - {verdict.entries_checked} chain entries, "
              f"{verdict.records_checked} records checked, {seal}")
        bad = verdict.first_bad
        if bad is not None:
            where = f"entry {bad.seq}" if bad.seq is not None else "outside the chain"
            print(f"first bad: {where} {bad.kind} {bad.ref}: {bad.reason}")
    return 0 if verdict.ok else 3
