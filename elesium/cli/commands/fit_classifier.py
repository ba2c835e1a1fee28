"""``elesium fit-classifier WORKFLOW``: fit a workflow's probes and span pointers on its dev split.

Every ``classifier_node`` of the workflow gets a probe set (penalty chosen by cross-validation on the
dev rows only: the test split stays for reporting) and every ``span_node`` a pointer, fitted to the
dataset's ``expected[label_key]`` and written to the node's file. A refit changes the workflow's
version.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

from elesium.cli.commands.common import add_model_args, load_engine
from elesium.cli.errors import CliError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fit-classifier", help="fit a workflow's classifier probes on its dev split")
    p.add_argument("workflow", help="workflow name")
    p.add_argument("--dataset", type=Path, default=None,
                   help="evaluation JSONL (default: the workflow's shipped set)")
    p.add_argument("--split", default="dev", choices=["dev", "all"],
                   help="rows to fit on (default dev; never test)")
    p.add_argument("--node", action="append", default=None, help="only this node (repeatable)")
    add_model_args(p)
    p.set_defaults(handler=run)


def shipped_dataset(workflow: str) -> Path:
    from elesium.graphs.workflows import __file__ as workflows_init

    return Path(workflows_init).resolve().parent / "evals" / f"{workflow.replace('-', '_')}.jsonl"


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The dataset's rows; a malformed line is one error naming it."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise CliError(f"cannot read {path}: {exc.strerror}") from None
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise CliError(f"{path}:{n}: not JSON ({exc.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("input"), dict):
            raise CliError(f"{path}:{n}: a row needs an object 'input'")
        rows.append(row)
    return rows


def run(args: argparse.Namespace) -> int:
    from elesium.graphs.classifier import ClassifierNode, fit_node_probe
    from elesium.graphs.registry import UnknownWorkflowError
    from elesium.graphs.spans import SpanNode, fit_span_pointer
    from elesium.graphs.workflows import default_registry

    try:
        workflow = default_registry().get(args.workflow)
    except UnknownWorkflowError as exc:
        raise CliError(str(exc)) from None
    nodes = [spec.runnable for spec in workflow.factory().nodes.values()]
    nodes = [getattr(n, "func", n) for n in nodes]
    classifiers = [n for n in nodes if isinstance(n, (ClassifierNode, SpanNode))]
    if args.node:
        unknown = sorted(set(args.node) - {n.name for n in classifiers})
        if unknown:
            raise CliError(f"workflow {workflow.name!r} has no classifier node {unknown[0]!r} "
                           f"(it has: {', '.join(n.name for n in classifiers) or 'none'})")
        classifiers = [n for n in classifiers if n.name in args.node]
    if not classifiers:
        raise CliError(f"workflow {workflow.name!r} has no classifier or span nodes")
    path = args.dataset or shipped_dataset(workflow.name)
    rows = read_rows(path)
    if args.split == "dev":
        rows = [r for r in rows if r.get("split") == "dev"]
    if not rows:
        raise CliError(f"{path}: no {args.split} rows")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    engine = load_engine(args)
    weights = engine.describe().get("weights", "")
    for node in classifiers:
        meta = {"dataset": path.name, "dataset_sha256": digest, "split": args.split, "weights": weights}
        if isinstance(node, SpanNode):
            pointer = fit_span_pointer(engine, node, rows, meta=meta)
            pointer.save(node.pointer_path)
            print(f"{node.name}: span pointer on {pointer.meta['examples']} rows, layer {pointer.layer}, "
                  f"up to {pointer.max_words} words -> {node.pointer_path}", file=sys.stderr)
            continue
        probe = fit_node_probe(engine, node, rows, meta=meta)
        probe.save(node.probe_path)
        print(f"{node.name}: {probe.meta['examples']} rows, layers {list(probe.layers)}, "
              f"l2 {probe.meta['l2']}, cross-validated accuracy {probe.meta['cv_accuracy']:.3f} "
              f"-> {node.probe_path}",
              file=sys.stderr)
    return 0
