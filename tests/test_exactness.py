"""Speculative sampling keeps the base model's distribution exactly (chi-square, N = 20,000 each).

The joint distribution of the two tokens after a fixed context is enumerated exactly from the tiny
model; the Medusa decoder's samples must fit it at every temperature with top-p 0.9, for static and
dynamic trees. A negative control with a deliberately wrong residual must fail, proving the test
has the power to catch a broken verifier.
"""

from __future__ import annotations

import pytest
import torch

from elesium.inference.decoding import verify as verify_mod
from elesium.inference.decoding.tree_policy import TreePolicy
from elesium.inference.decoding.verify import Verdict
from elesium.inference.runtime.cpu_step import CompiledCpuRunner
from elesium.inference.runtime.forward import ForwardRunner
from elesium.inference.sampling import SamplingParams, sample_from, target_probs
from helpers import ChainRunner
from spec_harness import (
    RandomHeads,
    chi_square_p,
    exact_joint,
    random_drafter_tree,
    random_hydra_heads,
    speculative_samples,
    tiny_model,
    with_random_drafter,
)

SAMPLES = 20_000
PREFIX, FIRST = [1, 2, 3], 4
STATIC = TreePolicy(kind="static", static_paths=((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (2, 0)))
DYNAMIC = TreePolicy(kind="dynamic", max_nodes=10, topk=4)


@pytest.fixture(scope="module", autouse=True)
def single_thread():
    # Thousands of tiny forwards: thread hand-offs would cost more than the arithmetic.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny():
    return tiny_model(0), RandomHeads(32, 3, seed=1)


def assert_samples_exact(model, heads, policy, temperature: float, seed: int, label: str,
                         runner_type: type[ForwardRunner] = ForwardRunner, samples: int = SAMPLES) -> None:
    """``samples`` speculative two-token continuations must fit the base model's exact joint (chi-square
    p > 0.01)."""
    params = SamplingParams(temperature=temperature, top_p=0.9)
    expected = exact_joint(model, PREFIX, FIRST, params, 2)
    counts = speculative_samples(model, heads, policy, PREFIX, FIRST, params, 2, samples, seed=seed,
                                 runner_type=runner_type)
    p = chi_square_p(counts, expected, samples)
    print(f"{label}: chi-square p = {p:.3f}")
    assert p > 0.01, f"speculative samples do not fit the base distribution (p = {p:.2e})"


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.5])
@pytest.mark.parametrize("policy", [STATIC, DYNAMIC], ids=["static", "dynamic"])
def test_speculative_sampling_is_exact(tiny, temperature, policy):
    model, heads = tiny
    assert_samples_exact(model, heads, policy, temperature, seed=7,
                         label=f"exact {policy.kind} T={temperature}")


@pytest.mark.parametrize(("temperature", "policy", "conditioning"),
                         [(0.5, STATIC, "concat"), (1.0, DYNAMIC, "concat"), (1.5, DYNAMIC, "chain")],
                         ids=["static-T0.5-concat", "dynamic-T1.0-concat", "dynamic-T1.5-chain"])
def test_hydra_speculative_sampling_is_exact(tiny, temperature, policy, conditioning):
    """Hydra heads draft a different list under every parent; verification must not care."""
    model, _ = tiny
    heads = random_hydra_heads(32, 3, seed=2, conditioning=conditioning)
    assert_samples_exact(model, heads, policy, temperature, seed=11,
                         label=f"exact hydra {conditioning} {policy.kind} T={temperature}")


def test_hydra_with_attention_drafter_sampling_is_exact(tiny):
    """Level 1 from the attention drafter (its own cache, fed the accepted rows): still exact."""
    model, _ = tiny
    heads = with_random_drafter(random_hydra_heads(32, 3, seed=4, conditioning="chain"), model.config, seed=5)
    assert_samples_exact(model, heads, DYNAMIC, 1.0, seed=13, label="exact hydra chain + drafter T=1.0")


def test_drafter_tree_sampling_is_exact(tiny):
    """Every level from the eagle drafter tree (its own scratch rows, features fed back): still exact."""
    model, _ = tiny
    heads = random_drafter_tree(model.config, 3, seed=21)
    assert_samples_exact(model, heads, DYNAMIC, 1.0, seed=23, label="exact eagle drafter tree T=1.0")


class EagerCpuStep(CompiledCpuRunner):
    """The CPU fast path's step function (``cpu_step.step_forward``), run eagerly: the same code the
    compiled graph is held to, bit for bit, in ``test_cpu_step.py``."""

    def __init__(self, model, cache, heads=None) -> None:
        super().__init__(model, cache, heads, compiled=False)


def test_sampling_through_the_cpu_step_is_exact(tiny):
    """Verification through the CPU fast path's forward (attention in each node's logical key order).

    Fewer samples than the tests above: each one is a dozen tiny forwards through more ops than the
    plain forward (~3 minutes of the suite at SAMPLES), and test_cpu_step.py already holds every
    node's logits bitwise to its one-token decode; this checks the sampling walk on top of it."""
    model, _ = tiny
    heads = with_random_drafter(random_hydra_heads(32, 3, seed=6, conditioning="concat"), model.config,
                                seed=8)
    assert_samples_exact(model, heads, DYNAMIC, 1.3, seed=17, label="exact cpu step T=1.3",
                         runner_type=EagerCpuStep, samples=6_000)


def test_sampling_through_the_chained_tree_step_is_exact(tiny):
    """The self-feeding tree step (runtime/tree_chain.py, the CUDA path at T > 0), its body run eagerly:
    drafting, the device tree and ``accept_sampled`` with the generation's uniforms, one per node.

    Fewer samples than the host tests: every sample starts a chain and runs up to two whole steps as
    tensor code (~9 ms a sample here); tests/test_device_sampling.py checks the acceptance walk alone
    at 10,000 samples, with a negative control."""
    model, _ = tiny
    heads = with_random_drafter(random_hydra_heads(32, 3, seed=9, conditioning="chain"), model.config,
                                seed=10)
    samples = 3_000
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=3)  # 2 tokens after FIRST
    decoders = []
    counts = speculative_samples(model, heads, DYNAMIC, PREFIX, FIRST, params, 2, samples, seed=19,
                                 on_decoder=decoders.append, runner_type=ChainRunner)
    runner = decoders[0].runner
    assert len(runner.chains_started) == samples, "every sample should have run on the chain"
    assert len(runner.graphs) == 1
    p = chi_square_p(counts, exact_joint(model, PREFIX, FIRST, params, 2), samples)
    print(f"exact chained tree step T=1.0: chi-square p = {p:.3f}")
    assert p > 0.01, f"chained speculative samples do not fit the base distribution (p = {p:.2e})"


def wrong_residual(tree, node_tokens, logits, params, sampler):
    """A plausible bug: after rejecting every child, sample from the original p, not the residual."""
    node, path = 0, [0]
    while True:
        p = target_probs(logits[node], params).double().cpu()
        for child in tree.children[node]:
            if sampler.uniform() < float(p[node_tokens[child]]):
                node = child
                path.append(node)
                break
        else:
            return Verdict(path, sample_from(p, sampler.uniform()))


def test_negative_control_wrong_residual_fails(tiny, monkeypatch):
    model, heads = tiny
    monkeypatch.setattr("elesium.inference.decoding.speculative.verify_sampled", wrong_residual)
    params = SamplingParams(temperature=1.0, top_p=0.9)
    expected = exact_joint(model, PREFIX, FIRST, params, 2)
    counts = speculative_samples(model, heads, STATIC, PREFIX, FIRST, params, 2, SAMPLES, seed=7)
    p = chi_square_p(counts, expected, SAMPLES)
    print(f"negative control (wrong residual): chi-square p = {p:.3e}")
    assert p < 0.01
    assert verify_mod.verify_sampled is not wrong_residual  # the patch stayed local


def test_typical_acceptance_is_not_exact(tiny):
    """Typical acceptance trades exactness for speed; the chi-square test sees the difference."""
    model, heads = tiny
    params = SamplingParams(temperature=1.0, top_p=0.9)
    expected = exact_joint(model, PREFIX, FIRST, params, 2)
    counts = speculative_samples(model, heads, STATIC, PREFIX, FIRST, params, 2, SAMPLES, seed=7,
                                 mode="typical")
    p = chi_square_p(counts, expected, SAMPLES)
    print(f"typical acceptance chi-square p = {p:.3e}")
    assert p < 0.01
