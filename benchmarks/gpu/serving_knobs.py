"""CUDA serving at steady state under the step loop's host-side knobs, side by side in one process.

Why: at 32 concurrent the loop's batched step costs ~2.0 ms for ~29 rows against ~1.37 ms of GPU work
(BENCHMARKS §19, §21), and each consumer's wake-up is a thread switch under the GIL. ``LOOKAHEAD`` (tokens
decoded before a consumer asks), ``WAKE_EVERY`` (tokens that wake a waiting consumer) and
``CUDA_PREFILL_FACTOR`` (prompt blocks per iteration while others decode) trade host work for latency, and
``CHAIN_STEPS`` (greedy steps per graph replay, fed back on the device) cuts the host work per token, and
``fold_prefill`` has newcomers' prompt blocks ride in the decode step's forward, and ``join_early`` has
newcomers pick their first token before the step and join it, and ``defer_wakes`` wakes the consumers an
iteration finished when the next step is launched (their Python then runs while the GPU works), and
``switch_ms`` is the interpreter's switch interval (``sys.setswitchinterval``; CPython's default is 5 ms), and
``overlap`` launches a greedy batch's next chain before the last one's tokens are handed out, and
``prefill_early`` launches the prompts that arrived during a chain before its tokens are handed out.
This loads the engine once and runs each setting at 32 and 64 concurrent, 256 requests a level, in
interleaved repetitions (A B C A B C), and reports each setting's median tokens/s beside the engine's
own concurrency-1 rate measured in the same process.

Usage (device): ``ELESIUM_MAX_BATCH=64 python3 -P benchmarks/gpu/serving_knobs.py PROMPTS OUT.json``
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import serving  # noqa: E402  (benchmarks/serving.py: the same requests and summaries)

from elesium.inference import batcher as batcher_module  # noqa: E402
from elesium.inference.engine import Engine  # noqa: E402

KNOBS = ("lookahead", "wake_every", "prefill_factor", "chain", "consecutive_blocks", "fold_prefill",
         "join_early", "defer_wakes", "switch_ms", "overlap", "prefill_early")
SETTINGS = [  # LOOKAHEAD, WAKE_EVERY, CUDA_PREFILL_FACTOR, CHAIN_STEPS, consecutive blocks, blocks on steps,
    # newcomers' first tokens before the step (joining it), wakes held to the next launch, switch interval,
    # the next chain launched before the last one's tokens are handed out, arrivals' prefill launched then
    (16, 8, 8, 8, True, False, False, False, 5.0, False, False),  # the defaults of BENCHMARKS §23
    (16, 8, 8, 8, True, True, False, False, 5.0, False, False),
    (16, 8, 16, 8, True, True, False, False, 5.0, False, False),
    (8, 4, 8, 4, True, True, False, False, 5.0, False, False),
    (16, 8, 8, 8, True, False, True, False, 5.0, False, False),  # §27
    (16, 8, 8, 8, True, False, True, True, 5.0, False, False),  # §29
    (16, 8, 8, 8, True, False, True, True, 0.5, False, False),
    (16, 8, 8, 8, True, True, False, True, 5.0, False, False),  # blocks riding in the step, with wakes held
    (32, 16, 8, 16, True, False, True, True, 5.0, False, False),  # longer chains
    (16, 8, 8, 8, True, False, True, True, 5.0, True, False),  # §30: chains overlapped with the host's work
    (8, 4, 8, 4, True, False, True, True, 5.0, True, False),  # the same with chains of 4
    (8, 4, 8, 4, True, False, True, True, 5.0, False, False),  # chains of 4, not overlapped
    (24, 8, 8, 8, True, False, True, True, 5.0, True, False),  # overlapped, a chain more of lookahead
    (16, 8, 8, 8, True, False, True, True, 5.0, False, True),  # §31: §29's with arrivals prefilled early
    (8, 4, 8, 4, True, False, True, True, 5.0, False, True),  # the same with chains of 4
]
LEVELS = (32, 64)
REQUESTS = 256
REPS = int(os.environ.get("KNOB_REPS", "2"))
if os.environ.get("KNOB_SETTINGS"):  # e.g. "0,1": a subset of SETTINGS, by index
    SETTINGS = [SETTINGS[int(i)] for i in os.environ["KNOB_SETTINGS"].split(",")]


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
    assert step is not None and hasattr(step, "decode_rows")
    for chain in {s[3] for s in SETTINGS}:  # captured now, not inside a timed level
        for held in (0, 1, 2, 4, 8):
            for bucket in step.buckets:
                step._decode_graph(bucket, chain, held)
    solos = {}
    for chain in (1, 4):
        batcher.chain_steps = chain
        solos[chain] = level(1, 64)
        rate = solos[chain]["aggregate_tokens_per_s"]
        print(f"concurrency 1, chain {chain}: {rate:.0f} tok/s", file=sys.stderr)
    solo = solos[1]  # the baseline: one sequence, one step per replay
    runs: list[dict[str, Any]] = []
    for rep in range(REPS):
        for setting in SETTINGS:
            knobs = dict(zip(KNOBS, setting, strict=True))
            batcher.lookahead = knobs["lookahead"]
            batcher.chain_steps = knobs["chain"]
            batcher.consecutive_blocks = knobs["consecutive_blocks"]
            batcher.fold_prefill = knobs["fold_prefill"]
            batcher.join_early = knobs["join_early"]
            batcher.defer_wakes = knobs["defer_wakes"]
            batcher.overlap = knobs["overlap"]
            batcher.prefill_early = knobs["prefill_early"]
            sys.setswitchinterval(knobs["switch_ms"] / 1000)
            batcher_module.WAKE_EVERY = knobs["wake_every"]
            batcher_module.CUDA_PREFILL_FACTOR = knobs["prefill_factor"]
            for c in LEVELS:
                lv = level(c, REQUESTS)
                runs.append({"rep": rep, **knobs, **lv})
                loop = lv["step_loop"]
                busy = {k[5:-2]: round(v, 2) for k, v in loop.items() if k.startswith("busy_")}
                print(f"rep {rep} {knobs} c {c}: {lv['aggregate_tokens_per_s']:.0f} tok/s, TTFT p50 "
                      f"{1e3 * lv['ttft_s']['p50']:.0f} ms, ITL p99 {1e3 * lv['itl_s']['p99']:.1f} ms, "
                      f"ms/step {loop.get('ms_per_batched_step', 0):.2f}, loop s {busy}", file=sys.stderr)
    table = []
    for setting in SETTINGS:
        knobs = dict(zip(KNOBS, setting, strict=True))
        for c in LEVELS:
            mine = [r for r in runs if all(r[k] == v for k, v in knobs.items()) and r["concurrency"] == c]
            rate = statistics.median(r["aggregate_tokens_per_s"] for r in mine)
            table.append({**knobs, "concurrency": c, "median_tokens_per_s": rate,
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
