"""Greedy speculative output is vanilla's, token for token, on both prompt sets: no divergence allowed.

The README promises identity, so one differing token fails the test, whatever its logit margin. Two
engines are held to it: the one ``Engine.load()`` builds on a CPU (GGUF 4-bit blocks through the
compiled step, exact by construction: row-invariant int4 layers and attention in logical order) and
the float32 reference (eager ``Transformer.forward``; its matmuls and SDPA reduce in an order that
depends on the row count, so identity there is measured, not built in, and a divergence would be
reported with its prompt, position and top-2 margin for investigation).

Speculation is forced through a dynamic tree of up to 16 nodes, so siblings are verified too (a CPU's
tuned profile may pick a plain chain).

The full sets (80 MT-Bench first turns and the 40 enterprise prompts, 128 tokens, both engines) are
marked ``identity_full`` and run with ``./dev test -m identity_full tests/test_identity_sets.py``; their
cost and last result are in BENCHMARKS.md §13. ``./dev test`` runs a fixed sample of both sets with the
same zero tolerance.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from elesium.inference.decoding.tree_policy import TreePolicy
from elesium.inference.engine import Engine
from elesium.inference.sampling import SamplingParams

DATA = Path(__file__).resolve().parent / "data"
FORCED_TREE = TreePolicy(kind="dynamic", max_nodes=16)


def prompt_set(name: str) -> list[str]:
    """MT-Bench first turns or the enterprise prompts, both vendored in tests/data."""
    path = DATA / {"mt_bench": "mt_bench_questions.jsonl", "enterprise": "enterprise_prompts.jsonl"}[name]
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["prompt"] if "prompt" in r else r["turns"][0] for r in rows]


def top2_margin(engine: Engine, prompt: str, tokens: tuple[int, ...], k: int) -> float:
    """Vanilla's top-1 minus top-2 logit where it chose ``tokens[k]``: what a report of a divergence needs
    to tell a numerical near-tie from a real bug."""
    ids = engine.encode_prompt(prompt) + list(tokens[:k])
    cache = engine.model.new_cache(len(ids) + 1)
    with torch.inference_mode():
        hidden = engine.model(torch.tensor([ids]), torch.arange(len(ids)), cache, 0)[0]
        top = torch.topk(engine.model.logits(hidden[-1]).float(), 2).values
    return float(top[0] - top[1])


def divergences(engine: Engine, prompts: list[str], max_tokens: int) -> tuple[list[str], int]:
    """Each prompt whose speculative output is not vanilla's (prompt index, first differing token,
    margin), and how many steps accepted at least one drafted token (speculation must really run)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    found, accepting = [], 0
    started = time.perf_counter()
    for i, prompt in enumerate(prompts):
        vanilla = engine.generate(prompt, params, mode="vanilla")
        spec = engine.generate(prompt, params, mode="speculative", policy=FORCED_TREE)
        accepting += sum(s.accepted_length > 0 for s in spec.steps)
        print(f"  prompt {i}: {'identical' if spec.token_ids == vanilla.token_ids else 'DIFFERS'} "
              f"({len(vanilla.token_ids)} tokens, tau {spec.mean_accepted:.2f})", flush=True)
        if spec.token_ids != vanilla.token_ids:
            k = next((j for j, (a, b) in enumerate(zip(vanilla.token_ids, spec.token_ids)) if a != b),
                     min(len(vanilla.token_ids), len(spec.token_ids)))
            found.append(f"prompt {i} token {k} (vanilla's top-2 margin there "
                         f"{top2_margin(engine, prompt, vanilla.token_ids, k):.2e})")
    # -s shows the tally (the full sets' cost and result go into BENCHMARKS.md from it).
    print(f"{engine.forward_path}: {len(prompts) - len(found)}/{len(prompts)} identical, {accepting} steps "
          f"accepted drafts, {time.perf_counter() - started:.0f} s")
    return found, accepting


def check(engine: Engine, name: str, stride: int, max_tokens: int) -> None:
    prompts = prompt_set(name)[::stride]
    found, accepting = divergences(engine, prompts, max_tokens)
    assert not found, f"{name}: speculative greedy output differs from vanilla on {len(found)} of " \
                      f"{len(prompts)} prompts: {found}"
    assert accepting >= len(prompts), f"{name}: speculation accepted drafts on only {accepting} steps"


@pytest.fixture
def reference(restored_engine: Engine) -> Engine:
    """The session's float32 reference engine with its shipped heads."""
    assert restored_engine.heads is not None and restored_engine.forward_path == "eager"
    return restored_engine


def test_the_default_engine_is_the_compiled_4bit_path(default_engine: Engine) -> None:
    """What the tests below call the default path is what a user's ``Engine.load()`` gives on a CPU."""
    assert default_engine.forward_path == "compiled" and default_engine.heads is not None
    assert default_engine.describe()["weights"] != "float32"


# The sample ./dev test runs, 128 tokens each: every 10th prompt of each set on the default path (8 + 4
# prompts: one per MT-Bench category), every 20th in float32 (4 + 2), whose steps cost several times more.
@pytest.mark.slow
@pytest.mark.parametrize("name,stride", [("mt_bench", 10), ("enterprise", 10)])
def test_default_path_identity_sample(default_engine: Engine, name: str, stride: int) -> None:
    check(default_engine, name, stride, 128)


@pytest.mark.slow
@pytest.mark.parametrize("name,stride", [("mt_bench", 20), ("enterprise", 20)])
def test_float32_identity_sample(reference: Engine, name: str, stride: int) -> None:
    check(reference, name, stride, 128)


@pytest.mark.identity_full
@pytest.mark.parametrize("name", ["mt_bench", "enterprise"])
def test_default_path_identity_full(default_engine: Engine, name: str) -> None:
    check(default_engine, name, 1, 128)


@pytest.mark.identity_full
@pytest.mark.parametrize("name", ["mt_bench", "enterprise"])
def test_float32_identity_full(reference: Engine, name: str) -> None:
    check(reference, name, 1, 128)
