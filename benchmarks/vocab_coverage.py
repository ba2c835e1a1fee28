"""How many of a text's tokens the first N token ids cover: a data-free draft vocabulary, sized.

A draft vocabulary (drafting over N of the 49,152 tokens) can only propose tokens inside it. The
tokenizer's ids follow its BPE merge order, roughly corpus frequency, so "the first N ids" is the
vocabulary one could pick without data. This counts, for N in ``--sizes``, the share of tokens below N in
the training templates' prompts (``build_prompts``, the distillation's own) and in a JSONL prompt file.

    python benchmarks/vocab_coverage.py --prompts tests/data/enterprise_prompts.jsonl --out coverage.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=Path, required=True)
    p.add_argument("--templates", type=int, default=2000, help="training-template prompts (seed 1)")
    p.add_argument("--sizes", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    p.add_argument("--out", type=Path, default=None)
    opts = p.parse_args(argv)

    from elesium.inference.prompts import read_prompts
    from elesium.inference.training.distill import build_prompts
    from elesium.inference.weights.loading import bundled_model_path, load_weights

    tok = load_weights(bundled_model_path()).tokenizer
    texts = {"training templates": [r["prompt"] for r in build_prompts(opts.templates, seed=1)],
             str(opts.prompts): read_prompts(opts.prompts)}
    doc: dict = {}
    for name, prompts in texts.items():
        ids = [t for text in prompts for t in tok.encode(text)]
        covered = {n: sum(t < n for t in ids) / len(ids) for n in opts.sizes}
        doc[name] = {"tokens": len(ids), "covered": covered}
        shares = ", ".join(f"{n}: {share:.3f}" for n, share in doc[name]["covered"].items())
        print(f"{name} ({len(ids)} tokens): {shares}")
    if opts.out is not None:
        opts.out.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
