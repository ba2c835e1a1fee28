"""CUDA checks of the decoding engine (``pytest -m gpu tests/test_gpu.py`` on a machine with a GPU).

What they assert, on the bundled model: CUDA-graph replay decodes the same tokens as eager launches;
greedy speculative decoding emits exactly vanilla's tokens in bf16 and fp32 (shape-invariant
numerics, ``inference/runtime/invariant.py``); every node of an N-node verify forward gets bit-for-bit
the logits of decoding that node alone, one token at a time, after its path; the invariant kernels in
bf16 (which Triton's CPU interpreter lacks); sampled speculative decoding on the device keeps the
base model's distribution (chi-square, as tests/test_exactness.py does on the CPU); and the self-feeding
vanilla and greedy tree steps (decode_chain.py, tree_chain.py) give the synchronous paths' tokens and
stop exactly, and the sampled tree steps keep the distribution (chi-square) and replay from their seed,
also at production settings (T 0.5/0.7/1.5 with top-k and top-p, three tokens deep, against
tests/test_exactness_settings.py's NumPy reference, with a negative control that must fail).

Without CUDA every test here is skipped with the reason printed (``-ra``): the CPU CI machine has no
GPU. Run this file alone: the interpreter tests (test_tree_attention, test_invariant_kernels) set
TRITON_INTERPRET=1 for the whole session, which would run these kernels on the host.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from elesium.inference.sampling import SamplingParams
from helpers import ancestors_from_parents
from test_exactness_settings import SETTINGS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="no CUDA device: GPU tests run on a CUDA machine"),
]


@pytest.fixture(autouse=True)
def _compiled_triton() -> None:
    """Checked when each test runs, not at import: the interpreter tests set the variable as they run."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 is set (by an interpreter test in this session): "
                    "run tests/test_gpu.py on its own")

PROMPTS = 6  # MT-Bench first turns per check
TOKENS = 96


def load(dtype: str, graphs: bool = True, invariant: str = "on", max_len: int | None = None):
    from elesium.config import Settings
    from elesium.inference.engine import Engine

    settings = Settings.from_env().with_overrides(invariant_numerics=invariant)
    return Engine.load(device="cuda", dtype=dtype, cuda_graphs=graphs, settings=settings, max_len=max_len)


@pytest.fixture(scope="module")
def bf16():
    return load("bfloat16")


@pytest.fixture(scope="module")
def bf16_eager():
    return load("bfloat16", graphs=False)


@pytest.fixture(scope="module")
def fp32():
    return load("float32")


def _diverge(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_graphs_equal_eager(bf16, bf16_eager, mt_bench_prompts) -> None:
    params = SamplingParams(max_tokens=64)
    for prompt in mt_bench_prompts[:3]:
        for mode in ("vanilla", "speculative"):
            a = bf16.generate(prompt, params, mode=mode).token_ids
            b = bf16_eager.generate(prompt, params, mode=mode).token_ids
            assert a == b, f"{mode}: graphs and eager diverge at token {_diverge(a, b)}"


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_speculative_greedy_equals_vanilla(dtype: str, bf16, fp32, mt_bench_prompts) -> None:
    engine = bf16 if dtype == "bfloat16" else fp32
    assert "speculative" in engine.modes, "the shipped heads did not load"
    params = SamplingParams(max_tokens=TOKENS)
    same, accepted = [], []
    for prompt in mt_bench_prompts[:PROMPTS]:
        vanilla = engine.generate(prompt, params, mode="vanilla")
        spec = engine.generate(prompt, params, mode="speculative")
        same.append(spec.token_ids == vanilla.token_ids or _diverge(spec.token_ids, vanilla.token_ids))
        accepted.append(spec.mean_accepted)
    print(f"{dtype}: speculative == vanilla on {sum(s is True for s in same)}/{len(same)} prompts "
          f"(first divergence per prompt: {same}); mean accepted per step {accepted}")
    assert all(s is True for s in same), f"speculative diverged from vanilla: {same}"
    assert max(accepted) > 1.2, "speculation accepted almost nothing: the check would be vacuous"


def random_tree(n: int, gen: torch.Generator) -> torch.Tensor:
    """Ancestors of a topologically ordered tree: a chain of 8 (deep paths), the rest random parents."""
    parents = [i - 1 for i in range(min(n, 8))]
    parents += [int(torch.randint(0, i, (1,), generator=gen)) for i in range(8, n)]
    return ancestors_from_parents(parents)


@pytest.mark.parametrize("n", [24, 64])
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_verify_logits_equal_one_token_decodes(n: int, graphs: bool, bf16, bf16_eager,
                                               mt_bench_prompts) -> None:
    """Each node's logits in one N-node verify forward == decoding its path one token at a time, bitwise."""
    engine = bf16 if graphs else bf16_eager
    runner = engine.runner
    gen = torch.Generator().manual_seed(n)
    ids = engine.encode_prompt(mt_bench_prompts[7])
    prefix = len(ids)
    anc = random_tree(n, gen)
    tokens = torch.randint(0, engine.model.config.vocab_size, (n,), generator=gen).tolist()
    depth = anc.sum(1) - 1
    with torch.inference_mode():
        runner.prefill(ids)
        tree = runner.decode(tokens, (prefix + depth).tolist(), prefix, anc).logits.clone()
        mismatched = []
        for node in range(n):
            path = torch.nonzero(anc[node]).flatten().tolist()
            for k, t in enumerate(path):
                out = runner.decode([tokens[t]], [prefix + k], prefix + k)
            if not torch.equal(out.logits[0], tree[node]):
                mismatched.append((node, len(path) - 1, float((out.logits[0] - tree[node]).abs().max())))
    assert not mismatched, f"(node, depth, max |diff|) of nodes whose logits differ: {mismatched}"


def test_invariant_kernels_bf16() -> None:
    """The bf16 cases the CPU interpreter cannot run: accuracy, and M=1 == M=N for every row."""
    from elesium.kernels.invariant_attention import invariant_tree_attention
    from elesium.kernels.invariant_matmul import invariant_linear, linear_reference
    from elesium.kernels.invariant_norm import invariant_rms_norm, rms_norm_reference
    from elesium.kernels.tree_attention import tree_attention_reference

    g = torch.Generator(device="cuda").manual_seed(5)
    dev, bf = "cuda", torch.bfloat16
    x = torch.randn(70, 576, device=dev, generator=g).to(bf)
    w = (torch.randn(1536, 576, device=dev, generator=g) / 24).to(bf)
    full = invariant_linear(x, w)
    ref = linear_reference(x.double(), w.double())
    assert float((full.double() - ref).norm() / ref.norm()) < 1e-2
    assert all(torch.equal(invariant_linear(x[i:i + 1], w)[0], full[i]) for i in range(70))
    normed = invariant_rms_norm(x, w[0], 1e-5)
    nref = rms_norm_reference(x.double(), w[0].double(), 1e-5)
    assert float((normed.double() - nref).norm() / nref.norm()) < 1e-2
    assert all(torch.equal(invariant_rms_norm(x[i:i + 1], w[0], 1e-5)[0], normed[i]) for i in range(70))

    prefix, n, cap = 1000, 40, 2048
    anc = random_tree(n, torch.Generator().manual_seed(1)).to(dev)
    q = torch.randn(1, 9, n, 64, device=dev, generator=g).to(bf)
    k = torch.randn(1, 3, cap, 64, device=dev, generator=g).to(bf)
    v = torch.randn(1, 3, cap, 64, device=dev, generator=g).to(bf)
    out = invariant_tree_attention(q, k, v, torch.tensor(prefix, device=dev), anc)
    aref = tree_attention_reference(q.double(), k.double(), v.double(), prefix, anc)
    assert float((out.double() - aref).norm() / aref.norm()) < 1e-2
    for node in range(n):
        path = torch.nonzero(anc[node]).flatten()
        kk, vv = k.clone(), v.clone()
        kk[:, :, prefix:prefix + len(path)] = k[:, :, prefix + path]
        vv[:, :, prefix:prefix + len(path)] = v[:, :, prefix + path]
        alone = invariant_tree_attention(q[:, :, node:node + 1], kk, vv, prefix + len(path) - 1,
                                         torch.ones(1, 1, dtype=torch.bool, device=dev))
        assert torch.equal(alone[:, :, 0], out[:, :, node]), f"node {node}"


def test_decode_chain_equals_synchronous_steps_and_stops_exactly(bf16, mt_bench_prompts) -> None:
    """Vanilla on CUDA runs a self-feeding graph with replays in flight (runtime/decode_chain.py): its
    tokens are the synchronous bucket-1 graph's, greedy and seeded sampled alike (the pick runs on the
    device with the run's own uniforms), and stops (max_tokens, a stop string, a full cache) land exactly
    where they would, with the replays still in flight harmless to the next generation."""
    runner = bf16.runner
    prompts = mt_bench_prompts[:4]
    params = SamplingParams(max_tokens=80)
    sampled = [SamplingParams(max_tokens=80, temperature=0.7, top_p=0.9, seed=s) for s in range(3)]
    sampled.append(SamplingParams(max_tokens=80, temperature=1.1, top_k=20, seed=9))

    def run_all(chains: bool) -> list[tuple[int, ...]]:
        runner.chains = chains
        try:
            return ([bf16.generate(p, params, mode="vanilla").token_ids for p in prompts]
                    + [bf16.generate(p, q, mode="vanilla").token_ids for p, q in zip(prompts, sampled)])
        finally:
            runner.chains = True

    graphs_before = len(runner._chains)
    both = run_all(True)
    assert len(runner._chains) >= min(4, graphs_before + 1), "vanilla did not take the chained graphs"
    for i, (a, b) in enumerate(zip(both, run_all(False))):
        what = "greedy" if i < len(prompts) else f"sampled ({sampled[i - len(prompts)]})"
        assert a == b, f"run {i}, {what}: chained and synchronous steps diverge at token {_diverge(a, b)}"
    chained = both[:len(prompts)]
    for cut in (1, 2, 5):
        short = bf16.generate(prompts[0], SamplingParams(max_tokens=cut), mode="vanilla")
        assert short.token_ids == chained[0][:cut] and short.finish_reason == "length"
        # Replays that were in flight when it stopped wrote only past its end: the next run is unharmed.
        assert bf16.generate(prompts[1], params, mode="vanilla").token_ids == chained[1]
    windows = (bf16.tokenizer.decode(list(chained[2][i:i + 3])) for i in range(10, 60))
    stop_text = next(t for t in windows if t.strip())
    stopped = bf16.generate(prompts[2], SamplingParams(max_tokens=80, stop=(stop_text,)), mode="vanilla")
    assert stopped.finish_reason == "stop" and stop_text not in stopped.text
    assert stopped.token_ids == chained[2][:len(stopped.token_ids)]
    ids = bf16.encode_prompt(prompts[3])
    small = load("bfloat16", max_len=len(ids) + 9)
    full = small.generate(prompts[3], params, mode="vanilla")
    assert full.finish_reason == "length" and full.token_ids == chained[3][:len(full.token_ids)]
    assert len(ids) + len(full.token_ids) >= small.context_length


def test_sampled_speculative_is_exact_on_device() -> None:
    """Speculative sampling on CUDA fits the base model's exact joint of the next two tokens (chi-square)."""
    from elesium.inference.decoding.tree_policy import TreePolicy
    from elesium.inference.runtime.invariant import apply_invariant_numerics
    from spec_harness import RandomHeads, chi_square_p, exact_joint, speculative_samples, tiny_model

    samples = 4000
    prefix, first = [1, 2, 3], 4
    params = SamplingParams(temperature=1.0, top_p=0.9)
    cpu_model = tiny_model(0)
    expected = exact_joint(cpu_model, prefix, first, params, 2)
    model = apply_invariant_numerics(tiny_model(0).cuda(), True)
    heads = RandomHeads(32, 3, seed=1).cuda()
    policy = TreePolicy(kind="dynamic", max_nodes=10, topk=4)
    counts = speculative_samples(model, heads, policy, prefix, first, params, 2, samples, seed=3)
    p = chi_square_p(counts, expected, samples)
    print(f"device speculative sampling: chi-square p = {p:.3f} over {samples} samples")
    assert p > 0.01, f"speculative samples on CUDA do not fit the base distribution (p = {p:.2e})"


def test_compiled_tree_logic_equals_eager() -> None:
    """The chain's tree choice and acceptance through torch.compile (tree_chain.tree_logic) against the
    same functions run eagerly, on CUDA, on random expansions of the H200 profile's shape: the same
    trees, paths, committed tokens and bonus tokens, greedy and sampled."""
    import numpy as np

    from elesium.inference.decoding.device_tree import ExpansionLayout
    from elesium.inference.decoding.tree_chain import tree_logic
    from elesium.inference.sampling import target_probs
    from test_expanded_tree import random_expansion

    rng = np.random.default_rng(0)
    levels, width, k, count = 4, 8, 8, 31
    layout = ExpansionLayout.of(levels, width, k)
    for greedy in (True, False):
        eager = tree_logic(layout, count, levels, greedy, compiled=False)
        compiled = tree_logic(layout, count, levels, greedy, compiled=True)
        for _ in range(20):
            tokens, logprobs, parents = random_expansion(rng, levels, width, k)
            args = (torch.tensor([3]), torch.from_numpy(tokens), torch.from_numpy(logprobs),
                    torch.from_numpy(parents),
                    torch.tensor([float(rng.uniform(0.5, 2))], dtype=torch.float64))
            args = tuple(a.cuda() for a in args)
            tree, tree_c = eager[0](*args), compiled[0](*args)
            assert all(torch.equal(a, b) for a, b in zip(tree, tree_c)), "compiled tree choice differs"
            n = tree[0].numel()
            if greedy:
                scores, u = torch.from_numpy(rng.integers(0, 40, size=n)).cuda(), None
            else:
                logits = torch.from_numpy(rng.normal(size=(n, 40)).astype(np.float32)).cuda() * 2
                scores = target_probs(logits, SamplingParams(temperature=0.8, top_p=0.9))
                u = torch.from_numpy(rng.random(n)).cuda()
            got, want = compiled[1](tree, scores, u), eager[1](tree, scores, u)
            assert all(torch.equal(a, b) for a, b in zip(got, want)), "compiled acceptance differs"


def test_chained_sampled_tree_steps_are_exact_on_device(bf16, mt_bench_prompts) -> None:
    """T > 0 through the captured tree step (tree_chain.py with ``accept_sampled``): the exact joint of
    the next two tokens (chi-square, through the real CUDA graphs of a tiny model with a drafter); and
    on the bundled model a seeded sampled run replays to the same tokens and accepts drafts."""
    from elesium.inference.decoding.tree_policy import TreePolicy
    from elesium.inference.runtime.forward import CudaGraphRunner
    from elesium.inference.runtime.invariant import apply_invariant_numerics
    from spec_harness import (
        chi_square_p,
        exact_joint,
        random_hydra_heads,
        speculative_samples,
        tiny_model,
        with_random_drafter,
    )

    samples = 4000
    prefix, first = [1, 2, 3], 4
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=3)
    expected = exact_joint(tiny_model(0), prefix, first, params, 2)
    model = apply_invariant_numerics(tiny_model(0).cuda(), True)
    heads = with_random_drafter(random_hydra_heads(32, 3, seed=9, conditioning="chain"), model.config,
                                seed=10).cuda()
    decoders: list = []
    policy = TreePolicy(kind="dynamic", max_nodes=10, topk=4)
    counts = speculative_samples(model, heads, policy, prefix, first, params, 2, samples, seed=3,
                                 on_decoder=decoders.append, runner_type=CudaGraphRunner)
    assert all(d._chain is not None for d in decoders), "a sample did not run on the tree chain"
    p = chi_square_p(counts, expected, samples)
    print(f"chained sampled tree steps on CUDA: chi-square p = {p:.3f} over {samples} samples")
    assert p > 0.01, f"chained samples on CUDA do not fit the base distribution (p = {p:.2e})"

    seeded = SamplingParams(temperature=0.7, max_tokens=TOKENS, seed=5)
    runs = [bf16.generate(mt_bench_prompts[0], seeded, mode="speculative") for _ in range(2)]
    assert any(key[1][0] > 0 for key in bf16.runner.chain_graphs), \
        "the bundled model's T = 0.7 chain did not start"
    assert runs[0].token_ids == runs[1].token_ids, "a seeded sampled run did not replay"
    assert runs[0].mean_accepted > 1.3, f"tau {runs[0].mean_accepted}: drafts were hardly accepted"


DEVICE_CHAIN_SAMPLES = 4_000  # per setting: twice the CPU chain test's, for power at the same alpha
DEVICE_CONTROL_SAMPLES = 3_000  # as test_exactness_settings' controls


@pytest.fixture(scope="module")
def exactness_contexts() -> dict[tuple[int, ...], np.ndarray]:
    """The NumPy reference's float64 logit rows, from the tiny model's plain CPU forward."""
    from spec_harness import tiny_model
    from test_exactness_settings import context_logits

    return context_logits(tiny_model(0))


def device_chain_draws(params: SamplingParams, samples: int, seed: int):
    """``samples`` three-token draws through the captured tree step (``decoding/tree_chain.py`` under
    ``CudaGraphRunner``: CUDA graphs, compiled tree logic, ``accept_sampled``), with
    test_exactness_settings' chained heads, policy and context; every sample asserted to run on a chain."""
    from elesium.inference.runtime.forward import CudaGraphRunner
    from elesium.inference.runtime.invariant import apply_invariant_numerics
    from spec_harness import random_hydra_heads, tiny_model, with_random_drafter
    from test_exactness_settings import DEPTH, DYNAMIC, draw

    model = apply_invariant_numerics(tiny_model(0).cuda(), True)
    hydra = random_hydra_heads(32, 3, seed=9, conditioning="chain")
    heads = with_random_drafter(hydra, model.config, seed=10).cuda()
    params = dataclasses.replace(params, max_tokens=DEPTH + 1)  # FIRST, then DEPTH tokens
    draws = draw(model, heads, DYNAMIC, params, samples, seed=seed, runner_type=CudaGraphRunner)
    runner = draws.runner
    assert isinstance(runner, CudaGraphRunner) and runner.chain_graphs, "no tree step was captured"
    assert runner.tree_chains_started == samples, \
        f"{runner.tree_chains_started}/{samples} samples ran on the device chain"
    return draws


@pytest.mark.parametrize("name", list(SETTINGS))
def test_chained_tree_steps_on_device_are_exact_at_setting(exactness_contexts, name: str) -> None:
    """Issue 41: the device chain (real CUDA graphs, T > 0) at each production setting of
    tests/test_exactness_settings.py: the joint of three tokens and the third token's marginal fit the
    independent NumPy reference (its Bonferroni alpha), and enough first steps accepted depth 2 that
    the third token's draws after deep acceptances are tested."""
    from test_exactness_settings import assert_exact, reference_joint

    params = SETTINGS[name]
    joint = reference_joint(exactness_contexts, params)
    draws = device_chain_draws(params, DEVICE_CHAIN_SAMPLES, seed=61)
    assert_exact(draws, joint, f"device chain {name}", min_deep=0.1)


def test_device_chain_ignoring_temperature_is_rejected(exactness_contexts) -> None:
    """The negative control on the device: the chain sampling at T = 1 (top-k as asked) against the
    T = 0.5 reference must be rejected far beyond the positive threshold."""
    from test_exactness_settings import assert_rejected, reference_joint

    right = SETTINGS["T0.5-k3"]
    joint = reference_joint(exactness_contexts, right)
    wrong = SamplingParams(temperature=1.0, top_k=right.top_k)
    draws = device_chain_draws(wrong, DEVICE_CONTROL_SAMPLES, seed=67)
    assert_rejected(draws, joint, "device chain control T=1 for T=0.5")


def test_fused_forward_is_on_and_computes_the_reference_forward(bf16, mt_bench_prompts) -> None:
    """The bf16 engine runs the fused elementwise forward (runtime/fused.py), and its hidden states are the
    module-by-module forward's within bf16 rounding; the bitwise properties are the tests above."""
    from elesium.inference.runtime.fused import fused_forward
    from elesium.inference.runtime.model import Transformer

    model = bf16.model
    assert model.fused_pointwise, "invariant numerics are on, so the fused forward should be"
    ids = torch.tensor([bf16.encode_prompt(mt_bench_prompts[3])], device=model.device)
    n = ids.shape[1]
    with torch.inference_mode():
        fused_cache, plain_cache = model.new_cache(256), model.new_cache(256)
        positions = torch.arange(n, device=model.device)
        fused = fused_forward(model, ids, positions, fused_cache, 0, model.causal(n))
        model.fused_pointwise = False
        try:
            plain = Transformer.forward(model, ids, positions, plain_cache, 0)
        finally:
            model.fused_pointwise = True
    err = float((fused.float() - plain.float()).norm() / plain.float().norm())
    assert err < 2e-2, f"relative difference {err:.3g}"
    agree = (model.logits(fused[0]).argmax(-1) == model.logits(plain[0]).argmax(-1)).float().mean()
    assert agree > 0.9, f"greedy tokens agree at only {agree:.2f} of prompt positions"


def test_fused_kernels_bf16() -> None:
    """kernels/fused_pointwise.py in bf16 (the interpreter has none): near the fp64 reference, and a row's
    result in an N-row call is bitwise its 1-row result."""
    from elesium.inference.runtime.config import ModelConfig
    from elesium.inference.runtime.model import rope_tables
    from elesium.kernels.fused_pointwise import (
        add_rms_norm,
        add_rms_norm_reference,
        rope_qkv_to_cache,
        rope_qkv_to_cache_reference,
        swiglu,
        swiglu_reference,
    )

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.double() - b.double()).norm() / b.double().norm())

    g = torch.Generator(device="cuda").manual_seed(6)
    dev, bf = "cuda", torch.bfloat16
    x = (torch.randn(1, 40, 576, device=dev, generator=g) * 3).to(bf)
    d = torch.randn(1, 40, 576, device=dev, generator=g).to(bf)
    w = torch.randn(576, device=dev, generator=g).to(bf)
    total, normed = add_rms_norm(x, d, w, 1e-5)
    total_ref, normed_ref = add_rms_norm_reference(x.double(), d.double(), w.double(), 1e-5)
    assert rel(total, total_ref) < 1e-2 and rel(normed, normed_ref) < 1e-2
    gate_up = torch.randn(1, 40, 3072, device=dev, generator=g).to(bf)
    act = swiglu(gate_up)
    assert rel(act, swiglu_reference(gate_up.double())) < 1e-2
    cfg = ModelConfig(vocab_size=8, hidden_size=576, intermediate_size=8, num_layers=1, num_heads=9,
                      num_kv_heads=3, head_dim=64, max_position_embeddings=2048)
    cos_t, sin_t = (t.to(dev) for t in rope_tables(cfg, 2048))
    positions = torch.arange(1000, 1040, device=dev)[None]
    qkv = torch.randn(1, 40, 15 * 64, device=dev, generator=g).to(bf)
    kc = torch.zeros(1, 3, 2048, 64, device=dev, dtype=bf)
    vc = torch.zeros_like(kc)
    kr, vr = kc.double(), vc.double()
    cos, sin = cos_t[positions], sin_t[positions]
    q = rope_qkv_to_cache(qkv, cos, sin, kc, vc, torch.tensor(1000, device=dev), 9, 3)
    q_ref = rope_qkv_to_cache_reference(qkv.double(), cos, sin, kr, vr, 1000, 9, 3)
    assert rel(q, q_ref) < 1e-2 and rel(kc, kr) < 1e-2 and rel(vc, vr) < 1e-2
    for i in (0, 17, 39):
        one_total, one_normed = add_rms_norm(x[:, i:i + 1], d[:, i:i + 1], w, 1e-5)
        assert torch.equal(one_total[0, 0], total[0, i]) and torch.equal(one_normed[0, 0], normed[0, i])
        assert torch.equal(swiglu(gate_up[:, i:i + 1])[0, 0], act[0, i])
        k1, v1 = torch.zeros_like(kc), torch.zeros_like(vc)
        q1 = rope_qkv_to_cache(qkv[:, i:i + 1], cos[:, i:i + 1], sin[:, i:i + 1], k1, v1, 1000 + i, 9, 3)
        assert torch.equal(q1[:, :, 0], q[:, :, i])
        assert torch.equal(k1[:, :, 1000 + i], kc[:, :, 1000 + i])
        assert torch.equal(v1[:, :, 1000 + i], vc[:, :, 1000 + i])


def test_tree_chain_equals_host_tree_steps_and_vanilla(bf16, mt_bench_prompts) -> None:
    """Greedy speculative steps as one self-feeding graph (decoding/tree_chain.py: drafting, the tree on
    the device, verification, acceptance, K/V moves): vanilla's tokens, as the host tree step gives
    them; stops exact and harmless to the next run; a nearly full cache hands back to the host path."""
    runner = bf16.runner
    prompts = mt_bench_prompts[:PROMPTS]
    params = SamplingParams(max_tokens=TOKENS)
    vanilla = [bf16.generate(p, params, mode="vanilla").token_ids for p in prompts]

    def spec(chains: bool, prompt: str, p: SamplingParams = params):
        runner.tree_chains = chains
        try:
            return bf16.generate(prompt, p, mode="speculative")
        finally:
            runner.tree_chains = True

    chained = [spec(True, p) for p in prompts]
    assert runner.chain_graphs, "speculative decoding did not take the device tree step"
    host = [spec(False, p) for p in prompts]
    for i, (c, h, v) in enumerate(zip(chained, host, vanilla)):
        assert c.token_ids == v, f"prompt {i}: chained tree steps diverge at token {_diverge(c.token_ids, v)}"
        assert h.token_ids == v, f"prompt {i}: host tree steps diverge at token {_diverge(h.token_ids, v)}"
    taus = [c.mean_accepted for c in chained]
    print(f"tree chain: tau {taus} (host path {[h.mean_accepted for h in host]})")
    assert max(taus) > 1.5, "the chain accepted almost nothing: the check would be vacuous"
    for cut in (1, 2, 5):
        short = spec(True, prompts[0], SamplingParams(max_tokens=cut))
        assert short.token_ids == vanilla[0][:cut] and short.finish_reason == "length"
        assert spec(True, prompts[1]).token_ids == vanilla[1]  # steps in flight left no trace
    ids = bf16.encode_prompt(prompts[2])
    # Room for the chain to start, not to finish: a chain starts while the cache holds three steps' rows
    # and a tree past the offset (``start_tree_chain``), which depends on the device's profile (32 nodes
    # on the H200: 47 slots, 64 on an H100 without a profile: 79); 23 slots more, and more tokens asked
    # for than fit, so the cache fills and the chain hands back to the host before the end.
    assert bf16.heads is not None
    room = 3 * (bf16.heads.num_heads + 1) + bf16.policy.max_nodes + 23
    small = load("bfloat16", max_len=len(ids) + room)
    filling = SamplingParams(max_tokens=room + 26)
    full = small.generate(prompts[2], filling, mode="speculative")
    assert small.runner.chain_graphs, "the small engine's chain did not start"
    # Against the small engine's own vanilla run: attention spans the whole (smaller) cache, so its
    # sums are split differently from the large engine's and may round a near-tie differently.
    alone = small.generate(prompts[2], filling, mode="vanilla")
    assert full.finish_reason == alone.finish_reason == "length"
    assert full.token_ids == alone.token_ids, f"diverge at token {_diverge(full.token_ids, alone.token_ids)}"
    assert len(ids) + len(full.token_ids) >= small.context_length


def test_sliced_drafting_in_the_tree_chain_equals_vanilla(bf16, mt_bench_prompts) -> None:
    """The chain with its drafting's top-k selected in 1,024-wide slices (``draft_topk_chunk``,
    drafters/top_logprobs.py) captures a graph of its own, gives vanilla's tokens, and drafts as well
    as the reference form: the same candidates but for exact ties, which bf16 logits have often, so
    its trees may differ, but its acceptance must not be lower."""
    runner = bf16.runner
    assert runner.draft_topk_chunk == 1024, "the Triton top-k is the CUDA default"
    prompts = mt_bench_prompts[:PROMPTS]
    params = SamplingParams(max_tokens=TOKENS)
    vanilla = [bf16.generate(p, params, mode="vanilla").token_ids for p in prompts]
    runner.draft_topk_chunk = None
    try:
        assert bf16.forward_path == "cuda-graph-chains"
        reference = [bf16.generate(p, params, mode="speculative") for p in prompts]
    finally:
        runner.draft_topk_chunk = 1024
    assert bf16.forward_path == "cuda-graph-chains/topk-chunk-1024"
    sliced = [bf16.generate(p, params, mode="speculative") for p in prompts]
    assert any(key[3] == 1024 for key in runner.chain_graphs), "no chain ran with the sliced drafting"
    for i, (s, v) in enumerate(zip(sliced, vanilla)):
        assert s.token_ids == v, f"prompt {i}: sliced drafting diverges at token {_diverge(s.token_ids, v)}"
    ref_tau = sum(r.mean_accepted for r in reference) / len(reference)
    sliced_tau = sum(s.mean_accepted for s in sliced) / len(sliced)
    print(f"mean tau over {len(prompts)} prompts: reference drafting {ref_tau:.3f}, sliced {sliced_tau:.3f}")
    assert sliced_tau >= 0.95 * ref_tau, f"sliced drafting accepts less: tau {sliced_tau:.3f} < {ref_tau:.3f}"


def test_topk_kernel_bf16_is_topk_of_log_softmax() -> None:
    """The drafting's two-stage top-k kernel on real-sized bf16 rows (49,152 logits, the interpreter
    has no bf16): tokens in the reference's order with ties to the lower index, values to fp32 rounding."""
    from elesium.inference.drafters.top_logprobs import top_logprobs, top_logprobs_reference

    g = torch.Generator(device="cuda").manual_seed(5)
    logits = (torch.randn(9, 49152, generator=g, device="cuda") * 3).bfloat16()
    logits[4, 1000:1012] = 20.0  # a 12-way exact tie at the top
    idx, val = top_logprobs(logits, 10, 1024)
    _, ref_val = top_logprobs_reference(logits, 10)
    stable = torch.sort(torch.log_softmax(logits.float(), -1), dim=-1, descending=True, stable=True).indices
    assert torch.equal(idx, stable[:, :10])
    assert idx[4].tolist() == list(range(1000, 1010))
    torch.testing.assert_close(val, ref_val, rtol=0, atol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_drafter_tree_levels_equal_plain_levels_cuda(dtype: torch.dtype) -> None:
    """The drafter tree's fused levels (one rope gather a step, queries written in place, fused norms)
    against its plain levels on CUDA, as tests/test_invariant_kernels.py checks them through the
    interpreter in fp32: the same tokens and parents (bf16 too, which the interpreter lacks), close
    log-probabilities, and the same drafter-cache rows."""
    from elesium.inference.drafters.attention_drafter import FeatureDrafter
    from elesium.inference.drafters.drafter_tree import DrafterTree
    from elesium.inference.runtime.config import ModelConfig
    from elesium.inference.runtime.model import Transformer

    torch.manual_seed(5)
    config = ModelConfig(vocab_size=50, hidden_size=128, intermediate_size=96, num_layers=1, num_heads=2,
                         num_kv_heads=1, head_dim=64, max_position_embeddings=128)
    model = Transformer(config).eval().requires_grad_(False).to("cuda", dtype)
    drafter = FeatureDrafter.for_model(config)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    tree = DrafterTree(drafter, depth=5).eval().requires_grad_(False).to("cuda", dtype)
    first = torch.randn(1, 128, device="cuda", dtype=dtype)
    token, root = torch.tensor([7], device="cuda"), torch.tensor(20, device="cuda")
    k, v = drafter.new_cache(64 + tree.scratch_slots, "cuda", dtype)
    k.normal_(), v.normal_()
    caches = [(k, v), (k.clone(), v.clone())]
    with torch.inference_mode():
        plain = tree.expand(model, first, token, 4, 3, caches[0], root, fused=False)
        fused = tree.expand(model, first, token, 4, 3, caches[1], root, fused=True)
    assert torch.equal(plain[0], fused[0]) and torch.equal(plain[2], fused[2])
    # fp32: the two paths round differently (fused norms and RoPE against torch's ops); the first
    # device run measured 2.6e-5 relative on log-probabilities near -65.
    tol = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 0.0, "atol": 5e-2}
    torch.testing.assert_close(fused[1], plain[1], **tol)
    written = slice(21, 21 + 4 * 4)  # the level rows' slots: root + 1 ... past the last level's
    torch.testing.assert_close(caches[1][0][:, :, written], caches[0][0][:, :, written], **tol)


def test_drafter_tree_chain_equals_host_steps_and_vanilla(tmp_path, mt_bench_prompts) -> None:
    """An eagle drafter tree (drafters/drafter_tree.py: the attention drafter drafts every level through
    its cache's scratch rows) under CUDA graphs: the chained and host tree steps (both replay captured
    drafting) give vanilla's tokens in bf16, and levels past the second get accepted. That the static
    (whole-cache) drafting equals the eager one is tests/test_drafter_tree.py's, on the CPU."""
    from elesium.inference.drafters.drafter_tree import DrafterTree
    from elesium.inference.drafters.files import load_heads, read_manifest, save_heads

    manifest = read_manifest(None)
    shipped = load_heads(None, base_sha256=manifest["base_model"]["sha256"])
    tree = shipped if isinstance(shipped, DrafterTree) else DrafterTree(shipped.drafter, 5)
    save_heads(tree, tmp_path / "eagle", {"base_model": manifest["base_model"]}, storage="float")
    from elesium.config import Settings
    from elesium.inference.engine import Engine

    settings = Settings.from_env().with_overrides(invariant_numerics="on")
    engine = Engine.load(device="cuda", dtype="bfloat16", settings=settings, heads=tmp_path / "eagle")
    assert isinstance(engine.heads, DrafterTree)
    runner = engine.runner
    prompts = mt_bench_prompts[:PROMPTS]
    params = SamplingParams(max_tokens=TOKENS)
    vanilla = [engine.generate(p, params, mode="vanilla").token_ids for p in prompts]
    chained = [engine.generate(p, params, mode="speculative") for p in prompts]
    assert runner.chain_graphs, "speculative decoding did not take the device tree step"
    runner.tree_chains = False
    try:
        host = [engine.generate(p, params, mode="speculative") for p in prompts]
    finally:
        runner.tree_chains = True
    for i, (c, h, v) in enumerate(zip(chained, host, vanilla)):
        assert c.token_ids == v, f"prompt {i}: chained steps diverge at token {_diverge(c.token_ids, v)}"
        assert h.token_ids == v, f"prompt {i}: host steps diverge at token {_diverge(h.token_ids, v)}"
    deep = sum(s.accepted_length > 3 for g in host for s in g.steps)
    print(f"drafter tree: tau chained {[round(c.mean_accepted, 2) for c in chained]}, "
          f"host {[round(h.mean_accepted, 2) for h in host]}; host steps accepting > 2 drafts: {deep}")
    assert deep > 0, "no step accepted past level 2: the deeper levels would be untested"



def _in_threads(fn: Callable[[int], None], n: int, timeout: float) -> None:
    """``fn(0)`` ... ``fn(n - 1)`` on threads of their own, all started before any is waited for."""
    import threading

    threads = [threading.Thread(target=fn, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)

def _solo_vanilla(engine: Any, prompts: list[str], params: list[SamplingParams]) -> list[tuple[int, ...]]:
    """Each prompt's vanilla tokens alone, on the one-sequence graphs (the batcher set aside)."""
    batcher, engine.batcher = engine.batcher, None
    try:
        return [engine.generate(p, q, mode="vanilla").token_ids for p, q in zip(prompts, params, strict=True)]
    finally:
        engine.batcher = batcher


def test_batched_cuda_serving_gives_solo_tokens(mt_bench_prompts) -> None:
    """Batched serving on CUDA (``runtime/batched_cuda_step.py``, ``max_batch`` 16): 12 prompts of mixed
    lengths, vanilla greedy, vanilla seeded T = 0.7 and speculative greedy, each joining a few steps
    after the one before, get exactly the tokens the engine gives each alone on its own cache through
    the one-sequence graphs (decode chains, tree chains), with newcomers joining the step of the
    iteration that prefilled them (``join_early``) and without; the batched step's rows equal the
    one-sequence step's logits bitwise; and the step did batch."""
    import time

    from elesium.config import Settings
    from elesium.inference.engine import Engine

    settings = Settings.from_env().with_overrides(invariant_numerics="on", max_batch="16")
    engine = Engine.load(device="cuda", dtype="bfloat16", settings=settings)
    batcher = engine.batcher
    assert batcher is not None and batcher.slots == 16
    cases = [("vanilla", SamplingParams(max_tokens=48)),
             ("vanilla", SamplingParams(max_tokens=48, temperature=0.7, top_p=0.95, seed=7)),
             ("speculative", SamplingParams(max_tokens=48))]
    prompts = [p[: 40 + 61 * (i % 7)] for i, p in enumerate(mt_bench_prompts[:12])]

    def case(i: int) -> tuple[str, SamplingParams]:
        mode, params = cases[i % len(cases)]
        return mode, dataclasses.replace(params, seed=None if params.seed is None else params.seed + i)

    engine.batcher = None
    try:
        solo = [engine.generate(p, case(i)[1], mode=case(i)[0]).token_ids for i, p in enumerate(prompts)]
    finally:
        engine.batcher = batcher
    batcher.warm_up()
    for join_early in (False, True):  # newcomers join the step of the iteration that prefilled them, or next
        batcher.join_early = join_early
        joined = batcher.joined_early
        got: dict[int, tuple[int, ...]] = {}
        errors: list[BaseException] = []
        base = batcher.batched_steps + batcher.solo_steps

        def run(i: int) -> None:
            try:
                deadline = time.monotonic() + 120
                while (batcher.batched_steps + batcher.solo_steps < base + 2 * i
                       and time.monotonic() < deadline):
                    time.sleep(0.001)
                mode, params = case(i)
                got[i] = engine.generate(prompts[i], params, mode=mode).token_ids
            except BaseException as exc:  # reported below
                errors.append(exc)

        _in_threads(run, len(prompts), 300)
        assert not errors, errors
        assert batcher.largest_batch >= 4, f"they did not batch (largest batch {batcher.largest_batch})"
        for i in range(len(prompts)):
            assert got[i] == solo[i], (join_early, i, case(i), _diverge(got[i], solo[i]))
        assert (batcher.joined_early > joined) == join_early
    batcher.join_early = False
    # Row level: the bucket-4 graph's rows against the one-sequence graph on the engine's own cache.
    ids = [engine.encode_prompt(p)[:30 + 45 * i] for i, p in enumerate(mt_bench_prompts[:3])]
    runner, pool = engine.runner, batcher.pool
    solo_logits = []
    with torch.inference_mode():
        for i, slot in enumerate((2, 0, 5)):
            runner.prefill(ids[i])  # the engine's own cache, through the captured graphs
            solo_logits.append(runner.decode([ids[i][-1]], [len(ids[i])], len(ids[i])).logits[0].clone())
            pool.reserve(slot, pool.max_len)
            runner.cache = pool.cache(slot)
            try:
                runner.prefill(ids[i])
            finally:
                runner.cache = engine.cache
    step = batcher._step
    assert step is not None
    logits, picks = step.decode([x[-1] for x in ids], [len(x) for x in ids], [2, 0, 5])
    for row in range(3):
        assert torch.equal(logits[row], solo_logits[row]), row
        assert picks[row] == int(solo_logits[row].argmax())
    # Newcomers' prompt blocks prefilled together (the prefill graph's rows) against each prompt's
    # prefill on the engine's own cache: bitwise, a short block's padding included.
    with torch.inference_mode():
        own = [runner.prefill(x).clone() for x in ids]
    blocks = step.prefill([(7, ids[0][:64], 0), (3, ids[1][:64], 0), (4, ids[2][:64], 0)])
    second = step.prefill([(3, ids[1][64:128], 64), (4, ids[2][64:128], 64)])
    assert torch.equal(blocks[0], own[0][:64]) and torch.equal(blocks[1], own[1][:64])
    assert torch.equal(blocks[2], own[2][:64])
    assert torch.equal(second[0], own[1][64:128]) and torch.equal(second[1], own[2][64:128])
    assert batcher.prefill_rows > 0, "the batcher never prefilled through the shared forward"



@pytest.mark.parametrize("knob", ["overlap", "prefill_early"])
def test_batched_cuda_host_overlaps_give_solo_tokens(mt_bench_prompts, knob: str) -> None:
    """The loop's work beside a running chain, on CUDA: ``overlap`` (each greedy chain launched from the
    last one's tokens before they are handed out, read back by a later iteration) and ``prefill_early``
    (prompts that arrived during a chain admitted and their blocks launched before its tokens are handed
    out). Ten greedy prompts of mixed lengths and ``max_tokens`` (some not a multiple of the chain), joining
    a few steps apart, get exactly their solo tokens; the knob's path ran, and no chain is left in flight."""
    import time

    from elesium.config import Settings
    from elesium.inference.engine import Engine

    settings = Settings.from_env().with_overrides(invariant_numerics="on", max_batch="16")
    engine = Engine.load(device="cuda", dtype="bfloat16", settings=settings)
    batcher = engine.batcher
    assert batcher is not None
    prompts = [p[: 40 + 61 * (i % 7)] for i, p in enumerate(mt_bench_prompts[20:30])]
    params = [SamplingParams(max_tokens=64 - 5 * (i % 3)) for i in range(len(prompts))]
    solo = _solo_vanilla(engine, prompts, params)
    batcher.warm_up()
    setattr(batcher, knob, True)
    got: dict[int, tuple[int, ...]] = {}
    errors: list[BaseException] = []
    base = batcher.batched_steps

    def run(i: int) -> None:
        try:
            deadline = time.monotonic() + 120
            while batcher.batched_steps < base + 8 * i and time.monotonic() < deadline:
                time.sleep(0.001)
            time.sleep(0.003)  # past a chain's launch: it arrives while the chain runs
            got[i] = engine.generate(prompts[i], params[i], mode="vanilla").token_ids
        except BaseException as exc:  # reported below
            errors.append(exc)

    _in_threads(run, len(prompts), 300)
    assert not errors, errors
    ran = batcher.overlapped_chains if knob == "overlap" else batcher.early_prefills
    assert ran > 0, f"{knob} never ran"
    for i in range(len(prompts)):
        assert got[i] == solo[i], (i, _diverge(got[i], solo[i]))
    deadline = time.monotonic() + 10
    while batcher._in_flight is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert batcher._in_flight is None, "a chain was left in flight"


def test_batched_cuda_greedy_chains_equal_single_steps(mt_bench_prompts) -> None:
    """``BatchedCudaStep.decode_greedy`` (``CHAIN_STEPS`` greedy steps in one graph replay, each step's picks
    fed back on the device) gives three sequences the tokens and the keys and values of four single-step
    replays, bitwise, with or without newcomers' prompt blocks riding on its first forward (each block then
    the prefill graph's bits); and through the batcher six greedy generations with slow consumers, decoded in
    chains with the later ones' prompts riding on them, get their solo tokens (some with ``max_tokens`` not a
    multiple of the chain)."""
    import time

    from elesium.config import Settings
    from elesium.inference.engine import Engine

    settings = Settings.from_env().with_overrides(invariant_numerics="on", max_batch="8")
    engine = Engine.load(device="cuda", dtype="bfloat16", settings=settings)
    batcher = engine.batcher
    assert batcher is not None
    batcher.chain_steps = 4  # before warm-up, which captures the chains' graphs
    batcher.fold_prefill = True  # and the block-carrying ones
    prompts = [p[:60 + 70 * i] for i, p in enumerate(mt_bench_prompts[50:56])]
    params = [SamplingParams(max_tokens=64 - 3 * i) for i in range(len(prompts))]
    solo = _solo_vanilla(engine, prompts, params)
    engine.warm_up()
    step, pool, runner = batcher._step, batcher.pool, engine.runner
    assert step is not None
    ids = [engine.encode_prompt(p) for p in prompts[:3]]
    slots = [2, 0, 5]
    with torch.inference_mode():
        for x, slot in zip(ids, slots, strict=True):
            pool.reserve(slot, pool.max_len)
            runner.cache = pool.cache(slot)
            try:
                runner.prefill(x[:-1])
            finally:
                runner.cache = engine.cache
    k0, v0 = pool.k[slots].clone(), pool.v[slots].clone()
    picks: list[list[int]] = [[], [], []]
    tokens, offsets = [x[-1] for x in ids], [len(x) - 1 for x in ids]
    for _ in range(batcher.chain_steps):
        _, greedy = step.decode(tokens, offsets, slots)
        for row, token in zip(picks, greedy, strict=True):
            row.append(token)
        tokens, offsets = greedy, [o + 1 for o in offsets]
    stepped_k, stepped_v = pool.k[slots].clone(), pool.v[slots].clone()
    pool.k[slots], pool.v[slots] = k0, v0
    chained = step.decode_greedy([x[-1] for x in ids], [len(x) - 1 for x in ids], slots, batcher.chain_steps)
    assert chained == picks
    assert torch.equal(pool.k[slots], stepped_k) and torch.equal(pool.v[slots], stepped_v)
    # Two newcomers' prompt blocks riding on the chain's first forward (``decode_rows``): the same picks, and
    # each block the bits of the prefill graph's, keys and values too.
    # (MT-Bench questions 9 and 12 as templated here: none from question 60 on is 100 tokens long)
    encoded = (engine.encode_prompt(p) for p in mt_bench_prompts)
    newcomers = [x[:100] for x in encoded if len(x) >= 100][:2]  # the first in two blocks, 64 and 36
    assert len(newcomers) == 2
    blocks = [(6, newcomers[0][:64], 0), (7, newcomers[1][:64], 0), (6, newcomers[0][64:], 64)]
    for slot in (6, 7):
        pool.reserve(slot, pool.max_len)
    clean_k, clean_v = pool.k.clone(), pool.v.clone()
    alone = step.prefill(blocks)
    prefilled_k, prefilled_v = pool.k[[6, 7]].clone(), pool.v[[6, 7]].clone()
    pool.k.copy_(clean_k)
    pool.v.copy_(clean_v)
    pool.k[slots], pool.v[slots] = k0, v0
    riding = step.decode_rows([x[-1] for x in ids], [len(x) - 1 for x in ids], slots, batcher.chain_steps,
                              blocks)
    assert riding.picks == picks and len(riding.hidden) == 3
    for got_hidden, want in zip(riding.hidden, alone, strict=True):
        assert torch.equal(got_hidden, want)
    assert torch.equal(pool.k[slots], stepped_k) and torch.equal(pool.v[slots], stepped_v)
    assert torch.equal(pool.k[[6, 7]], prefilled_k) and torch.equal(pool.v[[6, 7]], prefilled_v)
    got: dict[int, tuple[int, ...]] = {}
    errors: list[BaseException] = []

    def consume(i: int) -> None:
        try:
            time.sleep(0.01 * i)
            with engine.stream(prompts[i], params[i], mode="vanilla") as stream:
                for _ in stream:
                    time.sleep(0.002)
                got[i] = stream.result.token_ids
        except BaseException as exc:  # reported below
            errors.append(exc)

    before, folded = batcher.chained_steps, batcher.folded_blocks
    _in_threads(consume, len(prompts), 120)
    assert not errors, errors
    assert batcher.chained_steps > before, "no batch ran as a chain"
    assert batcher.folded_blocks > folded, "no prompt block rode on a decode step"
    for i in range(len(prompts)):
        assert got[i] == solo[i], (i, _diverge(got[i], solo[i]))

def test_batched_cuda_deadline_drops_what_was_decoded_ahead(mt_bench_prompts) -> None:
    """Deadlines on CUDA, where the step loop decodes up to ``LOOKAHEAD`` tokens ahead of a consumer: three
    generations whose consumers stop asking after a few tokens are cut at their deadline with exactly the
    tokens they published (the ones decoded ahead are dropped), a prefix of their solo tokens, and their
    slots are free at once."""
    import time

    from elesium.config import Settings
    from elesium.inference.engine import Engine

    settings = Settings.from_env().with_overrides(invariant_numerics="on", max_batch="4")
    engine = Engine.load(device="cuda", dtype="bfloat16", settings=settings)
    batcher = engine.batcher
    assert batcher is not None and batcher.lookahead > 0
    prompts = [p[:200] for p in mt_bench_prompts[30:33]]
    engine.batcher = None
    try:
        solo = [engine.generate(p, SamplingParams(max_tokens=96), mode="vanilla").token_ids for p in prompts]
    finally:
        engine.batcher = batcher
    engine.warm_up()
    got: dict[int, tuple[tuple[int, ...], list[int], str]] = {}
    errors: list[BaseException] = []

    def consume(i: int) -> None:
        try:
            stream = engine.stream(prompts[i], SamplingParams(max_tokens=96, deadline_s=5.0), mode="vanilla")
            seen: list[int] = []
            for chunk in stream:
                seen.extend(chunk.token_ids)
                if len(seen) >= 6:
                    time.sleep(max(0.0, stream._run.deadline - time.perf_counter()) + 0.05)
            got[i] = (stream.result.token_ids, seen, stream.result.finish_reason)
        except BaseException as exc:  # reported below
            errors.append(exc)

    ahead_before = batcher.ahead_rows
    _in_threads(consume, 3, 120)
    assert not errors, errors
    assert batcher.ahead_rows > ahead_before, "nothing was decoded ahead: the drop is untested"
    for i in range(3):
        tokens, seen, finish = got[i]
        assert finish == "deadline" and list(tokens) == seen, (i, finish, len(tokens), len(seen))
        assert 6 <= len(tokens) < len(solo[i]), (i, len(tokens), len(solo[i]))
        assert tokens == solo[i][:len(tokens)], (i, _diverge(tokens, solo[i]))
    assert batcher.running == 0
