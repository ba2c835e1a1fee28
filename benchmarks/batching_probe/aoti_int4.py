"""Issue 38 probe: can AOTInductor package a CPU graph that calls torch's int4 kernel
(``aten._weight_int4pack_mm_for_cpu``, what ``Int4GroupLinear`` runs), with a dynamic row count, and is the
packaged result bitwise the eager op's? A tiny two-layer module (K = N = 64), so the C++ compile stays short.

    .venv/bin/python benchmarks/batching_probe/aoti_int4.py --out benchmarks/batching_probe/aoti_int4.json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import traceback

import torch


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        codes = torch.randint(0, 16, (64, 64), generator=g, dtype=torch.int32)
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 8))
        self.register_buffer("sz", (torch.rand(2, 64, 2, generator=g) * 0.1).to(torch.bfloat16).contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.packed, 32, self.sz)
        h = torch.nn.functional.silu(h.float())
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            h.to(torch.bfloat16), self.packed, 32, self.sz
        ).float()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    res: dict = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": "2-core CPU, shared",
        "torch": torch.__version__,
        "loadavg": os.getloadavg(),
    }
    m = Tiny().eval()
    x = torch.randn(5, 64)
    with torch.inference_mode():
        ref = m(x)
    try:
        rows = torch.export.Dim("rows", min=1, max=512)
        t = time.perf_counter()
        ep = torch.export.export(m, (x,), dynamic_shapes={"x": {0: rows}})
        res["export_s"] = round(time.perf_counter() - t, 2)
        path = os.path.join(tempfile.mkdtemp(prefix="aoti-int4-"), "tiny.pt2")
        t = time.perf_counter()
        torch._inductor.aoti_compile_and_package(ep, package_path=path)
        res["aoti_compile_s"] = round(time.perf_counter() - t, 2)
        t = time.perf_counter()
        loaded = torch._inductor.aoti_load_package(path)
        res["aoti_load_s"] = round(time.perf_counter() - t, 3)
        with torch.inference_mode():
            out = loaded(x)
            res["packaged_equals_eager_5_rows"] = bool(torch.equal(out, ref))
            res["max_abs_diff"] = float((out - ref).abs().max())
            x2 = torch.randn(17, 64)
            res["packaged_equals_eager_17_rows"] = bool(torch.equal(loaded(x2), m(x2)))
            # row invariance through the package: row 0 alone vs in 17 rows
            res["packaged_row_invariant"] = bool(torch.equal(loaded(x2[:1])[0], loaded(x2)[0]))
        res["ok"] = True
    except Exception as exc:  # noqa: BLE001 - the probe reports what failed
        res["ok"] = False
        res["error"] = f"{type(exc).__name__}: {str(exc)[:1500]}"
        res["trace_tail"] = traceback.format_exc()[-1500:]
    with open(args.out, "w") as fh:
        json.dump(res, fh, indent=1)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
