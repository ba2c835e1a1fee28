"""What prompt work costs per token on this CPU, and whether batching prompts of many runs would cut it.

Why: a ticket-triage run is mostly prompt work (prefills and ``hidden_states`` forwards, 73 % of the step
loop's time one run at a time, BENCHMARKS §17c), and batching only pays where a forward's cost grows
slower than its rows. This measures, on the default engine's weights (``Engine.load()``: the GGUF's 4-bit
blocks through torch's int4 CPU kernel):

* the four matmuls of every layer (30 layers' Q|K|V, O, gate|up, down) at 1, 8, 64 and 256 rows, through
  the int4 kernel and through dense bfloat16 weights of the same shapes (``F.linear``, and oneDNN with
  the weights packed ahead, ``mkldnn._linear_pointwise``): ms per call and per row;
* one 64-token prefill block (the eager prefill's unit) through the engine's forward, int4 layers against
  the same layers dequantised to dense bfloat16 and float32, with the largest log-probability difference
  at the block's positions (the dense copies are not the int4 path's bits).

Medians of repeated calls in one process, interleaved by configuration.

    .venv/bin/python benchmarks/prefill_rows.py --out benchmarks/serving/prefill_rows.json
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving import git, machine  # noqa: E402

from elesium.inference.engine import Engine  # noqa: E402
from elesium.inference.runtime.cpu_weights import GROUP, CastLinear, Int4GroupLinear  # noqa: E402
from elesium.inference.runtime.model import Transformer  # noqa: E402

LINEARS = (("attn", "wqkv"), ("attn", "wo"), ("", "w13"), ("", "w2"))


def median_s(fn: Callable[[], Any], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def layers_of(model: Transformer) -> list[Int4GroupLinear]:
    out = []
    for layer in model.layers:
        for owner, name in LINEARS:
            out.append(getattr(getattr(layer, owner) if owner else layer, name))
    return out


def dequantised(mod: Int4GroupLinear) -> torch.Tensor:
    """The weights the int4 kernel multiplies by, ``[N, K]`` bfloat16: the kernel applied to the identity."""
    eye = torch.eye(mod.in_features, dtype=torch.bfloat16)
    flat = eye.repeat(1, mod.repeat) if mod.repeat > 1 else eye
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, mod.packed, GROUP, mod.scales_zeros)
    return out.T.contiguous()


def dense_twin(model: Transformer, dtype: torch.dtype) -> Transformer:
    """The model with its int4 layers replaced by dense copies; every other tensor shared."""
    memo: dict[int, Any] = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    twin = copy.deepcopy(model, memo)
    for layer in twin.layers:
        for owner, name in LINEARS:
            holder = getattr(layer, owner) if owner else layer
            setattr(holder, name, CastLinear(dequantised(getattr(holder, name)).to(dtype), dtype))
    return twin


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/serving/prefill_rows.json"))
    args = parser.parse_args()
    engine = Engine.load()
    model = engine.model
    int4 = layers_of(model)
    dense = [dequantised(m) for m in int4]
    packed: dict[int, list[torch.Tensor]] = {}
    matmuls = []
    for rows in (1, 8, 64, 256):
        xs = {k: torch.randn(rows, k) for k in {m.in_features for m in int4}}
        xb = {k: x.bfloat16() for k, x in xs.items()}
        packed[rows] = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in dense]
        runs = {
            "int4 kernel": lambda: [m(xs[m.in_features]) for m in int4],
            "bf16 F.linear": lambda: [torch.nn.functional.linear(xb[w.shape[1]], w) for w in dense],
            "bf16 oneDNN packed": lambda rows=rows: [
                torch.ops.mkldnn._linear_pointwise(xb[w.shape[1]], p, None, "none", [], "")
                for w, p in zip(dense, packed[rows], strict=True)],
        }
        for name, fn in runs.items():
            s = median_s(fn, args.reps)
            matmuls.append({"rows": rows, "path": name, "ms": s * 1e3, "ms_per_row": s * 1e3 / rows})
            print(f"{rows:4d} rows  {name:20s} {s * 1e3:8.2f} ms  {s * 1e3 / rows:7.3f} ms/row", flush=True)
    ids = engine.encode_prompt("Summarise the incident: the billing service returned 503 errors for twenty "
                               "minutes after the deploy, and refunds queued until the rollback. " * 3)[:64]
    cache = model.new_cache(128)
    tokens, positions = torch.tensor([ids]), torch.arange(len(ids))
    blocks = []
    with torch.inference_mode():
        base = model(tokens, positions, cache, 0)[0]
        base_lp = torch.log_softmax(model.logits(base).float(), -1)
        for name, net in (("int4 kernel", model), ("dense bf16", dense_twin(model, torch.bfloat16)),
                          ("dense float32", dense_twin(model, torch.float32))):
            s = median_s(lambda net=net: net(tokens, positions, cache, 0), args.reps)
            lp = torch.log_softmax(model.logits(net(tokens, positions, cache, 0)[0]).float(), -1)
            diff = float((lp - base_lp).abs().max())
            blocks.append({"path": name, "block_ms": s * 1e3, "max_abs_logprob_diff_vs_int4": diff})
            print(f"64-token block  {name:14s} {s * 1e3:7.1f} ms  max |d log p| vs int4 {diff:.3f}",
                  flush=True)
    report = {"benchmark": "prefill_rows", "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "git_commit": git("rev-parse", "--short", "HEAD"), "machine": machine(), "reps": args.reps,
              "matmuls_all_layers": matmuls, "prefill_block_64": blocks}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
