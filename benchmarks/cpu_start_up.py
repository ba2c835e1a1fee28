"""First generations of a fresh process, vanilla then speculative: what compiling (or loading) the CPU
step's two graphs costs. Run with ``TORCHINDUCTOR_CACHE_DIR`` set to an empty directory for a cold start,
then again with the same directory for a warm one.

    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python benchmarks/cpu_start_up.py
"""

from __future__ import annotations

import json
import os
import time


def main() -> None:
    t0 = time.perf_counter()
    from elesium.inference.engine import Engine
    from elesium.inference.sampling import SamplingParams

    engine = Engine.load(device="cpu")
    loaded = time.perf_counter()
    params = SamplingParams(max_tokens=8, temperature=0.0)
    prompt = "List three causes of a failed database backup."
    engine.generate(prompt, params, mode="vanilla")
    vanilla = time.perf_counter()
    engine.generate(prompt, params, mode="speculative")
    spec = time.perf_counter()
    print(json.dumps({"inductor_cache": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
                      "load_s": round(loaded - t0, 1), "first_vanilla_s": round(vanilla - loaded, 1),
                      "first_speculative_s": round(spec - vanilla, 1), "forward": engine.forward_path}))


if __name__ == "__main__":
    main()
