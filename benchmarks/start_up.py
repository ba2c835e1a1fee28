"""A fresh process's first generation: how long until it decodes at full speed (issue 38, item 5).

Why: a one-shot ``elesium generate`` or a new queue worker used to trace the CPU step's graphs inside its
first request (~10 s a graph with inductor's cache warm, a minute or more cold). Saved graphs
(``inference/runtime/precompiled.py``) are loaded while the engine loads instead. Each measurement is
a new Python process that imports elesium, runs ``Engine.load()`` (default configuration), streams a
128-token greedy vanilla generation, then a 32-token speculative one (the tree graph, which a vanilla
default does not load ahead). Three kinds of start, each in its own cache directory (the packed 4-bit
weights are copied in, so weight packing is not what is measured):

* ``cold``: nothing compiled; the graphs are compiled and saved.
* ``traced``: inductor's cache warm, saved graphs not used (how every start worked before: dynamo traces
  each graph again, inductor's cache supplies the code).
* ``saved``: the graphs saved by an earlier process.

``traced`` and ``saved`` alternate ``--repeats`` times; medians are reported. Per run: import and load
time, time to the first token after load, the 128 tokens' wall time, the steady inter-token time (median
of the last 64 gaps), the stall (wall time minus 128 steady gaps), and the first speculative
generation's wall time, and then ``Engine.warm_up()``'s (what ``elesium serve`` adds before its first
request once the two single-sequence graphs are in: the batched graph).

    .venv/bin/python benchmarks/start_up.py --out benchmarks/start_up/start_up.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving import git, machine  # noqa: E402  (the serving benchmark's machine block)

PROMPT = "Write a short note to a colleague about tomorrow's release."
CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import elesium.inference.engine as engine_module
from elesium.inference.sampling import SamplingParams
if sys.argv[1] == "traced":  # the engine as it was: no store, every graph traced in this process
    engine_module.PrecompileStore = lambda *args, **kwargs: None
imported = time.perf_counter()
engine = engine_module.Engine.load()
loaded = time.perf_counter()
marks = []
stream = engine.stream(sys.argv[2], SamplingParams(max_tokens=128, temperature=0.0), mode="vanilla")
for _ in stream:
    marks.append(time.perf_counter())
gaps = [b - a for a, b in zip(marks, marks[1:])]
steady = sorted(gaps[-64:])[32]
spec_start = time.perf_counter()
spec = engine.generate(sys.argv[2], SamplingParams(max_tokens=32, temperature=0.0), mode="speculative")
spec_s = time.perf_counter() - spec_start
warm_up_s = engine.warm_up()  # what `elesium serve` adds before its first request: the batched graph
print(json.dumps({"import_s": imported - t0, "load_s": loaded - imported,
                  "first_token_after_load_s": marks[0] - loaded, "tokens": len(marks),
                  "generation_s": marks[-1] - loaded, "steady_ms": steady * 1e3,
                  "stall_s": marks[-1] - loaded - len(marks) * steady,
                  "first_speculative_s": spec_s, "speculative_tokens": len(spec.token_ids),
                  "serve_warm_up_s": warm_up_s,
                  "graphs_loaded": [n for n, g in engine.runner.graphs.items() if g.loaded]}))
"""


def run_child(kind: str, cache: Path) -> dict[str, Any]:
    env = dict(os.environ, ELESIUM_CACHE_DIR=str(cache))
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)  # the engine's own place under the cache dir
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", CHILD, kind, PROMPT], capture_output=True, text=True,
                          env=env, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{kind} start failed: {done.stderr[-2000:]}")
    row: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    row["kind"], row["process_wall_s"] = kind, time.perf_counter() - started
    print(f"{kind:7s} load {row['load_s']:5.1f} s  first token +{row['first_token_after_load_s']:.2f} s  "
          f"128 tokens {row['generation_s']:6.2f} s (steady {row['steady_ms']:.1f} ms, stall "
          f"{row['stall_s']:5.2f} s)  first speculative {row['first_speculative_s']:6.2f} s  "
          f"serve's warm-up {row['serve_warm_up_s']:6.2f} s  "
          f"loaded {row['graphs_loaded']}", flush=True)
    return row


def fresh_cache(weights_from: Path, root: Path, name: str) -> Path:
    cache = root / name
    cache.mkdir()
    for part in ("cpu-weights", "weights", "hashes"):
        if (weights_from / part).exists():
            shutil.copytree(weights_from / part, cache / part)
    return cache


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="traced/saved pairs (default 3)")
    parser.add_argument("--weights-from", type=Path, help="a cache dir holding the packed weights",
                        default=Path(os.environ.get("ELESIUM_CACHE_DIR", Path.home() / ".cache" / "elesium")))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/start_up/start_up.json"))
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="elesium-start-up-"))
    try:
        shared = fresh_cache(args.weights_from, root, "shared")
        rows = [run_child("cold", shared)]  # compiles and saves; later runs share its caches
        for _ in range(args.repeats):
            rows += [run_child("traced", shared), run_child("saved", shared)]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    keys = ("load_s", "first_token_after_load_s", "generation_s", "steady_ms", "stall_s",
            "first_speculative_s", "serve_warm_up_s", "process_wall_s")
    summary = {kind: {k: statistics.median(r[k] for r in rows if r["kind"] == kind) for k in keys}
               for kind in ("cold", "traced", "saved")}
    report = {"benchmark": "start_up", "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "git_commit": git("rev-parse", "--short", "HEAD"),
              "git_dirty": bool(git("status", "--porcelain")),
              "machine": machine(), "prompt": PROMPT, "summary": summary, "runs": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return 0
    fig, ax = plt.subplots(figsize=(7, 4))
    kinds = ["cold", "traced", "saved"]
    parts = [("load_s", "Engine.load"), ("generation_s", "128 tokens"), ("first_speculative_s", "first tree")]
    bottom = [0.0] * len(kinds)
    for key, label in parts:
        values = [summary[k][key] for k in kinds]
        ax.bar(kinds, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_ylabel("seconds (median)")
    ax.set_title("a fresh process: load, first 128 tokens, first speculative generation")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=120)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
