"""Medusa tree speculative decoding: propose a tree, verify it in one forward, keep the best path.

One step, starting from the pending token t0 (chosen but not yet in the cache) and the hidden state
h of the last cached position:

1. The heads read h and propose top-k tokens for positions +2, +3, ... past the cache.
2. The policy picks a tree; node 0 is t0, a node at depth d holds head d's token of its rank.
3. One forward writes every node into the cache at slots ``offset + node`` with position
   ``offset + depth``, each attending to the prefix and its own ancestors.
4. Verification walks the tree (greedy, exact sampling, or typical) to the longest accepted path
   and draws the bonus token from the base model at its end.
5. The accepted nodes' K/V move to contiguous slots; the path's tokens plus the bonus are
   committed; the last accepted node's hidden state feeds the heads next step.
"""

from __future__ import annotations

import time

import torch

from elesium.inference.forward import ForwardRunner
from elesium.inference.records import DecodeMode, StepRecord
from elesium.inference.sampling import Sampler, SamplingParams
from elesium.inference.tree_policy import TreePolicy
from elesium.inference.verify import Verdict, verify_greedy, verify_sampled, verify_typical


class MedusaDecoder:
    def __init__(self, runner: ForwardRunner, heads: torch.nn.Module, params: SamplingParams, sampler: Sampler,
                 policy: TreePolicy, mode: DecodeMode = "medusa") -> None:
        if mode not in ("medusa", "typical"):
            raise ValueError(f"MedusaDecoder runs 'medusa' or 'typical', not {mode!r}")
        self.runner = runner
        self.model = runner.model
        self.heads = heads
        self.params = params
        self.sampler = sampler
        self.policy = policy
        self.mode = mode
        self.offset = 0
        self.pending = -1
        self.hidden: torch.Tensor | None = None
        self.steps = 0

    @property
    def step_tokens(self) -> int:
        return self.policy.max_tree_size

    def prefill(self, prompt_ids: list[int]) -> int:
        hidden = self.runner.prefill(prompt_ids)
        self.offset = len(prompt_ids)
        self.hidden = hidden[-1]
        self.pending = self.sampler.pick(self.model.logits(self.hidden), self.params)
        return self.pending

    def draft(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k tokens ``[heads, k]`` and their log-probabilities at the draft temperature."""
        logits = self.model.logits(self.heads(self.hidden))  # [heads, V]
        top = torch.topk(logits, self.policy.draft_topk(), dim=-1)
        logprobs = top.values / self.policy.draft_temperature - torch.logsumexp(
            logits / self.policy.draft_temperature, dim=-1, keepdim=True)
        return top.indices.cpu(), logprobs.float().cpu()

    def step(self) -> tuple[list[int], StepRecord]:
        start = time.perf_counter()
        draft_temperature = self.policy.draft_temperature
        tokens_k, logprobs = self.draft()
        tree = self.policy.build(logprobs)
        draft_tokens = tokens_k.tolist()
        node_tokens = [self.pending] + [draft_tokens[d - 1][r] for d, r in zip(tree.depths[1:], tree.ranks[1:])]
        dev = self.runner.device
        hidden, logits = self.runner.decode(torch.tensor([node_tokens], device=dev),
                                            tree.positions(self.offset, dev), self.offset, tree.ancestors(dev))
        verdict = self._verify(tree, node_tokens, logits)
        path = verdict.path
        if path != list(range(len(path))):
            src = torch.tensor([self.offset + n for n in path], device=dev)
            dst = torch.arange(self.offset, self.offset + len(path), device=dev)
            self.runner.cache.move(src, dst)
        self.offset += len(path)
        self.hidden = hidden[path[-1]]
        self.pending = verdict.bonus
        committed = [node_tokens[n] for n in path[1:]] + [verdict.bonus]
        accepted_depth = len(path) - 1
        record = StepRecord(
            step=self.steps, mode=self.mode, tree_size=tree.size, tree_depth=tree.depth,
            accepted_length=len(committed), accepted_nodes=tuple(path), tokens=tuple(committed),
            accepted_by_depth=tuple(d <= accepted_depth for d in range(1, tree.depth + 1)),
            draft_temperature=draft_temperature, elapsed_s=time.perf_counter() - start)
        self.policy.observe(record)
        self.steps += 1
        return committed, record

    def _verify(self, tree, node_tokens: list[int], logits: torch.Tensor) -> Verdict:
        if self.params.greedy:
            return verify_greedy(tree, node_tokens, logits)
        if self.mode == "typical":
            return verify_typical(tree, node_tokens, logits, self.params, self.sampler)
        return verify_sampled(tree, node_tokens, logits, self.params, self.sampler)
