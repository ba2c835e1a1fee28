"""Per-run latency of the shipped workflows against an earlier version of them, side by side.

Why: redesigning a workflow for right answers must not make it slow (issue: no worse than 1.3x). The
earlier version's workflow modules are read from git (``--baseline REV``), imported under other names
and registered beside the current ones; both run on one engine, in one process, alternating run by
run over the same dev-split inputs (interrupts answered with each row's ``resume``), so machine noise
hits both alike. Reports the median wall time per run of each and their ratio, and writes JSON and a
PNG.

    .venv/bin/python benchmarks/workflow_latency.py --baseline 1d350e0 --limit 20 --out benchmarks/evals
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from elesium.graphs.registry import Registry
from elesium.graphs.runner import WorkflowRunner
from elesium.graphs.workflows import shipped
from elesium.inference.engine import Engine

ROOT = Path(__file__).resolve().parent.parent
MODULES = {"ticket-triage": "ticket_triage", "expense-approval": "expense_approval",
           "incident-summary": "incident_summary"}


def baseline_workflows(rev: str, tmp: Path) -> dict[str, Any]:
    """The workflows as they were at ``rev``, each renamed ``<name>@<rev>``."""
    out = {}
    for name, module in MODULES.items():
        source = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:graphs/workflows/{module}.py"],
                                check=True, capture_output=True, text=True).stdout
        path = tmp / f"baseline_{module}.py"
        path.write_text(source)
        spec = importlib.util.spec_from_file_location(f"baseline_{module}", path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        wf = mod.workflow()
        out[name] = type(wf).define(f"{name}@{rev}", wf.factory, wf.input_model, description=wf.description,
                                    resume_model=wf.resume_model)
    return out


def timed_run(runner: WorkflowRunner, workflow: Any, row: dict[str, Any], seed: int) -> float:
    start = time.perf_counter()
    result = runner.start(workflow, row["input"], seed=seed)
    for _ in range(5):
        if result.status != "interrupted" or "resume" not in row:
            break
        result = runner.resume(result.run_id, row["resume"])
    if result.status == "failed":
        raise RuntimeError(f"{workflow.name} failed on {row['id']}: {result.error}")
    return time.perf_counter() - start


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--baseline", default="1d350e0", help="git revision of the earlier workflows")
    p.add_argument("--limit", type=int, default=20, help="dev rows per workflow")
    p.add_argument("--out", type=Path, default=Path("bench-out"))
    args = p.parse_args()
    engine = Engine.load()
    registry = Registry()
    with tempfile.TemporaryDirectory() as tmp:
        old = baseline_workflows(args.baseline, Path(tmp))
        new = {wf.name: wf for wf in shipped()}
        for wf in [*old.values(), *new.values()]:
            registry.register(wf)
        runner = WorkflowRunner(engine, registry=registry, prefix="bench-workflow-latency")
        report: dict[str, Any] = {"baseline": args.baseline, "engine": engine.describe(), "workflows": {}}
        for name, module in MODULES.items():
            rows = [json.loads(line) for line in (ROOT / "graphs/workflows/evals" / f"{module}.jsonl")
                    .read_text().splitlines() if line.strip()]
            rows = [r for r in rows if r["split"] == "dev"][: args.limit]
            timed_run(runner, old[name], rows[0], 0)  # warm both paths (compiles, grammars)
            timed_run(runner, new[name], rows[0], 0)
            times: dict[str, list[float]] = {"baseline": [], "current": []}
            for i, row in enumerate(rows):
                order = (("baseline", old[name]), ("current", new[name]))
                for label, wf in order if i % 2 == 0 else order[::-1]:
                    times[label].append(timed_run(runner, wf, row, i + 1))
            med = {k: statistics.median(v) for k, v in times.items()}
            ratios = [c / b for b, c in zip(times["baseline"], times["current"], strict=True)]
            report["workflows"][name] = {"runs": len(rows), "median_s": med,
                                         "ratio_median": statistics.median(ratios), "times_s": times}
            print(f"{name}: baseline {med['baseline']:.3f} s, current {med['current']:.3f} s per run "
                  f"(median ratio {statistics.median(ratios):.2f}x, {len(rows)} runs each)")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "workflow-latency.json").write_text(json.dumps(report, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["workflows"])
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for k, label in enumerate(("baseline", "current")):
        ax.bar([i + 0.38 * k for i in range(len(names))],
               [report["workflows"][n]["median_s"][label] for n in names], width=0.38,
               label=f"{label} ({args.baseline})" if label == "baseline" else label)
    ax.set_xticks([i + 0.19 for i in range(len(names))], names)
    ax.set_ylabel("median s per run")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out / "workflow-latency.png", dpi=120)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
