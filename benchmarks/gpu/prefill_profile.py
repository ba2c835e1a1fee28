"""Where a batched CUDA prefill forward's time goes (on the GPU machine).

Why: at 32 concurrent the serving loop spent 1.29 s of 3.7 s in prefill forwards (BENCHMARKS §25), about
13 ms a forward of 8 prompt blocks (512 tokens), against 1.8 ms for a 32-row decode step; and riding the
blocks on decode steps saved no time, so the cost grows with the blocks' tokens, not with launches. This
times ``BatchedCudaStep.prefill`` per block count and prefix length beside the decode step, one layer's
attention over prompt blocks through the per-node and the causal kernel, and profiles one eager prefill
forward with each, kernel by kernel.

    python3 -P benchmarks/gpu/prefill_profile.py PROMPTS OUT.json   # ELESIUM_MODEL points at the GGUF
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # python3 -P leaves the script's folder out

import serving  # noqa: E402  (benchmarks/serving.py: the prompts)
from batched_step_device import _median_s as median_s  # noqa: E402  (warm-up, sync, median)

from elesium.config import Settings  # noqa: E402
from elesium.inference.engine import Engine  # noqa: E402
from elesium.inference.runtime.batched_cuda_step import pool_forward_groups  # noqa: E402
from elesium.kernels.ragged_attention import ragged_causal_attention, ragged_tree_attention  # noqa: E402


def _median_ms(fn: Any) -> float:
    return 1e3 * median_s(fn, 30)


def _kernels(fn: Any, top: int = 14) -> list[dict[str, Any]]:
    """Each kernel's total GPU time over one call of ``fn`` (eager), the costliest first."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return _by_kernel(prof, top)


def _by_kernel(prof: profile, top: int) -> list[dict[str, Any]]:
    """The profile's kernels with their total GPU time, the costliest ``top`` first."""
    rows = [{"kernel": e.key[:90], "calls": e.count, "gpu_ms": e.device_time_total / 1e3}
            for e in prof.key_averages() if e.device_time_total > 0]
    rows.sort(key=lambda r: -r["gpu_ms"])
    return rows[:top]


def _attention(engine: Engine, pool: Any, chunk: int) -> list[dict[str, Any]]:
    """One layer's attention over 8 prompt blocks of ``chunk`` tokens, the per-node kernel against the
    causal one, at three prefix lengths (random queries; the pool's first layer as the keys)."""
    c = engine.model.config
    k_layer, v_layer = pool.k[:, 0, 0], pool.v[:, 0, 0]
    dev, blocks = k_layer.device, 8
    q = torch.randn(c.num_heads, blocks * chunk, c.head_dim, device=dev, dtype=k_layer.dtype)
    slots = torch.arange(blocks, device=dev)
    node_seq = slots.repeat_interleave(chunk)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=dev).tril().repeat(blocks, 1)
    rows = []
    for offset in (0, 256, 1024):
        prefix = torch.full((blocks,), offset, device=dev)
        per_node = _median_ms(lambda p=prefix: ragged_tree_attention(q, k_layer, v_layer, slots, p, node_seq,
                                                                     causal))
        shared = _median_ms(lambda p=prefix: ragged_causal_attention(q, k_layer, v_layer, slots, p))
        rows.append({"blocks": blocks, "prefix": offset, "per_node_ms": per_node, "causal_ms": shared})
        print(f"attention, 8 blocks after {offset}: per node {per_node:.3f} ms, causal {shared:.3f} ms "
              f"({per_node / shared:.2f}x)", flush=True)
    return rows


def main() -> int:
    prompts = serving.load_prompts(Path(sys.argv[1]))
    out = Path(sys.argv[2])
    engine = Engine.load(device="cuda", dtype="bfloat16",
                         settings=Settings.from_env().with_overrides(max_batch="64"))
    batcher = engine.batcher
    assert batcher is not None
    batcher.warm_up()
    step, pool = batcher._step, batcher.pool
    assert step is not None
    lengths = sorted(len(engine.encode_prompt(p)) for p in prompts)
    chunk = step.block
    per_prompt = sum(-(-n // chunk) for n in lengths) / len(lengths)
    print(f"prompt tokens: median {statistics.median(lengths)}, p90 {lengths[9 * len(lengths) // 10]}, "
          f"blocks of {chunk}: {per_prompt:.2f} a prompt", flush=True)
    ids = engine.encode_prompt(prompts[0] * 4)
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                              "prompt_tokens_median": statistics.median(lengths), "block": chunk,
                              "prefill": [], "decode": []}
    for b in (1, 2, 4, 8):
        for offset in (0, 256):
            blocks = [(slot, ids[:chunk], offset) for slot in range(b)]
            ms = _median_ms(lambda blocks=blocks: step.prefill(blocks))
            report["prefill"].append({"blocks": b, "offset": offset, "ms": ms})
            print(f"prefill {b} blocks from {offset}: {ms:.2f} ms", flush=True)
    for rows in (1, 8, 32):
        slots = list(range(rows))
        for slot in slots:
            pool.reserve(slot, 600)
        ms = _median_ms(lambda slots=slots: step.decode([ids[0]] * len(slots), [300] * len(slots), slots))
        riding = _median_ms(lambda slots=slots: step.decode_rows(
            [ids[0]] * len(slots), [300] * len(slots), slots, 1, [(40, ids[:chunk], 0)] * 4))
        report["decode"].append({"rows": rows, "ms": ms, "with_4_blocks_ms": riding})
        print(f"decode {rows} rows: {ms:.2f} ms, with 4 blocks riding {riding:.2f} ms", flush=True)
    report["attention"] = _attention(engine, pool, chunk)
    # Eager forwards, kernel by kernel: prompt blocks through the causal kernel (the default) and through
    # the per-node kernel it replaced.
    staging = torch.zeros(step._prefill_size(8), dtype=torch.long)
    step._prefill_staging([(slot, ids[:chunk], 256) for slot in range(8)], 8, staging)
    group = step._prefill_group(staging.to(step.model.device), 8)
    for name, g in (("prefill_8_blocks_kernels", group), ("prefill_8_blocks_kernels_per_node",
                                                          group._replace(causal=False))):
        with torch.inference_mode():
            report[name] = _kernels(lambda g=g: pool_forward_groups(step.model, [g], pool.k, pool.v))
        for row in report[name]:
            print(f"  {name[-8:]} {row['gpu_ms']:8.3f} ms {row['calls']:4d}x {row['kernel']}")
    # A serving level at 32 concurrent under the profiler: the GPU's busy time against the wall (graph
    # replays' kernels are traced one by one), so the loop's host gaps can be read off.
    serving.warm_up(engine, [1, 8], 16, "vanilla")
    fn = lambda: serving.run_level(engine, prompts, 32, 128, 128, 0.0, 0, "vanilla")  # noqa: E731
    fn()
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            started = time.perf_counter()
            _, results = fn()
            torch.cuda.synchronize()
            wall = time.perf_counter() - started
    except Exception as exc:  # the profiler and graph replays: report, keep the figures above
        print(f"serving profile failed: {exc!r}", flush=True)
        out.write_text(json.dumps(report, indent=1) + "\n")
        return 1
    kernels = _by_kernel(prof, 10**9)
    busy = sum(r["gpu_ms"] for r in kernels) / 1e3
    tokens = sum(r.output_tokens for r in results if r.error is None)
    report["serving_32"] = {"wall_s": wall, "gpu_kernel_s": busy, "tokens": tokens, "kernels": kernels[:16]}
    print(f"serving at 32 (128 requests, profiled): wall {wall:.2f} s, GPU kernels {busy:.2f} s, "
          f"{tokens} tokens", flush=True)
    for row in report["serving_32"]["kernels"]:
        print(f"  serving {row['gpu_ms']:9.2f} ms {row['calls']:6d}x {row['kernel']}")
    print(json.dumps({k: v for k, v in report.items() if "kernels" not in k and k != "serving_32"}, indent=1))
    out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
