"""``elesium tune``: measure this hardware and pick the tree; saves a per-device profile.

``elesium tune --from-log [--workflow W]`` instead rebuilds the per-(workflow, node) calibrations
from the acceptance log of the stored succeeded runs (no model is loaded) and prints the
before/after table (graphs/calibration.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from elesium.cli.commands.common import (
    add_model_args,
    add_state_args,
    load_engine,
    read_prompt_file,
    settings_from_args,
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tune",
                       help="measure forward cost and head acceptance; choose the tree for this device")
    p.add_argument("--prompts", type=Path, default=None,
                   help="calibration prompts (JSONL 'prompt' or 'turns'); "
                   "default: 16 from the training templates")
    p.add_argument("--calibration", type=int, default=16,
                   help="number of template prompts when --prompts is not given")
    p.add_argument("--out", type=Path, default=None, help="also write the profile here")
    p.add_argument("--from-log", action="store_true",
                   help="rebuild the per-node tree calibrations of workflows from the acceptance log of "
                   "their succeeded runs, and print the before/after table (loads no model)")
    p.add_argument("--workflow", default=None, help="with --from-log: only this workflow (default: all)")
    p.add_argument("--adopt", action="store_true",
                   help="with --from-log: make the rebuilt calibrations current at once instead of "
                   "putting them on trial against the current ones")
    p.add_argument("--prefix", default="elesium",
                   help="with --from-log: key root of the runs, logs and calibrations (default: elesium)")
    add_model_args(p)
    add_state_args(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if args.from_log:
        return from_log(args)
    for flag, given in (("--workflow", args.workflow is not None), ("--adopt", args.adopt)):
        if given:
            from elesium.cli.errors import CliError

            raise CliError(f"{flag} goes with --from-log")
    from elesium.inference.training.distill import build_prompts
    from elesium.inference.tuning.profile import profile_path
    from elesium.inference.tuning.tuner import tune

    if args.prompts is not None:
        prompts = read_prompt_file(args.prompts)
    else:  # a seed the training set never uses, so calibration prompts are fresh draws
        prompts = [p["prompt"] for p in build_prompts(args.calibration, seed=7_777_777)]
    engine = load_engine(args, max_len=2048)
    profile = tune(engine, prompts, log=lambda m: print(m, file=sys.stderr, flush=True))
    settings = settings_from_args(args)  # --cache-dir, where the profile is looked up
    saved = profile.save(profile_path(settings.cache_dir, profile.model_sha256, engine.model.device,
                                      engine.model.dtype, profile.weights))
    print(f"profile saved to {saved}")
    if args.out is not None:
        print(f"profile saved to {profile.save(args.out)}")
    return 0


def _policy_cells(label: str, calib: object | None) -> list[str]:
    if calib is None:
        return [label, "-", "-", "-"]
    temperature = "-" if calib.draft_temperature is None else f"{calib.draft_temperature:.2f}"
    return [label, str(calib.max_nodes), f"{calib.calibration:.2f}", temperature]


def format_table(rows: list) -> str:
    """The before/after table of a rebuild: one line per (workflow, node)."""
    head = ["workflow", "node", "runs", "steps", "tau", "tok/call", "before", "budget", "calib", "temp",
            "after", "budget", "calib", "temp", "event"]
    lines = [head]
    for r in rows:
        s = r.stats
        after = f"{r.trial}(trial)" if r.trial else r.after
        lines.append([r.workflow, r.node, str(s.get("runs", "")), str(s["steps"]), f"{s['tau']:.2f}",
                      f"{s['tokens_per_call']:.1f}", *_policy_cells(r.before, r.old),
                      *_policy_cells(after, r.new), r.event])
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)


def from_log(args: argparse.Namespace) -> int:
    """``tune --from-log``: recount every node's acceptance from the stored runs; publish what moved."""
    from elesium.cli.errors import CliError
    from elesium.graphs.calibration import NodeCalibrator
    from elesium.graphs.registry import UnknownWorkflowError
    from elesium.graphs.workflows import default_registry
    from elesium.state.acceptance_log import AcceptanceLog, Retention
    from elesium.state.calibrations import CalibrationStore
    from elesium.state.connection import default_url
    from elesium.state.runs import RunRegistry, RunStatus

    if args.workflow is not None:
        try:
            default_registry().get(args.workflow)
        except UnknownWorkflowError as exc:
            raise CliError(str(exc)) from None
    url = default_url(settings_from_args(args))
    runs = RunRegistry.from_url(url, prefix=f"{args.prefix}:runs")
    log = AcceptanceLog.from_url(url, prefix=f"{args.prefix}:acc", retention=Retention(maxlen=None))
    calibrator = NodeCalibrator(CalibrationStore.from_url(url, prefix=f"{args.prefix}:calib"), log, runs=runs)
    by_workflow: dict[str, list[str]] = {}
    for record in runs.list_by_status(RunStatus.SUCCEEDED, limit=1_000_000):
        if args.workflow is None or record.workflow == args.workflow:
            by_workflow.setdefault(record.workflow, []).append(record.run_id)
    if not by_workflow:
        which = f" of {args.workflow}" if args.workflow else ""
        print(f"no succeeded runs{which} in the log; nothing to tune")
        return 0
    rows = []
    for workflow in sorted(by_workflow):
        for row in calibrator.rebuild(workflow, sorted(by_workflow[workflow]), adopt=args.adopt):
            row.stats["runs"] = calibrator.store.folded_runs(workflow, row.node)
            rows.append(row)
    print(format_table(rows))
    adopted = sum(r.event == "adopted" for r in rows)
    trials = sum(r.event == "trial" for r in rows)
    if args.adopt:
        print(f"{adopted} of {len(rows)} node calibrations changed (new versions published); "
              "runs started from now on use the 'after' column")
    else:
        print(f"{trials} of {len(rows)} node calibrations on trial: new runs alternate between the trial "
              "version and the 'before' one until the trial is decided (--adopt publishes at once)")
    return 0
