"""The one tiny model the fast tests share, and what they build around it (real maths, random weights).

``tiny_model`` is a real ``Transformer`` at a toy size: the heads', drafter's and storage tests train
and score on it in seconds, and the exactness statistics (``spec_harness.py``) use an 8-token variant
whose joint distributions can be enumerated. ``tiny_engine`` is what ``train()`` reads from an engine.
``ChainRunner`` is the eager runner with the CUDA runner's self-feeding tree steps, their captured
body run as plain tensor code.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from elesium.inference.decoding.tree import Tree
from elesium.inference.runtime.config import ModelConfig
from elesium.inference.runtime.forward import ForwardRunner
from elesium.inference.runtime.model import Transformer

MT_BENCH = Path(__file__).resolve().parent / "data" / "mt_bench_questions.jsonl"  # tests/data/README.md
VOCAB = 40
SHA = "a" * 64  # the tiny model's stand-in weights sha256


def tiny_model(seed: int = 0, *, vocab: int = VOCAB, num_layers: int = 2, max_positions: int = 256,
               tie_word_embeddings: bool = True) -> Transformer:
    """A default-initialised Llama-shaped model: hidden 32, 4 query / 2 KV heads of 8, MLP 64."""
    torch.manual_seed(seed)
    config = ModelConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_layers=num_layers,
                         num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=max_positions,
                         tie_word_embeddings=tie_word_embeddings)
    return Transformer(config).eval().requires_grad_(False)


class RowwiseLinear(torch.nn.Module):
    """``x @ W.T`` as one multiply-and-sum per output: a row's result cannot depend on the rows beside it.

    A float32 BLAS call gives no such promise (its blocking follows the row count), and the fast
    path's int4 layers round their input to bfloat16, which hides last-bit differences; this layer
    is row-invariant and keeps them, so a test on it sees any reordering in the rest of the step.
    """

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("weight", weight.detach().clone(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x[..., None, :] * self.weight).sum(-1)


def rowwise_tiny_model(seed: int = 0, *, num_layers: int = 2) -> Transformer:
    """``tiny_model`` with every linear layer, lm_head too, a ``RowwiseLinear``."""
    model = tiny_model(seed, num_layers=num_layers)
    for layer in model.layers:
        attn = layer.attn
        attn.wqkv, attn.wo = RowwiseLinear(attn.wqkv.weight), RowwiseLinear(attn.wo.weight)
        layer.w13, layer.w2 = RowwiseLinear(layer.w13.weight), RowwiseLinear(layer.w2.weight)
    model.lm_head = RowwiseLinear(model.lm_head.weight)
    return model


def tiny_engine(model: Transformer) -> SimpleNamespace:
    """What ``train()`` reads from an engine, around a tiny model (no tokenizer: data is given as ids)."""
    return SimpleNamespace(model=model, tokenizer=None,
                           weights_info=SimpleNamespace(sha256=SHA, source=Path("tiny.gguf")))


def greedy_continuation(model: Transformer, prompt: list[int], n: int, cache: int = 128) -> list[int]:
    """Vanilla greedy decoding's first ``n`` tokens after ``prompt``: what exact speculation must give."""
    from elesium.inference.decoding.vanilla import VanillaDecoder
    from elesium.inference.sampling import Sampler, SamplingParams

    runner = ForwardRunner(model, model.new_cache(cache))
    van = VanillaDecoder(runner, SamplingParams(max_tokens=n), Sampler(0))
    out = [van.prefill(prompt)]
    while len(out) < n:
        out.extend(van.step(cache - van.offset)[0])
    return out[:n]


def fit_drafter(drafter: torch.nn.Module, model: Transformer, seq: list[int], steps: int,
                depth: int = 1) -> None:
    """Fit an attention drafter (unrolled over ``depth`` levels) to one sequence, so that its drafts of
    that sequence get accepted; leaves it frozen."""
    from elesium.inference.training.drafter_training import drafter_loss, padded

    tokens, valid = padded([seq], torch.device("cpu"))
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    with torch.enable_grad():
        drafter.requires_grad_(True)
        for _ in range(steps):
            loss = drafter_loss(drafter, model, tokens, valid, depth=depth)
            opt.zero_grad()
            loss.backward()
            opt.step()
    drafter.requires_grad_(False)


def cycle_records(n: int = 12, length: int = 40) -> list[dict]:
    """Answers that count up modulo VOCAB with a per-sequence stride: the future is learnable from the
    present."""
    recs = []
    for i in range(n):
        stride = 1 + i % 3
        start = (7 * i) % VOCAB
        ids = [(start + stride * t) % VOCAB for t in range(length)]
        recs.append({"id": f"p{i:03d}", "task": "synthetic", "prompt_ids": ids[:4], "response_ids": ids[4:],
                     "sampling": {"temperature": 0.0, "max_new_tokens": length,
                                  "seed": 0}, "model_sha256": SHA})
    return recs


def node_path(tree: Tree, node: int) -> list[int]:
    """Node ids from the root to ``node``, inclusive."""
    out = []
    while node >= 0:
        out.append(node)
        node = tree.parents[node]
    return out[::-1]


def ancestors_from_parents(parents: list[int]) -> torch.Tensor:
    """Dense ancestor relation (self included) of a parent array; -1 marks a root."""
    n = len(parents)
    anc = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            anc[i, j] = True
            j = parents[j]
    return anc


class EagerReplay:
    """A stand-in for a captured graph: ``replay()`` runs the step body."""

    def __init__(self, body: Any) -> None:
        self.body = body
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        self.body()


def eager_capture(body: Any) -> tuple[EagerReplay, torch.Tensor]:
    """``CudaGraphRunner._record``'s contract: two real warm-up runs, then the "graph"."""
    body()
    out = body()
    return EagerReplay(body), out


class ChainRunner(ForwardRunner):
    """The eager runner with tree chains, as ``CudaGraphRunner`` has them (``decoding/tree_chain.py``
    captures through ``capture``)."""

    tree_chains = True

    @property
    def capture(self) -> Any:
        return eager_capture

    @property
    def graphs(self) -> dict:
        return self.chain_graphs

    @property
    def chains_started(self) -> list[int]:
        return list(range(self.tree_chains_started))
