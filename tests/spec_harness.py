"""A tiny random model and heads for exactness statistics (real maths, synthetic weights).

Exactness is a property of the verification algorithm, so it is checked where the whole joint
distribution can be enumerated: a vocabulary of 8 tokens, with the exact vanilla distribution of
the next tokens computed by brute force through the same ``target_probs`` vanilla sampling uses.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
from torch import nn

from elesium.inference.constraints import GrammarState
from elesium.inference.decoding.speculative import TreeDecoder
from elesium.inference.decoding.tree_policy import TreePolicy
from elesium.inference.drafters.attention_drafter import FeatureDrafter
from elesium.inference.drafters.drafter_tree import DrafterTree
from elesium.inference.drafters.hydra import Conditioning, HydraHeads
from elesium.inference.drafters.medusa import MedusaHeads
from elesium.inference.drafters.protocol import DraftHeads
from elesium.inference.runtime.config import ModelConfig
from elesium.inference.runtime.forward import ForwardRunner
from elesium.inference.runtime.model import Transformer
from elesium.inference.sampling import Sampler, SamplingParams, target_probs
from helpers import tiny_model as shared_tiny_model

VOCAB = 8


class RandomHeads(nn.Module):
    """Random residual heads: deliberately imperfect drafts, so both accept and reject paths run.

    Medusa-shaped: drafts read the hidden state alone, so it proposes as ``MedusaHeads`` do.
    """

    drafter: FeatureDrafter | None = None
    source_sha256: str = ""
    fuses_drafts = True
    new_cache = MedusaHeads.new_cache
    fused_states = MedusaHeads.fused_states
    draft_tree = MedusaHeads.draft_tree
    prefill = MedusaHeads.prefill
    propose = MedusaHeads.propose

    def __init__(self, hidden: int, num_heads: int, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.num_heads = num_heads
        self.weights = nn.Parameter(torch.randn(num_heads, hidden, hidden, generator=g) * 0.5,
                                    requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.stack([hidden + torch.nn.functional.silu(hidden @ w.T) for w in self.weights])


def random_hydra_heads(hidden: int, num_heads: int, seed: int,
                       conditioning: Conditioning = "concat") -> HydraHeads:
    """Hydra heads with random weights: drafts depend on the path, and are often wrong."""
    heads = HydraHeads(hidden, num_heads, 1, conditioning)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return heads.eval().requires_grad_(False)


def random_drafter_tree(config: ModelConfig, depth: int, seed: int) -> DrafterTree:
    """An eagle drafter tree with random weights, perturbed so its drafts differ from level to level."""
    torch.manual_seed(seed)
    drafter = FeatureDrafter.for_model(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)
    return DrafterTree(drafter, depth).eval().requires_grad_(False)


def with_random_drafter(heads: HydraHeads, config: ModelConfig, seed: int) -> HydraHeads:
    """Attach an attention drafter with random weights: level-1 drafts from attention over the past."""
    torch.manual_seed(seed)
    heads.drafter = FeatureDrafter.for_model(config).eval().requires_grad_(False)
    return heads


def tiny_model(seed: int = 0) -> Transformer:
    """The shared tiny model with an 8-token vocabulary, one layer and untied embeddings.

    One layer at default init: entropy between one-hot and uniform at T = 0.5..1.5, so top-p trims and
    drafts are accepted often enough to exercise both branches of verification.
    """
    return shared_tiny_model(seed, vocab=VOCAB, num_layers=1, max_positions=64, tie_word_embeddings=False)


@torch.inference_mode()
def exact_joint(model: Transformer, prefix: list[int], first: int, params: SamplingParams, n: int) -> dict:
    """P(next n tokens) after ``prefix + [first]`` under vanilla sampling, by enumeration."""
    out: dict[tuple[int, ...], float] = {}
    for seq in itertools.product(range(VOCAB), repeat=n):
        ids = prefix + [first] + list(seq)
        cache = model.new_cache(len(ids) + 1)
        logits = model.logits(model(torch.tensor([ids]), torch.arange(len(ids)), cache, 0)[0])
        p = 1.0
        for i, tok in enumerate(seq):
            p *= float(target_probs(logits[len(prefix) + i], params)[tok])
        out[seq] = p
    return out


@torch.inference_mode()
def speculative_samples(model: Transformer, heads: DraftHeads, policy: TreePolicy, prefix: list[int],
                        first: int, params: SamplingParams, n: int, samples: int, seed: int,
                        mode: str = "speculative", grammar: GrammarState | None = None,
                        on_decoder: Callable[[TreeDecoder], None] | None = None,
                        runner_type: type[ForwardRunner] = ForwardRunner) -> dict:
    """Counts of the next ``n`` tokens the tree decoder commits after ``prefix + [first]``.

    ``grammar`` (its state after ``first``) constrains every sample from a fresh copy; ``on_decoder``
    sees each sample's decoder before it steps (to watch the trees it builds); ``runner_type`` is the
    forward it verifies through (``ForwardRunner``, or a subclass such as the CPU step's).
    """
    cache = model.new_cache(len(prefix) + 4 * policy.max_tree_size + n + 8)
    # The runner owns only a drafter's heads (it keeps the drafter's cache); others are passed per step,
    # so the step forward does not fuse Medusa drafts (top-10 of an 8-token vocabulary).
    runner = runner_type(model, cache, heads if heads.drafter is not None else None)
    sampler = Sampler(seed)
    base = TreeDecoder(runner, heads, params, sampler, policy, mode)
    base.prefill(prefix)
    snapshot = (cache.k.clone(), cache.v.clone(), base.hidden.clone())
    drafter = [t.clone() for t in runner.drafter_cache or ()]
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(samples):
        cache.k.copy_(snapshot[0])
        cache.v.copy_(snapshot[1])
        for live, saved in zip(runner.drafter_cache or (), drafter):
            live.copy_(saved)
        dec = TreeDecoder(runner, heads, params, sampler, TreePolicy(**_policy_args(policy)), mode,
                          grammar=grammar.copy() if grammar is not None else None)
        dec.offset, dec.pending, dec.hidden = len(prefix), first, snapshot[2]
        assert base.rows is not None  # the heads draft from the rows, which end in ``first``
        dec.rows, dec.row_tokens, dec.row_start = base.rows, [first], base.row_start
        if on_decoder is not None:
            on_decoder(dec)
        got: list[int] = []
        while len(got) < n:
            got.extend(dec.step()[0])
        key = tuple(got[:n])
        counts[key] = counts.get(key, 0) + 1
    return counts


def _policy_args(policy: TreePolicy) -> dict:
    return dict(kind=policy.kind, static_paths=policy.static_paths, max_nodes=policy.max_nodes,
                topk=policy.topk, draft_temperature=policy.draft_temperature, adapt=False)


def chi_square_p(counts: dict, expected_probs: dict, samples: int) -> float:
    """Pearson goodness of fit, merging cells with expected count < 5 into one."""
    from scipy.stats import chi2

    observed, expected = [], []
    rest_o, rest_e = 0.0, 0.0
    for key, p in expected_probs.items():
        e = p * samples
        o = counts.get(key, 0)
        if e < 5:
            rest_o += o
            rest_e += e
        else:
            observed.append(o)
            expected.append(e)
    if rest_e > 0:
        observed.append(rest_o)
        expected.append(rest_e)
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected) if e > 0)
    # Mass outside the expected support (impossible tokens) makes the fit fail outright.
    impossible = sum(c for k, c in counts.items() if expected_probs.get(k, 0.0) == 0.0)
    if impossible:
        return 0.0
    return float(chi2.sf(stat, max(1, len(observed) - 1)))
