"""Issue 38 probe: what the first decode step of a process costs, and where it goes.

With the persistent inductor cache warm (``~/.cache/elesium/inductor``, as ``Engine.load`` sets it), times:
  * ``Engine.load()``;
  * the first call of the 1-token graph and of the tree graph (dynamo trace + AOT + inductor cache load);
  * dynamo's trace alone (``torch.compile(backend="eager")`` of the same step function), and dynamo + AOT
    autograd (``backend="aot_eager"``), to split the first-call cost;
  * the steady per-step cost of the eager ``step_forward`` against the compiled one (what "serve eagerly
    while compiling" would cost per token).
Cold compiles are not re-run here (the issue measured ~130 s for the tree graph on this machine).

    .venv/bin/python benchmarks/batching_probe/warmup.py --out benchmarks/batching_probe/warmup.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time

import torch

T0 = time.perf_counter()
from elesium.inference.engine import Engine  # noqa: E402
from elesium.inference.runtime.cpu_step import step_forward  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    res: dict = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": "2-core CPU, shared",
        "loadavg_start": os.getloadavg(),
        "import_s": round(time.perf_counter() - T0, 2),
    }
    t = time.perf_counter()
    eng = Engine.load()
    res["engine_load_s"] = round(time.perf_counter() - t, 2)
    res["inductor_cache"] = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    runner, model = eng.runner, eng.model
    ids = eng.encode_prompt("List three causes of a failed database backup.")
    P = len(ids)
    with torch.inference_mode():
        t = time.perf_counter()
        runner.prefill(ids)
        res["first_prefill_s"] = round(time.perf_counter() - t, 2)

        def inputs() -> tuple[torch.Tensor, ...]:
            return (torch.tensor([[5]]), torch.tensor([P]), torch.tensor(P), runner.cache.k[:, :, :, :256],
                    runner.cache.v[:, :, :, :256], model.causal(1))

        for backend in ("eager", "aot_eager"):
            fn = torch.compile(functools.partial(step_forward, runner.model), fullgraph=True, dynamic=False,
                               backend=backend)
            args_ = inputs()
            torch._dynamo.mark_dynamic(args_[3], 3)
            torch._dynamo.mark_dynamic(args_[4], 3)
            t = time.perf_counter()
            fn(*args_)
            res[f"first_call_backend_{backend}_s"] = round(time.perf_counter() - t, 2)
        torch._dynamo.reset()
        t = time.perf_counter()
        runner.decode([5], [P], P)
        res["first_call_1tok_inductor_warm_cache_s"] = round(time.perf_counter() - t, 2)
        anc = torch.eye(4, dtype=torch.bool)
        anc[:, 0] = True
        t = time.perf_counter()
        runner.decode([5, 6, 7, 8], [P, P + 1, P + 1, P + 1], P, anc)
        res["first_call_tree_inductor_warm_cache_s"] = round(time.perf_counter() - t, 2)
        comp, eag = [], []
        for _ in range(9):
            t = time.perf_counter()
            runner.decode([5], [P], P)
            comp.append(1e3 * (time.perf_counter() - t))
            a = inputs()
            t = time.perf_counter()
            step_forward(model, *a)
            eag.append(1e3 * (time.perf_counter() - t))
        res["steady_1tok_ms"] = {
            "compiled_median": round(statistics.median(comp), 2),
            "compiled_min": round(min(comp), 2),
            "eager_median": round(statistics.median(eag), 2),
            "eager_min": round(min(eag), 2),
        }
    res["loadavg_end"] = os.getloadavg()
    with open(args.out, "w") as fh:
        json.dump(res, fh, indent=1)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
