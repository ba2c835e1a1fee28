"""Taller matmul tiles for products of many rows: are a row's bits unchanged, and what do they save (GPU).

Why: the invariant matmul runs every weight with 16-row tiles (tuned for decode, M = 1..32), so a prefill
forward of 8 prompt blocks (512 rows) spent 2.3 ms of its ~3.6 ms in it on the H100 (BENCHMARKS §27), and a
prompt block riding on a decode step cost ~0.43 ms. Taller tiles for many-row products would be exact only
if a row's result does not depend on the tile
height, a property of the MMA instructions the compiler picks (mma.sync for 16 and 32 rows, wgmma for 64 on
Hopper). This checks it for every SmolLM2 weight shape, bf16, with and without bias, at several M and batch
offsets, against the rows computed alone, and times each tile height by CUDA-graph replay.

    python3 -P benchmarks/gpu/wide_tiles.py OUT.json
    python3 -P benchmarks/gpu/wide_tiles.py --sweep OUT.json   # whole configurations for many rows
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from elesium.kernels import invariant_matmul as im

HEIGHTS = (0, 32, 64, 128)  # 0: the table's 16-row tiles for every M
WIDE_ROWS = 64  # timed with the taller tiles from this many rows on, the table's below (as serving would)
CHECK_M = (64, 65, 100, 128, 200, 300, 512)
TIME_M = (1, 32, 64, 96, 128, 288, 512)


def _graph_us(fn: Any, reps: int = 20) -> float:
    """Median µs of one call, replayed from a CUDA graph of 10 calls (launch cost as in serving)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(1e3 * start.elapsed_time(end) / 10)
    return statistics.median(times)


def sweep(out: Path) -> int:
    """``--sweep``: whole tile configurations for many-row products (height, width, K chunk, stages), each
    checked bitwise against the rows computed alone with the table's config (the K ranges of a split stay
    the same: every chunk divides them), and timed at M = 96, 288 and 512. If a row's bits depend on none
    of these, the many-row products can have a configuration of their own."""
    import itertools

    dev, bf = "cuda", torch.bfloat16
    rows: list[dict[str, Any]] = []
    for (n, k), table in im._TABLE.items():
        if (n, k) == (192, 576):
            continue  # the unfused k/v projections: not in the fused forward
        g = torch.Generator(device=dev).manual_seed(n + k)
        w = (torch.randn(n, k, device=dev, generator=g) / k**0.5).to(bf)
        x = torch.randn(520, k, device=dev, generator=g).to(bf)
        alone = torch.stack([im.invariant_linear(x[i:i + 1], w)[0] for i in range(x.shape[0])])
        base = {m: _graph_us(lambda m=m: im.invariant_linear(x[:m], w)) for m in (96, 288, 512)}
        rows.append({"n": n, "k": k, "config": list(table), "us": base})
        print(f"{n}x{k} table {tuple(table)}: " + ", ".join(f"M={m} {t:.1f}" for m, t in base.items()),
              file=sys.stderr)
        for bm, bn, bk, stages in itertools.product((64, 128), (32, 64, 128), (64, 128), (3, 4)):
            cfg = im.Config(bm, bn, bk, table.split_k, 8 if bm * bn >= 128 * 64 else 4, stages)
            try:
                same = all(torch.equal(im.invariant_linear(x[off:off + m], w, config=cfg), alone[off:off + m])
                           for m in (64, 288, 512) for off in (0, 7))
                us = {m: _graph_us(lambda m=m, cfg=cfg: im.invariant_linear(x[:m], w, config=cfg))
                      for m in (96, 288, 512)}
            except Exception as exc:  # out of shared memory or registers: recorded
                rows.append({"n": n, "k": k, "config": list(cfg), "error": type(exc).__name__})
                continue
            rows.append({"n": n, "k": k, "config": list(cfg), "bitwise": same, "us": us})
            times = ", ".join(f"M={m} {t:.1f}" for m, t in us.items())
            print(f"{n}x{k} {tuple(cfg)} bitwise {same}: {times}", file=sys.stderr)
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                               "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                               "rows": rows}, indent=1) + "\n")
    return 0


def main() -> int:
    if sys.argv[1] == "--sweep":
        return sweep(Path(sys.argv[2]))
    out = Path(sys.argv[1])
    dev, bf = "cuda", torch.bfloat16
    shapes: list[dict[str, Any]] = []
    for (n, k), cfg in im._TABLE.items():
        g = torch.Generator(device=dev).manual_seed(n + k)
        w = (torch.randn(n, k, device=dev, generator=g) / k**0.5).to(bf)
        b = torch.randn(n, device=dev, generator=g).to(bf)
        x = torch.randn(max(CHECK_M) + 8, k, device=dev, generator=g).to(bf)
        alone = {bias: torch.stack([im.invariant_linear(x[i:i + 1], w, b if bias else None)[0]
                                    for i in range(x.shape[0])]) for bias in (False, True)}
        row: dict[str, Any] = {"n": n, "k": k, "config": list(cfg), "heights": {}}
        for height in HEIGHTS:
            tall = None if height == 0 else cfg._replace(block_m=height)
            try:
                im.invariant_linear(x[:max(CHECK_M)], w, config=tall)
            except Exception as exc:  # e.g. a tile past the shared memory: recorded, not fatal
                row["heights"][height] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
                print(f"{n}x{k} height {height}: {row['heights'][height]['error']}", file=sys.stderr)
                continue

            def product(m: int, bias: bool, off: int = 0, tall: im.Config | None = tall) -> torch.Tensor:
                return im.invariant_linear(x[off:off + m], w, b if bias else None,
                                           config=tall if m >= WIDE_ROWS else None)

            mismatched = [(m, off, bias) for m in CHECK_M for off in (0, 7) for bias in (False, True)
                          if not torch.equal(product(m, bias, off), alone[bias][off:off + m])]
            timing = {m: _graph_us(lambda m=m, product=product: product(m, False)) for m in TIME_M}
            row["heights"][height] = {"mismatched": mismatched, "us": timing}
            print(f"{n}x{k} height {height or 16}: {len(mismatched)} mismatched; "
                  + ", ".join(f"M={m} {t:.1f} us" for m, t in timing.items()), file=sys.stderr)
        shapes.append(row)
    # A layer's four products (w13, w2, wqkv, wo) at 512 rows, summed, per height: what one prefill of
    # 8 blocks spends per layer.
    four = {(3072, 576), (576, 1536), (960, 576), (576, 576)}
    layer = {h: sum(s["heights"][h]["us"][512] for s in shapes if (s["n"], s["k"]) in four)
             for h in HEIGHTS if all("us" in s["heights"][h] for s in shapes)}
    sums = ", ".join(f"{h or 16} rows {t:.1f} us" for h, t in layer.items())
    print(f"one layer's products at M=512: {sums}", file=sys.stderr)
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                               "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                               "shapes": shapes, "layer_us_at_512": layer}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
