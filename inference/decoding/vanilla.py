"""Autoregressive decoding, one token per forward: the baseline and the definition of correct output."""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING

import torch

from elesium.inference.records import StepRecord
from elesium.inference.runtime.forward import ForwardRunner
from elesium.inference.sampling import Sampler, SamplingParams

if TYPE_CHECKING:
    from elesium.inference.constraints import GrammarState
    from elesium.inference.runtime.decode_chain import DecodeChain


class VanillaDecoder:
    """Holds the decode state between steps: tokens in the cache and the pending (uncached) token."""

    mode = "vanilla"

    def __init__(self, runner: ForwardRunner, params: SamplingParams, sampler: Sampler,
                 grammar: GrammarState | None = None) -> None:
        self.runner = runner
        self.params = params
        self.sampler = sampler
        # Constrained output: every token is picked from the logits masked to what the grammar
        # allows next, and then advances the grammar.
        self.grammar = grammar
        self.offset = 0
        self.pending = -1
        self.steps = 0
        # Unconstrained steps on CUDA come from a self-feeding graph (runtime.decode_chain); set up on
        # the first step, None where the runner has none.
        self._chain: DecodeChain | None = None
        self._chain_tried = False

    def prefill(self, prompt_ids: list[int]) -> int:
        hidden = self.runner.prefill(prompt_ids)
        self.offset = len(prompt_ids)
        self.pending = self._choose(self.runner.model.logits(hidden[-1]))
        return self.pending

    def _choose(self, logits: torch.Tensor) -> int:
        if self.grammar is None:
            return self.sampler.pick(logits, self.params)
        token = self.sampler.pick(logits, self.params, self.grammar.mask(logits.shape[-1], logits.device))
        self.grammar.advance(token)
        return token

    def step(self, room: int = 1) -> tuple[list[int], StepRecord]:
        """One token. ``room``: cache slots left; with ``max_tokens`` it bounds how far a chain
        may run ahead of what the caller will take."""
        start = time.perf_counter()
        greedy = self.greedy
        # Tokens still wanted after the prefill's and the earlier steps' (a stop may end it sooner).
        wanted = max(1, min(room, self.params.max_tokens - 1 - self.steps))
        if self.grammar is None and not self._chain_tried:
            self._chain_tried = True
            # A chain takes every uniform this generation can still consume, in the host's order.
            draw = None if greedy else functools.partial(self.sampler.uniforms, wanted)
            self._chain = self.runner.decode_chain(self.pending, self.offset, self.params, draw)
        if self._chain is not None:
            return self._advance(self._chain.next_token(wanted), start)
        out = self.runner.decode([self.pending], [self.offset], self.offset)
        return self.take(out.logits[0], int(out.greedy[0]), start)

    @property
    def batchable(self) -> bool:
        """Whether this decoder's next step may be one row of a batched forward (not a device chain)."""
        return self._chain is None

    @property
    def greedy(self) -> bool:
        """Whether each token is the argmax of its logits (so a forward's greedy pick is all it needs)."""
        return self.params.greedy and self.grammar is None

    def take(self, logits: torch.Tensor | None, greedy_token: int,
             start: float) -> tuple[list[int], StepRecord]:
        """Finish a step whose forward ran elsewhere (alone, or as one row of a batch): the logits of the
        pending token and their argmax. The same choice ``step`` makes, so a row's token is its solo token.
        A greedy decoder needs no logits (a chain of greedy steps on the device keeps none)."""
        if self.greedy:
            return self._advance(greedy_token, start)
        if logits is None:
            raise ValueError("a sampled or grammar-constrained step needs its logits")
        return self._advance(self._choose(logits), start)

    def take_chain(self, tokens: list[int], start: float) -> list[tuple[list[int], StepRecord]]:
        """``take`` of each token of a greedy chain (the batch's steps run on the device), in order: one
        call a chain, not one a token, since the step loop hands out every row's chain between two chains
        while the GPU waits (~30,000 tokens a level at 32 concurrent on CUDA)."""
        if not self.greedy:
            raise ValueError("a chain of device-picked tokens is for a greedy, unconstrained decoder")
        elapsed = time.perf_counter() - start
        step = self.steps
        taken = [([token], StepRecord.plain(step + i, token, elapsed)) for i, token in enumerate(tokens)]
        if tokens:
            self.steps = step + len(tokens)
            self.offset += len(tokens)
            self.pending = tokens[-1]
        return taken

    def _advance(self, token: int, start: float) -> tuple[list[int], StepRecord]:
        self.offset += 1
        self.pending = token
        record = StepRecord.plain(self.steps, token, time.perf_counter() - start)
        self.steps += 1
        return [token], record
