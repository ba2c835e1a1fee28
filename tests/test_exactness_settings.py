"""Exactness at production settings: T != 1, top-k, top-p, three tokens deep, against a NumPy reference.

``test_exactness.py`` fits two-token samples to a joint built with the project's own ``target_probs``,
at top-p 0.9 only. Here the expected distribution comes from an independent NumPy implementation of
the documented sampling semantics (``inference/sampling.py``: grammar mask, then temperature, then
top-k keeping every token tied with the k-th, then top-p keeping a token while the mass strictly
before it, in descending order, is below ``top_p``, then renormalise), computed in float64 from the
tiny model's logits (its plain forward, one per prefix). The decoder draws three tokens after a fixed
context, so the third is often the draw made after accepting a depth-2 tree node (asserted from the
step records), and both the 512-cell joint and the exact marginal of the third token (summed over
every prefix, each prefix's conditional from its own forward) are held to a Pearson chi-square fit.

Paths: the eager tree decoder (``ForwardRunner``), the CPU fast path's compiled step
(``CompiledCpuRunner``, inductor), grammar-constrained decoding, and the self-feeding tree chain (the
CUDA path, its body run eagerly by ``helpers.ChainRunner``). Negative controls run the real
decoder with a wrong setting (temperature 1 instead of 0.5; top-k dropped) against the right
reference: the same statistic must reject them by a wide margin, so a sampler that ignored the
setting would fail the positive tests.

The positive fits share a family-wise false-failure rate of ``FAMILY_ALPHA`` (Bonferroni).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import llguidance as llg
import numpy as np
import pytest
import torch
from scipy import stats

from elesium.inference.constraints import Constraint, GrammarState
from elesium.inference.decoding import speculative
from elesium.inference.decoding.speculative import TreeDecoder
from elesium.inference.decoding.tree import Tree
from elesium.inference.decoding.tree_policy import TreePolicy
from elesium.inference.decoding.verify import NodeMasks, Verdict
from elesium.inference.drafters.protocol import DraftHeads
from elesium.inference.records import StepRecord
from elesium.inference.runtime.cpu_step import CompiledCpuRunner
from elesium.inference.runtime.drafting import StepDrafter
from elesium.inference.runtime.forward import ForwardRunner
from elesium.inference.runtime.model import KVCache, Transformer
from elesium.inference.sampling import Sampler, SamplingParams, target_probs
from helpers import ChainRunner
from spec_harness import (
    VOCAB,
    RandomHeads,
    random_hydra_heads,
    speculative_samples,
    tiny_model,
    with_random_drafter,
)

Seq = tuple[int, ...]
Dist = dict[Seq, float]

PREFIX, FIRST = [1, 2, 3], 4  # the context; FIRST is the pending token the first tree step roots at
DEPTH = 3  # tokens drawn after FIRST: the third is drawn after a depth-2 node whenever a step accepts one
# Wide trees, so that most first steps accept depth 2 and the third token is the draw made there (the
# tiny model's cache holds 64 slots: a tree must fit after the context). Static: ranks 0-6 at depth 1,
# 0-4 under each at depth 2, four depth-3 paths (46 drafts); Medusa-shaped heads draft one list a depth.
WIDE = TreePolicy(kind="static", static_paths=tuple(
    [(i,) for i in range(7)] + [(i, j) for i in range(7) for j in range(5)]
    + [(0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0)]))
DYNAMIC = TreePolicy(kind="dynamic", max_nodes=46, topk=8)

# Production-like settings on the 8-token vocabulary (top-k scaled to it: top_k >= 8 would be a no-op).
SETTINGS = {
    "T0.5-k3": SamplingParams(temperature=0.5, top_k=3),
    "T0.7-p0.9": SamplingParams(temperature=0.7, top_p=0.9),
    "T1.5-k5-p0.95": SamplingParams(temperature=1.5, top_k=5, top_p=0.95),
}

EAGER_SAMPLES = 6_000  # ~1.5 ms each on one thread
COMPILED_SAMPLES = 3_000  # ~4.5 ms each (Hydra heads and their drafter draft on the host)
CHAINED_SAMPLES = 2_000  # ~5.5 ms each
CONSTRAINED_SAMPLES = 5_000  # ~2 ms each
CONTROL_SAMPLES = 3_000

# Positive fits: (eager + compiled + constrained + chained) x settings x (joint, third-token marginal),
# and the first two tokens of the deep-draw control (which must still fit).
POSITIVE_FITS = 4 * len(SETTINGS) * 2 + 1
FAMILY_ALPHA = 1e-4
ALPHA = FAMILY_ALPHA / POSITIVE_FITS  # per fit: P(any false failure in the file) <= 1e-4
CONTROL_P = 1e-30  # a negative control must be rejected this hard, far beyond ALPHA

# Grammar on a toy byte vocabulary ("a".."g", 7 = end): after "e", one letter a-f, then one or more
# pairs whose second letter depends on the first. Tokens 1 and 3 are masked, token 3 by a mask that
# depends on token 2 (the path), and the end token is impossible within DEPTH tokens.
EOS = 7
PAIRS = "(a[b-g]|b[a-d]|c[c-f]|d[a-g]|e[ag]|f[b-d]|g[ef])"
PATTERN = f"e[a-f]{PAIRS}+"


@pytest.fixture(scope="module", autouse=True)
def single_thread():
    """Thousands of tiny forwards: thread hand-offs would cost more than the arithmetic."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model() -> Transformer:
    """The 8-token, one-layer model of ``spec_harness``: every three-token joint can be enumerated."""
    return tiny_model(0)


@pytest.fixture(scope="module")
def contexts(model: Transformer) -> dict[Seq, np.ndarray]:
    """Logits after every prefix of up to two tokens: the reference's conditionals come from these."""
    return context_logits(model)


class _ToyBytes:
    """A byte vocabulary for llguidance: token i is letter i, token 7 the end of the turn."""

    eos_token_id = EOS
    bos_token_id = None
    tokens = [b"a", b"b", b"c", b"d", b"e", b"f", b"g", b"<eos>"]
    special_token_ids = [EOS]

    def __call__(self, text: str | bytes) -> list[int]:
        data = text if isinstance(text, bytes) else text.encode()
        return [b"abcdefg".index(bytes([c])) for c in data]


@pytest.fixture(scope="module")
def after_first() -> GrammarState:
    """The grammar's state after FIRST ("e"): where every sample's constrained continuation starts."""
    state = Constraint.regex(PATTERN).start(llg.LLTokenizer(llg.TokenizerWrapper(_ToyBytes())))
    state.advance(FIRST)
    return state


# --- the independent reference ----------------------------------------------------------------------


def reference_probs(logits: np.ndarray, params: SamplingParams, allowed: np.ndarray | None = None,
                    margin: float = 1e-5) -> np.ndarray:
    """The documented target distribution in float64 NumPy, written without ``target_probs``.

    Mask (forbidden logits -> -inf), divide by the temperature, top-k (keep every token whose scaled
    logit is >= the k-th largest, so ties with the k-th stay), softmax, top-p (in descending
    probability order keep a token while the mass strictly before it is < top_p), renormalise.
    The product computes this in float32, so a decision within ``margin`` of its threshold (a logit tied
    with the k-th, a cumulative mass at top_p) could go either way there: such a reference is refused
    rather than trusted, so the test never fails on a knife edge.
    """
    x = np.asarray(logits, dtype=np.float64)
    if allowed is not None:
        x = np.where(allowed, x, -np.inf)
    x = x / params.temperature
    if 0 < params.top_k < x.shape[-1]:
        kth = np.sort(x)[-params.top_k]
        finite = x[np.isfinite(x)]
        if np.isfinite(kth):
            near = np.abs(finite - kth) < margin * max(1.0, abs(kth))
            assert near.sum() == 1, f"a scaled logit is tied with the top-k threshold {kth}: ambiguous"
        x = np.where(x >= kth, x, -np.inf)
    p = np.exp(x - x.max())
    p /= p.sum()
    if params.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        sorted_p = p[order]
        before = np.cumsum(sorted_p) - sorted_p
        live = sorted_p > 0
        assert not np.any(live & (np.abs(before - params.top_p) < margin)), "top-p boundary is ambiguous"
        kept = np.zeros_like(p)
        kept[order] = np.where(before < params.top_p, sorted_p, 0.0)
        p = kept / kept.sum()
    return p


@torch.inference_mode()
def context_logits(model: Transformer) -> dict[Seq, np.ndarray]:
    """float64 logits of the token after ``PREFIX + [FIRST] + s`` for every ``s`` of 0..DEPTH-1 tokens.

    One plain (prefill) forward per two-token continuation gives the logits at all three depths; the
    decoder computes the same rows through its own tree forward, to float32 rounding.
    """
    out: dict[Seq, np.ndarray] = {}
    base = PREFIX + [FIRST]
    for seq in itertools.product(range(VOCAB), repeat=DEPTH - 1):
        ids = base + list(seq)
        cache = model.new_cache(len(ids) + 1)
        logits = model.logits(model(torch.tensor([ids]), torch.arange(len(ids)), cache, 0)[0])
        rows = logits.double().numpy()
        for d in range(DEPTH):
            out[seq[:d]] = rows[len(base) - 1 + d]
    return out


def reference_joint(contexts: dict[Seq, np.ndarray], params: SamplingParams,
                    grammar: GrammarState | None = None) -> Dist:
    """P(the DEPTH tokens after FIRST) under vanilla sampling, from the reference conditionals.

    ``grammar`` (its state after FIRST) masks each position by the state along that sequence's own path.
    """
    states: dict[Seq, GrammarState | None] = {(): grammar}
    cond: dict[Seq, np.ndarray] = {}

    def conditional(prefix: Seq) -> np.ndarray:
        if prefix not in cond:
            state = states[prefix]
            allowed = None if state is None else state.mask(VOCAB).numpy()
            cond[prefix] = reference_probs(contexts[prefix], params, allowed)
        return cond[prefix]

    joint: Dist = {}
    for seq in itertools.product(range(VOCAB), repeat=DEPTH):
        p = 1.0
        for d, tok in enumerate(seq):
            p *= float(conditional(seq[:d])[tok])
            if p == 0.0:
                break
            if seq[:d + 1] not in states:
                parent = states[seq[:d]]
                states[seq[:d + 1]] = None if parent is None else parent.advanced(tok)
                assert parent is None or states[seq[:d + 1]] is not None, "the mask allowed a dead token"
        joint[seq] = p
    total = sum(joint.values())
    assert abs(total - 1.0) < 1e-9, total
    return joint


def marginal(dist: dict[Seq, float] | dict[Seq, int], position: int) -> dict[Seq, float]:
    """The distribution (or counts) of the token at ``position`` (0-based), summed over the others."""
    out: dict[Seq, float] = {}
    for seq, v in dist.items():
        out[(seq[position],)] = out.get((seq[position],), 0.0) + v
    return out


def leading(dist: dict[Seq, float], n: int) -> dict[Seq, float]:
    """The distribution (or counts) of the first ``n`` tokens, summed over the rest."""
    out: dict[Seq, float] = {}
    for seq, v in dist.items():
        out[seq[:n]] = out.get(seq[:n], 0.0) + v
    return out


# --- the statistic ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fit:
    """A Pearson goodness of fit: ``impossible`` counts draws on cells the reference gives 0."""

    statistic: float
    dof: int
    p: float
    impossible: int

    def __str__(self) -> str:
        return (f"chi2 = {self.statistic:.1f} on {self.dof} dof, p = {self.p:.3g}, "
                f"impossible draws {self.impossible}")


def pearson_fit(counts: dict[Seq, float], probs: dict[Seq, float]) -> Fit:
    """Pearson chi-square of ``counts`` against ``probs``; cells expecting < 5 draws pool into one.

    Zero-probability cells pool too, so draws the reference forbids inflate the pooled bin (a finite,
    huge statistic) rather than dividing by zero; the pool joins the smallest other cell if it still
    expects < 5.
    """
    n = sum(counts.values())
    keys = sorted(set(probs) | set(counts))
    observed = np.array([counts.get(k, 0) for k in keys], dtype=np.float64)
    expected = np.array([probs.get(k, 0.0) for k in keys], dtype=np.float64) * n
    impossible = int(observed[expected == 0].sum())
    big = expected >= 5
    obs, exp = list(observed[big]), list(expected[big])
    if (~big).any():
        pool_o, pool_e = float(observed[~big].sum()), float(expected[~big].sum())
        if pool_e >= 5 or not exp:
            obs.append(pool_o)
            exp.append(pool_e)
        else:
            i = int(np.argmin(exp))
            obs[i] += pool_o
            exp[i] += pool_e
    assert len(obs) >= 2, "a single bin tests nothing"
    result = stats.chisquare(np.array(obs), np.array(exp))
    return Fit(float(result.statistic), len(obs) - 1, float(result.pvalue), impossible)


# --- drawing from the real decoder ------------------------------------------------------------------


@dataclass
class Draws:
    """Counts of the DEPTH tokens after FIRST, and each sample's step records (to see what was accepted)."""

    counts: dict[Seq, int]
    records: list[list[StepRecord]]
    runner: ForwardRunner  # the one runner every sample stepped through

    @property
    def deep_first_steps(self) -> int:
        """Samples whose first step accepted a node at depth >= 2 (committed >= 3 tokens): their third
        token was drawn after that acceptance (the bonus at depth 2, or a depth-3 draft kept)."""
        return sum(recs[0].accepted_length >= 3 for recs in self.records)


def draw(model: Transformer, heads: DraftHeads, policy: TreePolicy, params: SamplingParams, samples: int,
         seed: int, runner_type: type[ForwardRunner] = ForwardRunner,
         grammar: GrammarState | None = None) -> Draws:
    """``samples`` seeded speculative generations of DEPTH tokens after ``PREFIX + [FIRST]``, through the
    harness's decoder loop, with every step's record kept."""
    records: list[list[StepRecord]] = []
    runners: list[ForwardRunner] = []

    def watch(decoder: TreeDecoder) -> None:
        mine: list[StepRecord] = []
        records.append(mine)
        runners.append(decoder.runner)
        inner = decoder.step

        def step(room: int | None = None) -> tuple[list[int], StepRecord]:
            tokens, record = inner(room)
            mine.append(record)
            return tokens, record

        decoder.step = step  # type: ignore[method-assign]

    counts = speculative_samples(model, heads, policy, PREFIX, FIRST, params, DEPTH, samples, seed=seed,
                                 grammar=grammar, on_decoder=watch, runner_type=runner_type)
    assert len(records) == samples and len(set(map(id, runners))) == 1
    return Draws(counts, records, runners[0])


def fits(draws: Draws, joint: Dist) -> dict[str, Fit]:
    """The joint of all DEPTH tokens and the marginal of the last one, each against the reference."""
    counts: dict[Seq, float] = {k: float(v) for k, v in draws.counts.items()}
    return {"joint": pearson_fit(counts, joint),
            f"token {DEPTH}": pearson_fit(marginal(counts, DEPTH - 1), marginal(joint, DEPTH - 1))}


def assert_exact(draws: Draws, joint: Dist, label: str, min_deep: float) -> None:
    """Both fits pass at the Bonferroni level, no draw is impossible, and at least ``min_deep`` of the
    samples' third tokens were drawn after a depth >= 2 acceptance (so position 3 tests deep draws)."""
    n = len(draws.records)
    deep = draws.deep_first_steps
    results = fits(draws, joint)
    for name, fit in results.items():
        print(f"{label} {name}: {fit}")
    print(f"{label}: {deep}/{n} first steps accepted depth >= 2")
    assert deep >= min_deep * n, f"only {deep}/{n} first steps accepted depth >= 2: deep draws untested"
    for name, fit in results.items():
        assert fit.impossible == 0, f"{label} {name}: {fit.impossible} draws the reference forbids"
        assert fit.p > ALPHA, f"{label} {name}: samples do not fit the reference ({fit})"


# --- the paths --------------------------------------------------------------------------------------


class CompiledCpuStep(CompiledCpuRunner):
    """The CPU fast path's runner with its inductor graphs (the production CPU decode step)."""

    def __init__(self, model: Transformer, cache: KVCache, heads: StepDrafter | None = None) -> None:
        super().__init__(model, cache, heads, compiled=True)


def test_reference_matches_documented_semantics_by_hand():
    """The reference on hand-made rows: ties with the k-th survive top-k, top-p keeps the token that
    crosses the threshold, the mask applies before top-k."""
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.1]))
    p = reference_probs(logits, SamplingParams(temperature=1.0, top_p=0.65))
    np.testing.assert_allclose(p, [0.4 / 0.7, 0.3 / 0.7, 0, 0])  # 0.4 < 0.65, then 0.7 crosses it
    p = reference_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    np.testing.assert_allclose(p, [0.4 / 0.7, 0.3 / 0.7, 0, 0])
    p = reference_probs(logits, SamplingParams(temperature=0.5, top_k=3),
                        allowed=np.array([False, True, True, True]))
    np.testing.assert_allclose(p, np.array([0, 0.09, 0.04, 0.01]) / 0.14)
    with pytest.raises(AssertionError, match="tied"):
        reference_probs(np.array([3.0, 1.0, 1.0, 0.0]), SamplingParams(temperature=1.0, top_k=2))


def test_reference_agrees_with_target_probs_on_every_row(contexts, after_first):
    """A cross-check, not the reference: the product's float32 ``target_probs`` on every logit row the
    fits use (masked too, by the state along that row's path) equals the NumPy reference to rounding.
    The fits below still test the decoder against the reference alone."""
    for params in SETTINGS.values():
        for prefix, row in contexts.items():
            state: GrammarState | None = after_first
            for tok in prefix:
                state = None if state is None else state.advanced(tok)
            for allowed in [None] + ([] if state is None else [state.mask(VOCAB)]):
                want = reference_probs(row, params, None if allowed is None else allowed.numpy())
                got = target_probs(torch.tensor(row, dtype=torch.float32), params, allowed).double().numpy()
                np.testing.assert_allclose(got, want, rtol=0, atol=1e-6, err_msg=f"{params} after {prefix}")


@pytest.mark.parametrize("name", list(SETTINGS))
def test_eager_tree_decoder_is_exact_at_setting(model, contexts, name):
    """Medusa-shaped random heads on the wide static tree, verified through the plain eager forward."""
    params = SETTINGS[name]
    joint = reference_joint(contexts, params)
    draws = draw(model, RandomHeads(32, 3, seed=1), WIDE, params, EAGER_SAMPLES, seed=31)
    assert_exact(draws, joint, f"eager {name}", min_deep=0.5)


@pytest.fixture(scope="module")
def fresh_dynamo() -> None:
    """Start the compiled tests from an empty dynamo cache (other modules' graphs count towards its
    recompile limit), so the graph counter below sees this file's graph."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()


@pytest.mark.parametrize("name", list(SETTINGS))
def test_compiled_cpu_step_is_exact_at_setting(model, contexts, fresh_dynamo, name):
    """Hydra heads with an attention drafter (the shipped kind) on the dynamic policy, verified through
    the compiled CPU step (inductor; every step here is a tree, so one graph, ~20 s cold on 2 cores,
    then inductor's cache): the production CPU sampling path."""
    params = SETTINGS[name]
    joint = reference_joint(contexts, params)
    hydra = random_hydra_heads(32, 3, seed=6, conditioning="concat")
    heads = with_random_drafter(hydra, model.config, seed=8)
    draws = draw(model, heads, DYNAMIC, params, COMPILED_SAMPLES, seed=37, runner_type=CompiledCpuStep)
    # The steps really ran inductor's graph (dynamo traced it), not an eager fallback.
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1
    assert_exact(draws, joint, f"compiled cpu step {name}", min_deep=0.08)


@pytest.mark.parametrize("name", list(SETTINGS))
def test_constrained_decoder_is_exact_at_setting(model, contexts, after_first, name):
    """Under the grammar the target is the masked distribution, top-k and top-p among allowed tokens."""
    params = SETTINGS[name]
    joint = reference_joint(contexts, params, after_first)
    # The grammar bites at every position: whole first tokens, and third tokens by their path.
    assert marginal(joint, 0)[(6,)] == 0.0 and marginal(joint, 0)[(EOS,)] == 0.0
    assert any(joint[(a, b, c)] == 0.0 < joint[(a, b2, c)]
               for a, b, b2, c in itertools.product(range(6), range(7), range(7), range(7)))
    draws = draw(model, RandomHeads(32, 3, seed=1), WIDE, params, CONSTRAINED_SAMPLES, seed=41,
                 grammar=after_first.copy())
    assert_exact(draws, joint, f"constrained {name}", min_deep=0.5)


@pytest.mark.parametrize("name", list(SETTINGS))
def test_chained_tree_step_is_exact_at_setting(model, contexts, name):
    """The self-feeding tree step (``decoding/tree_chain.py``, CUDA's path at T > 0), its body run eagerly
    on the CPU by ``helpers.ChainRunner``: drafting, the device tree and acceptance with the
    generation's uniforms. ``test_exactness.py`` runs it at T = 1 and top-p 0.9 only."""
    params = dataclasses.replace(SETTINGS[name], max_tokens=DEPTH + 1)  # FIRST, then DEPTH tokens
    joint = reference_joint(contexts, params)
    hydra = random_hydra_heads(32, 3, seed=9, conditioning="chain")
    heads = with_random_drafter(hydra, model.config, seed=10)
    draws = draw(model, heads, DYNAMIC, params, CHAINED_SAMPLES, seed=53, runner_type=ChainRunner)
    assert isinstance(draws.runner, ChainRunner)
    assert len(draws.runner.chains_started) == CHAINED_SAMPLES, "every sample should have run on the chain"
    assert_exact(draws, joint, f"chained tree step {name}", min_deep=0.1)


# --- negative controls ------------------------------------------------------------------------------


def assert_rejected(draws: Draws, joint: Dist, label: str) -> None:
    """A decoder run with a wrong setting: both fits must reject it far beyond the positive threshold."""
    for name, fit in fits(draws, joint).items():
        print(f"{label} {name}: {fit}")
        assert fit.p < CONTROL_P, f"{label} {name}: the wrong setting was not caught ({fit})"


def test_negative_control_ignoring_temperature_is_rejected(model, contexts):
    """Draws at T = 1 (top-k as asked) against the T = 0.5 reference."""
    right = SETTINGS["T0.5-k3"]
    joint = reference_joint(contexts, right)
    wrong = SamplingParams(temperature=1.0, top_k=right.top_k)
    draws = draw(model, RandomHeads(32, 3, seed=1), WIDE, wrong, CONTROL_SAMPLES, seed=43)
    assert_rejected(draws, joint, "control T=1 for T=0.5")


def test_negative_control_dropping_top_k_is_rejected(model, contexts):
    """Draws without top-k (temperature and top-p as asked) against the top-k reference."""
    right = SETTINGS["T1.5-k5-p0.95"]
    joint = reference_joint(contexts, right)
    wrong = SamplingParams(temperature=right.temperature, top_p=right.top_p)
    draws = draw(model, RandomHeads(32, 3, seed=1), WIDE, wrong, CONTROL_SAMPLES, seed=47)
    assert_rejected(draws, joint, "control no top-k for top_k=5")


def test_negative_control_wrong_only_after_depth_2_is_rejected(model, contexts, monkeypatch):
    """Verification that applies T = 1 instead of 0.5 at tree nodes of depth >= 2 only: the first two
    tokens stay exact (a two-token test passes this decoder), and only the third token's draws made
    after a depth-2 acceptance are wrong. The third-token fit must reject it: it sees the deep draws."""
    right = SETTINGS["T0.5-k3"]
    joint = reference_joint(contexts, right)
    real = speculative.verify_sampled

    def deep_at_t1(tree: Tree, node_tokens: list[int], logits: torch.Tensor, params: SamplingParams,
                   sampler: Sampler, masks: NodeMasks | None = None) -> Verdict:
        scale = torch.tensor([params.temperature if d >= 2 else 1.0 for d in tree.depths])
        return real(tree, node_tokens, logits * scale[:, None], params, sampler, masks)

    monkeypatch.setattr(speculative, "verify_sampled", deep_at_t1)
    draws = draw(model, RandomHeads(32, 3, seed=1), WIDE, right, CONTROL_SAMPLES, seed=59)
    counts = {k: float(v) for k, v in draws.counts.items()}
    first_two = pearson_fit(leading(counts, 2), leading(joint, 2))
    third = fits(draws, joint)[f"token {DEPTH}"]
    print(f"control T=1 at depth >= 2 only: first two tokens {first_two}; token {DEPTH} {third}; "
          f"{draws.deep_first_steps}/{CONTROL_SAMPLES} first steps accepted depth >= 2")
    assert first_two.p > ALPHA, "the control should leave the first two tokens exact"
    assert third.p < CONTROL_P, f"wrong draws after depth-2 acceptances were not caught ({third})"

