"""Autoregressive decoding, one token per forward: the baseline and the definition of correct output."""

from __future__ import annotations

import time

import torch

from elesium.inference.runtime.forward import ForwardRunner
from elesium.inference.records import StepRecord
from elesium.inference.sampling import Sampler, SamplingParams


class VanillaDecoder:
    """Holds the decode state between steps: tokens in the cache and the pending (uncached) token."""

    mode = "vanilla"

    def __init__(self, runner: ForwardRunner, params: SamplingParams, sampler: Sampler) -> None:
        self.runner = runner
        self.params = params
        self.sampler = sampler
        self.offset = 0
        self.pending = -1
        self.steps = 0

    def prefill(self, prompt_ids: list[int]) -> int:
        hidden = self.runner.prefill(prompt_ids)
        self.offset = len(prompt_ids)
        self.pending = self.sampler.pick(self.runner.model.logits(hidden[-1]), self.params)
        return self.pending

    def step(self, room: int = 1) -> tuple[list[int], StepRecord]:
        start = time.perf_counter()
        out = self.runner.decode([self.pending], [self.offset], self.offset)
        token = int(out.greedy[0]) if self.params.greedy else self.sampler.pick(out.logits[0], self.params)
        self.offset += 1
        self.pending = token
        record = StepRecord(step=self.steps, mode="vanilla", tree_size=1, tree_depth=0, accepted_length=1,
                            accepted_nodes=(0,), tokens=(token,), accepted_by_depth=(),
                            elapsed_s=time.perf_counter() - start)
        self.steps += 1
        return [token], record
