"""Exactness under a grammar constraint: the target is the masked, renormalised distribution.

On the tiny 8-token model (``spec_harness``) with a toy byte vocabulary ("a".."g" plus an end token),
a regex whose allowed next tokens depend on the previous one gives every tree node its own mask. The
exact joint of the next two tokens under *vanilla constrained* sampling is enumerated by replaying the
grammar along each sequence; the speculative decoder's samples must fit it (chi-square, as in
``test_exactness.py``), every tree must hold only tokens the grammar allows on its path, and greedy
speculative output must equal greedy vanilla output. A negative control that masks every node with
the root's state (ignoring the path) must fail the fit, so the test can see a wrong mask.
"""

from __future__ import annotations

import itertools

import llguidance as llg
import pytest
import torch

from elesium.inference.constraints import ConstrainedDrafts, Constraint, GrammarState
from elesium.inference.decoding.speculative import TreeDecoder
from elesium.inference.decoding.tree_policy import TreePolicy
from elesium.inference.decoding.vanilla import VanillaDecoder
from elesium.inference.runtime.forward import ForwardRunner
from elesium.inference.runtime.model import Transformer
from elesium.inference.sampling import Sampler, SamplingParams, target_probs
from spec_harness import VOCAB, RandomHeads, chi_square_p, random_hydra_heads, speculative_samples, tiny_model

SAMPLES = 8_000
PREFIX, FIRST = [1, 2, 3], 4  # FIRST is "e", the grammar's required first token
EOS = 7
# After "e": pairs whose second letter depends on the first, or the end (the pattern is complete).
PATTERN = "e(a[b-g]|b[a-d]|c[c-f]|d[a-g]|e[ag]|f[b-d]|g[ef])*"
STATIC = TreePolicy(kind="static", static_paths=((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (2, 0)))
DYNAMIC = TreePolicy(kind="dynamic", max_nodes=10, topk=4)


class _ToyBytes:
    """A byte vocabulary for llguidance: token i is letter i, token 7 the end of the turn."""

    eos_token_id = EOS
    bos_token_id = None
    tokens = [b"a", b"b", b"c", b"d", b"e", b"f", b"g", b"<eos>"]
    special_token_ids = [EOS]

    def __call__(self, text: str | bytes) -> list[int]:
        data = text if isinstance(text, bytes) else text.encode()
        return [b"abcdefg".index(bytes([c])) for c in data]


@pytest.fixture(scope="module", autouse=True)
def single_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def toy_tokenizer() -> llg.LLTokenizer:
    return llg.LLTokenizer(llg.TokenizerWrapper(_ToyBytes()))


@pytest.fixture(scope="module")
def after_first(toy_tokenizer) -> GrammarState:
    state = Constraint.regex(PATTERN).start(toy_tokenizer)
    state.advance(FIRST)
    return state


@pytest.fixture(scope="module")
def tiny():
    return tiny_model(0), RandomHeads(32, 3, seed=1)


@torch.inference_mode()
def constrained_joint(model: Transformer, state: GrammarState, params: SamplingParams, n: int) -> dict:
    """P(next n tokens) after ``PREFIX + [FIRST]`` under vanilla constrained sampling, by enumeration."""
    out: dict[tuple[int, ...], float] = {}
    for seq in itertools.product(range(VOCAB), repeat=n):
        ids = PREFIX + [FIRST] + list(seq)
        cache = model.new_cache(len(ids) + 1)
        logits = model.logits(model(torch.tensor([ids]), torch.arange(len(ids)), cache, 0)[0])
        p, walk = 1.0, state.copy()
        for i, tok in enumerate(seq):
            allowed = walk.mask(VOCAB)
            p *= float(target_probs(logits[len(PREFIX) + i], params, allowed)[tok])
            nxt = walk.advanced(tok)
            if p == 0.0 or nxt is None:
                p = 0.0
                break
            walk = nxt
        out[seq] = p
    return out


def _watch_trees(decoder: TreeDecoder, seen: list[tuple[ConstrainedDrafts, object]]) -> None:
    """Record every step's (drafts, tree), to check what the tree held."""
    build = decoder.policy.build

    def recording(drafts):
        tree = build(drafts)
        # The root state is the decoder's own, advanced in place after the step: keep a copy.
        seen.append((drafts, tree, drafts.state(()).copy()))
        return tree

    decoder.policy.build = recording  # type: ignore[method-assign]


def constrained_samples(model, heads, policy: TreePolicy, state: GrammarState, params: SamplingParams, n: int,
                        samples: int, seed: int, seen: list | None = None) -> dict:
    """Counts of the next ``n`` tokens the tree decoder commits under the grammar after ``FIRST``."""
    watch = None if seen is None else (lambda dec: _watch_trees(dec, seen))
    return speculative_samples(model, heads, policy, PREFIX, FIRST, params, n, samples, seed,
                               grammar=state, on_decoder=watch)


def assert_no_forbidden_nodes(seen: list) -> int:
    """Every node of every recorded tree is allowed after its own path; returns drafts pruned."""
    pruned = 0
    for drafts, tree, start in seen:
        assert isinstance(drafts, ConstrainedDrafts)
        for node in range(1, tree.size):
            walk = start
            for i in range(1, len(tree.paths[node]) + 1):
                token = drafts.token(tree.paths[node][:i])
                nxt = walk.advanced(token)
                assert nxt is not None, f"tree node {node} holds token {token}, which the grammar forbids"
                walk = nxt
        # What the heads proposed at the root versus what the tree could use there.
        inner_root = [drafts.inner.token((r,)) for r in range(drafts.inner.num_children(()))]
        pruned += sum(not start.allows(t) for t in inner_root)
    return pruned


@pytest.mark.parametrize(("temperature", "policy"), [(0.7, STATIC), (1.3, DYNAMIC)],
                         ids=["static-T0.7", "dynamic-T1.3"])
def test_constrained_speculative_sampling_is_exact(tiny, after_first, temperature, policy):
    model, heads = tiny
    params = SamplingParams(temperature=temperature, top_p=0.9)
    expected = constrained_joint(model, after_first, params, 2)
    assert sum(expected.values()) == pytest.approx(1.0, abs=1e-6)
    # The grammar really constrains: many pairs are impossible, and the masks differ by path.
    assert sum(p == 0.0 for p in expected.values()) >= 20
    seen: list = []
    counts = constrained_samples(model, heads, policy, after_first, params, 2, SAMPLES, seed=7, seen=seen)
    p = chi_square_p(counts, expected, SAMPLES)
    print(f"constrained {policy.kind} T={temperature}: chi-square p = {p:.3f}")
    assert p > 0.01, f"constrained speculative samples do not fit the masked target (p = {p:.2e})"
    pruned = assert_no_forbidden_nodes(seen[:500])
    assert pruned > 0, "the random heads never proposed a forbidden draft: pruning went untested"
    assert any(tree.size > 2 for _, tree, _ in seen), "trees never held drafts past the root"


def test_constrained_hydra_sampling_is_exact(tiny, after_first):
    """Hydra heads draft a list per parent; pruning and per-node masks must not care."""
    model, _ = tiny
    heads = random_hydra_heads(32, 3, seed=2, conditioning="chain")
    params = SamplingParams(temperature=1.0, top_p=0.9)
    expected = constrained_joint(model, after_first, params, 2)
    seen: list = []
    counts = constrained_samples(model, heads, DYNAMIC, after_first, params, 2, SAMPLES, seed=11, seen=seen)
    p = chi_square_p(counts, expected, SAMPLES)
    print(f"constrained hydra: chi-square p = {p:.3f}")
    assert p > 0.01
    assert_no_forbidden_nodes(seen[:500])


def test_negative_control_root_mask_everywhere_fails(tiny, after_first, monkeypatch):
    """A decoder that masks every node with the root's state (ignoring the path) is caught."""
    model, heads = tiny
    monkeypatch.setattr(ConstrainedDrafts, "state", lambda self, path: self._states[()])
    params = SamplingParams(temperature=1.0, top_p=0.9)
    expected = constrained_joint(model, after_first, params, 2)
    counts = constrained_samples(model, heads, STATIC, after_first, params, 2, 3_000, seed=7)
    p = chi_square_p(counts, expected, 3_000)
    print(f"negative control (root mask everywhere): chi-square p = {p:.3e}")
    assert p < 0.01


@torch.inference_mode()
@pytest.mark.parametrize("policy", [STATIC, DYNAMIC], ids=["static", "dynamic"])
def test_constrained_greedy_speculative_equals_vanilla(tiny, toy_tokenizer, policy):
    model, heads = tiny
    constraint = Constraint.regex(PATTERN)
    params = SamplingParams()
    prompt = [4, 1, 2]
    outputs = []
    for make in ("vanilla", "tree"):
        cache = model.new_cache(128)
        runner = ForwardRunner(model, cache, None)
        grammar = constraint.start(toy_tokenizer)
        dec = (VanillaDecoder(runner, params, Sampler(0), grammar) if make == "vanilla" else
               TreeDecoder(runner, heads, params, Sampler(0), TreePolicy(**{
                   "kind": policy.kind, "static_paths": policy.static_paths, "max_nodes": policy.max_nodes,
                   "topk": policy.topk, "adapt": False}), grammar=grammar))
        tokens = [dec.prefill(prompt)]
        while len(tokens) < 24 and tokens[-1] != EOS:
            tokens.extend(dec.step(128 - dec.offset)[0])
        outputs.append(tokens[:24] if EOS not in tokens else tokens[:tokens.index(EOS) + 1])
    vanilla, tree = outputs
    assert tree == vanilla
    text = bytes(b"abcdefg"[t] for t in vanilla if t != EOS).decode()
    import re

    assert re.fullmatch(PATTERN, text) or re.fullmatch(PATTERN + "[a-g]", text), text
