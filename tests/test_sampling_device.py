"""The device-side pick of the self-feeding vanilla graph (runtime/decode_chain.py), on the CPU.

The CUDA graph itself is tested on the GPU (test_gpu.py: chained tokens equal synchronous ones, greedy
and sampled). Here: its pieces against their host references on random inputs, and the captured
body run eagerly against the host loop it replaces, so a CPU-only machine still checks the logic.
"""

from __future__ import annotations

import pytest
import torch

from elesium.inference.runtime.decode_chain import STATE, chain_body
from elesium.inference.runtime.forward import ForwardRunner
from elesium.inference.sampling import Sampler, SamplingParams, sample_from, sample_on_device
from spec_harness import tiny_model


def _random_probs(g: torch.Generator, v: int) -> torch.Tensor:
    """Unnormalised probabilities with runs of zeros (as top-k / top-p leave them), sometimes at the top."""
    p = torch.rand(v, generator=g) ** 3
    p[torch.rand(v, generator=g) < 0.4] = 0.0
    if torch.rand((), generator=g) < 0.3:
        p[-int(torch.randint(1, v, (), generator=g)):] = 0.0
    if not (p > 0).any():
        p[int(torch.randint(0, v, (), generator=g))] = 1.0
    return p


def test_sample_on_device_matches_sample_from() -> None:
    g = torch.Generator().manual_seed(0)
    edges = [0.0, 1e-300, 0.5, 1.0 - 2**-53]
    for trial in range(300):
        probs = _random_probs(g, int(torch.randint(2, 40, (), generator=g)))
        us = edges if trial % 10 == 0 else torch.rand(20, generator=g, dtype=torch.float64).tolist()
        for u in us:
            want = sample_from(probs, u)
            got = int(sample_on_device(probs, torch.tensor([u], dtype=torch.float64)))
            assert got == want, f"trial {trial}, u = {u!r}: device pick {got}, host pick {want}"
            assert probs[got] > 0


def test_uniforms_at_once_equal_one_by_one() -> None:
    for n in (1, 5, 16, 17, 300):
        a, b = Sampler(11), Sampler(11)
        assert a.uniforms(n).tolist() == [b.uniform() for _ in range(n)]
        assert a.uniform() == b.uniform()  # and both continue from the same place


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0),
                                    SamplingParams(temperature=0.8, top_p=0.9, seed=1),
                                    SamplingParams(temperature=1.3, top_k=5, seed=2)],
                         ids=["greedy", "top-p", "top-k"])
def test_chain_body_runs_the_host_loop(params: SamplingParams) -> None:
    """The captured body, run eagerly: the tokens, offsets and uniforms the host loop would use."""
    model = tiny_model(3)
    prompt, steps = [1, 2, 3, 4], 12
    with torch.inference_mode():
        tokens = {}
        for path in ("body", "host"):
            runner = ForwardRunner(model, model.new_cache(32))
            hidden = runner.prefill(prompt)
            sampler = Sampler(7)
            first = sampler.pick(model.logits(hidden[-1]), params)
            out = [first]
            if path == "body":
                state = torch.tensor([first, len(prompt), 0])
                uniforms = sampler.uniforms(steps)
                body = chain_body(runner.step_outputs, state, torch.ones(1, 1, dtype=torch.bool), uniforms,
                                  params)
                for i in range(steps):
                    body()
                    assert state.tolist()[1:] == [len(prompt) + i + 1, i + 1]
                    out.append(int(state[0]))
                assert state.shape == (STATE,)
            else:
                for i in range(steps):
                    offset = torch.tensor(len(prompt) + i)
                    res = runner.step_outputs(torch.tensor([[out[-1]]]), offset.view(1),
                                              torch.ones(1, 1, dtype=torch.bool), offset, with_drafts=False)
                    out.append(sampler.pick(res.logits[0], params))
            tokens[path] = out
    assert tokens["body"] == tokens["host"]
