"""The batched CUDA decode step's cost per batch size, beside the one-sequence graphs (on the GPU machine).

Why: serving throughput on a GPU is bounded by what one step of B rows costs. This measures the step
alone (no scheduler, no threads): ``BatchedCudaStep.decode`` replaying the bucket graph for B rows of
B different sequences (contexts of 100 to 700 tokens), against the one-sequence paths in the same
process: the synchronous bucket-1 step graph and the self-feeding decode chain (``engine.generate``
in vanilla mode, one generation at a time, which is what an engine without batching serves).

    python3 -P benchmarks/gpu/batched_step_device.py OUT.json   # ELESIUM_MODEL points at the GGUF
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from elesium.config import Settings
from elesium.inference.engine import Engine
from elesium.inference.sampling import SamplingParams

SIZES = (1, 2, 4, 8, 16, 32, 64)
REPEATS = 50


def _median_s(fn, repeats: int = REPEATS) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main(out: str) -> None:
    settings = Settings.from_env().with_overrides(max_batch=str(max(SIZES)))
    engine = Engine.load(device="cuda", dtype="bfloat16", settings=settings)
    batcher = engine.batcher
    assert batcher is not None, "max_batch did not turn batching on"
    started = time.perf_counter()
    batcher.warm_up()
    warm_up_s = time.perf_counter() - started
    step, pool, runner = batcher._step, batcher.pool, engine.runner
    assert step is not None
    prompt = engine.encode_prompt("Write a long story about a lighthouse keeper and the sea.")
    # One-sequence paths on the engine's own cache.
    with torch.inference_mode():
        runner.prefill(prompt)
    n = len(prompt)
    one_graph_s = _median_s(lambda: runner.decode([prompt[-1]], [n], n))
    params = SamplingParams(max_tokens=256)
    engine.batcher = None
    chain_runs = []
    for _ in range(3):
        result = engine.generate(prompt, params, mode="vanilla")
        chain_runs.append(len(result.token_ids) / result.elapsed_s)
    engine.batcher = batcher
    rows = []
    for b in SIZES:
        slots = list(range(b))
        offsets = [100 + (600 * i) // max(1, b - 1) for i in range(b)]
        for slot, offset in zip(slots, offsets, strict=True):
            pool.reserve(slot, offset + 64)
        tokens = [prompt[i % n] for i in range(b)]
        t = _median_s(lambda tokens=tokens, offsets=offsets, slots=slots: step.decode(tokens, offsets, slots))
        rows.append({"rows": b, "step_ms": t * 1e3, "tokens_per_s": b / t})
        print(f"B={b:3d}  step {t * 1e3:7.3f} ms  {b / t:9.0f} tokens/s", flush=True)
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "warm_up_s": warm_up_s,
        "buckets": list(step.buckets),
        "one_sequence_graph_step_ms": one_graph_s * 1e3,
        "one_sequence_graph_tokens_per_s": 1 / one_graph_s,
        "decode_chain_tokens_per_s_runs": chain_runs,
        "decode_chain_tokens_per_s": statistics.median(chain_runs),
        "batched": rows,
    }
    print(json.dumps({k: v for k, v in report.items() if k != "batched"}, indent=1))
    with open(out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
