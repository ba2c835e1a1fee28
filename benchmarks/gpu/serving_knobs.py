"""CUDA serving at steady state under the step loop's host-side knobs, side by side in one process.

Why: at 32 concurrent the loop's batched step costs ~2.0 ms for ~29 rows against ~1.37 ms of GPU work
(BENCHMARKS §19, §21), and each consumer's wake-up is a thread switch under the GIL. ``LOOKAHEAD`` (tokens
decoded before a consumer asks), ``WAKE_EVERY`` (tokens that wake a waiting consumer) and
``CUDA_PREFILL_FACTOR`` (prompt blocks per iteration while others decode) trade host work for latency, and
``CHAIN_STEPS`` (greedy steps per graph replay, fed back on the device) cuts the host work per token.
This loads the engine once and runs each setting at 32 and 64 concurrent, 256 requests a level, in
interleaved repetitions (A B C A B C), and reports each setting's median tokens/s beside the engine's
own concurrency-1 rate measured in the same process.

Usage (device): ``ELESIUM_MAX_BATCH=64 python3 -P benchmarks/gpu/serving_knobs.py PROMPTS OUT.json``
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import serving  # noqa: E402  (benchmarks/serving.py: the same requests and summaries)

from elesium.inference import batcher as batcher_module  # noqa: E402
from elesium.inference.engine import Engine  # noqa: E402

SETTINGS = [  # (LOOKAHEAD, WAKE_EVERY, CUDA_PREFILL_FACTOR, CHAIN_STEPS, consecutive prompt blocks together)
    (8, 4, 8, 1, False),  # the code of BENCHMARKS §21
    (8, 4, 8, 1, True),
    (8, 4, 8, 4, True),
    (16, 8, 8, 8, True),  # shipped after this run (BENCHMARKS §23)
]
LEVELS = (32, 64)
REQUESTS = 256
REPS = 2


def main() -> int:
    prompts = serving.load_prompts(Path(sys.argv[1]))
    out = Path(sys.argv[2])
    engine = Engine.load(device="cuda")
    engine.warm_up()
    batcher = engine.batcher
    assert batcher is not None, "set ELESIUM_MAX_BATCH: CUDA batches only when asked"
    serving.warm_up(engine, [1, 8], 16, "vanilla")

    def level(c: int, n: int) -> dict[str, Any]:
        before = serving.loop_counters(engine)
        wall, results = serving.run_level(engine, prompts, c, n, 128, 0.0, 0, "vanilla")
        summary = serving.summarize(c, wall, results)
        summary["step_loop"] = serving.loop_delta(before, serving.loop_counters(engine))
        return summary

    step = batcher._step
    assert step is not None and hasattr(step, "decode_greedy")
    for chain in {s[3] for s in SETTINGS if s[3] > 1}:  # captured now, not inside a timed level
        for bucket in step.buckets:
            step._decode_graph(bucket, chain, 0)
    solos = {}
    for chain in (1, 4):
        batcher.chain_steps = chain
        solos[chain] = level(1, 64)
        rate = solos[chain]["aggregate_tokens_per_s"]
        print(f"concurrency 1, chain {chain}: {rate:.0f} tok/s", file=sys.stderr)
    solo = solos[1]  # the baseline: one sequence, one step per replay
    runs: list[dict[str, Any]] = []
    for rep in range(REPS):
        for lookahead, wake, prefill, chain, consecutive in SETTINGS:
            batcher.lookahead = lookahead
            batcher.chain_steps = chain
            batcher.consecutive_blocks = consecutive
            batcher_module.WAKE_EVERY = wake
            batcher_module.CUDA_PREFILL_FACTOR = prefill
            for c in LEVELS:
                lv = level(c, REQUESTS)
                knobs = {"lookahead": lookahead, "wake_every": wake, "prefill_factor": prefill,
                         "chain": chain, "consecutive_blocks": consecutive}
                runs.append({"rep": rep, **knobs, **lv})
                print(f"rep {rep} lookahead {lookahead} wake {wake} prefill {prefill} chain {chain} "
                      f"consecutive {consecutive} c {c}: "
                      f"{lv['aggregate_tokens_per_s']:.0f} tok/s, ITL p99 {1e3 * lv['itl_s']['p99']:.1f} ms, "
                      f"ms/step {lv['step_loop'].get('ms_per_batched_step', 0):.2f}", file=sys.stderr)
    table = []
    for lookahead, wake, prefill, chain, consecutive in SETTINGS:
        for c in LEVELS:
            key = (lookahead, wake, prefill, chain, consecutive, c)
            mine = [r for r in runs if (r["lookahead"], r["wake_every"], r["prefill_factor"], r["chain"],
                                        r["consecutive_blocks"], r["concurrency"]) == key]
            rate = statistics.median(r["aggregate_tokens_per_s"] for r in mine)
            table.append({"lookahead": lookahead, "wake_every": wake, "prefill_factor": prefill,
                          "chain": chain, "consecutive_blocks": consecutive,
                          "concurrency": c, "median_tokens_per_s": rate,
                          "x_concurrency_1": rate / solo["aggregate_tokens_per_s"],
                          "itl_p99_ms": statistics.median(1e3 * r["itl_s"]["p99"] for r in mine),
                          "ttft_p50_ms": statistics.median(1e3 * r["ttft_s"]["p50"] for r in mine)})
            print(json.dumps(table[-1]))
    out.write_text(json.dumps({"date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                               "engine": engine.describe(), "solo": solo,
                               "solo_by_chain": solos, "table": table, "runs": runs},
                              indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
