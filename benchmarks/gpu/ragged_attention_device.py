"""On a CUDA machine: the ragged kernel's bitwise check (tests/test_ragged_attention.py's GPU check) and its
decode-batch cost against one single-sequence launch per sequence.

Why a script and not only the gpu-marked test: the lent GPU machine has no installed ``elesium``, so this
runs from a plain checkout (``PYTHONPATH`` set to a package tree that maps the repo's folders, as
benchmarks/device/device_env.sh builds; ``pytest`` must import, for the test file's helpers). Writes JSON to
argv[1]: ``python3 -P benchmarks/gpu/ragged_attention_device.py out.json`` (benchmarks/device/
device_gpu_tests_ragged.sh, STAGE=1). TRITON_INTERPRET is forced to 0 before anything imports Triton: the
test module sets it to 1 when unset, which would make every kernel imported after it an interpreted one.
A failed bitwise check is recorded in the JSON (and the exit status is 1), the timings are still taken.

Decode batch: B sequences of one node each, prefixes drawn from 512..2047, capacity 8192, bf16,
SmolLM2-135M's heads (9 query, 3 KV, head_dim 64): one layer's attention for the whole batch.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

os.environ["TRITON_INTERPRET"] = "0"  # before triton's import; the test module's setdefault then keeps it

import torch  # noqa: E402
import triton  # noqa: E402
import triton.testing  # noqa: E402

TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests")
sys.path.insert(0, os.path.abspath(TESTS))
import test_ragged_attention as t  # noqa: E402
from elesium.kernels.invariant_attention import invariant_tree_attention  # noqa: E402
from elesium.kernels.ragged_attention import ragged_tree_attention  # noqa: E402

try:
    exec(t._GPU_CHECK.format(tests=os.path.abspath(TESTS)))  # raises on any bit that differs
    check = "passed"
except AssertionError as failed:
    check = f"FAILED: {failed}"
    print("bitwise check", check, flush=True)

rows = []
for b in (1, 8, 32, 64):
    rnd = random.Random(b)
    batch = [(rnd.randrange(512, 2048), [-1]) for _ in range(b)]
    args = t.make_batch(batch, list(range(b)), 9, 3, b, 8192, torch.bfloat16, seed=b, device="cuda")
    anc = torch.ones(b, 1, dtype=torch.bool, device="cuda")
    args["ancestors"] = anc
    one = torch.ones(1, 1, dtype=torch.bool, device="cuda")
    qs = [args["q"][:, i:i + 1][None] for i in range(b)]
    ks = [args["k_pool"][i][None] for i in range(b)]
    vs = [args["v_pool"][i][None] for i in range(b)]

    def ragged() -> None:
        ragged_tree_attention(**args)

    def separate() -> None:
        for i, (prefix, _) in enumerate(batch):
            invariant_tree_attention(qs[i], ks[i], vs[i], prefix, one)

    bench = triton.testing.do_bench
    rows.append({"sequences": b, "ragged_us": bench(ragged, return_mode="median") * 1000,
                 "one_launch_per_sequence_us": bench(separate, return_mode="median") * 1000})
    print(rows[-1], flush=True)
report = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
          "date": time.strftime("%F %T %Z"), "bitwise_check": check, "decode_batch": rows}
with open(sys.argv[1], "w") as f:
    json.dump(report, f, indent=1)
print(json.dumps(report))
sys.exit(0 if check == "passed" else 1)
