"""Speculative requests served together, with and without ``Batcher.plain_when_sharing``, side by side.

Why: a greedy speculative generation that shares the batch decodes as a row of the shared forward
(``inference/batcher.py``, ``PLAIN_WHEN_SHARING``); without that its tree steps run alone on its slot, and
heads with a drafting cache admit one tree at a time. This runs the same level (the default engine,
``benchmarks/serving.py``'s requests: 4 concurrent, 8 MT-Bench requests of 64 greedy tokens, speculative)
with the setting on and off in alternation, twice, in one process, and writes each run and the medians.

Usage: ``.venv/bin/python benchmarks/plain_when_sharing_ab.py OUT.json``
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import serving  # noqa: E402

from elesium.inference.engine import Engine  # noqa: E402

PROMPTS = Path(__file__).resolve().parents[1] / "tests" / "data" / "mt_bench_questions.jsonl"


def main() -> int:
    out = Path(sys.argv[1])
    prompts = serving.load_prompts(PROMPTS)
    engine = Engine.load()
    engine.warm_up()
    batcher = engine.batcher
    assert batcher is not None, "the default CPU engine batches"
    serving.warm_up(engine, [1, 2], 16, "speculative")
    runs: list[dict[str, Any]] = []
    for rep in range(2):
        for setting in (1, None):
            batcher.plain_when_sharing = setting
            wall, results = serving.run_level(engine, prompts, 4, 8, 64, 0.0, 0, "speculative")
            level = serving.summarize(4, wall, results)
            runs.append({"rep": rep, "plain_when_sharing": setting, "wall_s": wall, "errors": level["errors"],
                         "tokens_per_s": level["aggregate_tokens_per_s"], "ttft_s": level["ttft_s"],
                         "itl_s": level["itl_s"]})
            print(f"rep {rep} plain_when_sharing {setting}: {level['aggregate_tokens_per_s']:.1f} tok/s, "
                  f"TTFT p50 {level['ttft_s']['p50']:.2f} s", file=sys.stderr)
    on = statistics.median(r["tokens_per_s"] for r in runs if r["plain_when_sharing"])
    off = statistics.median(r["tokens_per_s"] for r in runs if not r["plain_when_sharing"])
    out.write_text(json.dumps({"date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                               "machine": serving.machine(), "engine": engine.describe(), "runs": runs,
                               "median_tokens_per_s_on": on, "median_tokens_per_s_off": off,
                               "on_over_off": on / off}, indent=1) + "\n")
    print(f"median on {on:.1f} tok/s, off {off:.1f} tok/s: {on / off:.2f}x; wrote {out}")
    return 0 if all(r["errors"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
