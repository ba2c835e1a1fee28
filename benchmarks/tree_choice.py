"""Host time of choosing a speculative step's tree for Hydra heads: the array path against the general one.

Both start from the drafting's output arrays and end with what ``TreeDecoder.step`` hands the verify
forward (tree, node tokens, ancestor matrix): the general path is ``ExpandedDrafts.from_expansion`` +
``TreePolicy.build`` + the node tokens + ``Tree.ancestors``; the array path ``Expansion.from_arrays`` +
``TreePolicy.build_expanded`` (inference/decoding/expanded_tree.py). Random expansions of the engine's
default shape (5 levels, width 8, top 8), alternating the two paths call by call; medians in µs.

Run: ``python benchmarks/tree_choice.py [--calls 2000] [--out tree_choice.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from elesium.inference.decoding.drafts import ExpandedDrafts  # noqa: E402
from elesium.inference.decoding.expanded_tree import Expansion  # noqa: E402
from elesium.inference.decoding.tree_policy import CostCurve, TreePolicy  # noqa: E402
from test_expanded_tree import random_expansion  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--max-nodes", type=int, default=64)
    p.add_argument("--out", type=Path, default=None)
    opts = p.parse_args(argv)
    rng = np.random.default_rng(0)
    cost = CostCurve([1, 8, 32, 64, 128], [1.24, 1.28, 1.40, 1.66, 2.22])  # the H200 profile's shape
    general = TreePolicy(max_nodes=opts.max_nodes, cost=cost)
    arrays = TreePolicy(max_nodes=opts.max_nodes, cost=cost)
    times: dict[str, list[float]] = {"general": [], "arrays": []}
    sizes = []
    for i in range(opts.calls):
        tokens, logprobs, parents = random_expansion(rng, 5, 8, 8)
        for name in (("general", "arrays") if i % 2 else ("arrays", "general")):
            start = time.perf_counter()
            if name == "general":
                drafts = ExpandedDrafts.from_expansion(tokens.tolist(), logprobs.tolist(), parents.tolist(),
                                                       8)
                tree = general.build(drafts)
                _ = [drafts.token(path) for path in tree.paths[1:]], tree.ancestors()
            else:
                tree = arrays.build_expanded(Expansion.from_arrays(tokens, logprobs, parents, 8))[0]
            times[name].append(1e6 * (time.perf_counter() - start))
        sizes.append(tree.size)
    doc = {name: {"median_us": statistics.median(v), "p90_us": sorted(v)[int(0.9 * len(v))]}
           for name, v in times.items()}
    doc |= {"calls": opts.calls, "median_tree_nodes": statistics.median(sizes),
            "python": platform.python_version(), "cores": os.cpu_count(), "loadavg": os.getloadavg(),
            "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    doc["ratio_general_over_arrays"] = doc["general"]["median_us"] / doc["arrays"]["median_us"]
    print(json.dumps(doc, indent=1))
    if opts.out:
        opts.out.parent.mkdir(parents=True, exist_ok=True)
        opts.out.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
