"""The compiled CPU decode step (inference/runtime/cpu_step.py) against ``Transformer.forward``.

``step_forward`` computes the model's forward without writing the cache and with attention in two
parts (the cached context and the step's own nodes); it must be the same function as the plain
forward, for chains and trees, at any offset and window. Its compiled form must agree with its
eager form, including across window growth (one graph, a dynamic window length).
"""

from __future__ import annotations

import pytest
import torch

from elesium.inference.runtime import cpu_step
from elesium.inference.runtime.cpu_step import CompiledCpuRunner, step_forward, window_for
from elesium.inference.runtime.cpu_weights import resolve_cpu_compile
from elesium.inference.runtime.forward import ForwardRunner
from tests.helpers import ancestors_from_parents, rowwise_tiny_model, tiny_model


def _random_tree(n: int, gen: torch.Generator) -> tuple[torch.Tensor, list[int]]:
    """A random parent structure (node 0 the root): ancestors ``[n, n]`` and each node's depth."""
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
    depth = [0] * n
    for i in range(1, n):
        depth[i] = depth[parents[i]] + 1
    return ancestors_from_parents(parents), depth


@pytest.mark.parametrize("seed", range(6))
def test_step_forward_is_the_model_forward_for_chains_and_trees(seed):
    model = tiny_model(seed)
    gen = torch.Generator().manual_seed(seed)
    context = int(torch.randint(1, 40, (1,), generator=gen))
    n = int(torch.randint(1, 9, (1,), generator=gen))
    anc, depth = _random_tree(n, gen) if seed % 2 else (model.causal(n), list(range(n)))
    prompt = torch.randint(0, 40, (1, context), generator=gen)
    tokens = torch.randint(0, 40, (1, n), generator=gen)
    positions = torch.tensor([context + d for d in depth])
    with torch.inference_mode():
        cache = model.new_cache(128)
        model(prompt, torch.arange(context), cache, 0)
        # Junk past the context: the window covers it and the mask must keep it out.
        cache.k[:, :, :, context:] = torch.randn_like(cache.k[:, :, :, context:])
        cache.v[:, :, :, context:] = torch.randn_like(cache.v[:, :, :, context:])
        width = int(torch.randint(context, 129, (1,), generator=gen))
        k_window, v_window = cache.k[:, :, :, :width], cache.v[:, :, :, :width]
        hidden, logits, greedy, keys, values = step_forward(model, tokens, positions, torch.tensor(context),
                                                    k_window, v_window, anc)
        want_hidden = model(tokens, positions, cache, context, anc)
        want_logits = model.logits(want_hidden)
    torch.testing.assert_close(hidden, want_hidden, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(greedy, logits.argmax(-1))
    # The plain forward wrote its K/V at the context's end: step_forward returns the same values.
    torch.testing.assert_close(keys, cache.k[:, :, :, context:context + n], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(values, cache.v[:, :, :, context:context + n], rtol=1e-6, atol=1e-6)


def test_window_rounds_up_and_stays_inside_the_cache():
    w = cpu_step.WINDOW
    assert window_for(0, 8192) == w and window_for(w, 8192) == w and window_for(w + 1, 8192) == 2 * w
    assert window_for(3 * w + 5, 2 * w) == 2 * w  # never past the cache (the caller checks the fit)


def _decode_all(runner: ForwardRunner, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """Greedy decoding through ``runner``: prefill, then one-token steps; the tokens and last logits."""
    hidden = runner.prefill(prompt)
    token = int(runner.model.logits(hidden[-1]).argmax())
    out, offset, logits = [], len(prompt), torch.empty(0)
    for _ in range(steps):
        step = runner.decode([token], [offset], offset)
        logits, token = step.logits[0].clone(), int(step.greedy[0])
        out.append(token)
        offset += 1
    return out, logits


def test_runner_decodes_as_the_eager_runner_across_window_growth(monkeypatch):
    """Eager ``step_forward`` through the runner against ``ForwardRunner``, over several windows."""
    monkeypatch.setattr(cpu_step, "WINDOW", 8)
    model = tiny_model(3)
    prompt = list(range(5, 11))
    with torch.inference_mode():
        want, want_logits = _decode_all(ForwardRunner(model, model.new_cache(64)), prompt, 30)
        runner = CompiledCpuRunner(model, model.new_cache(64), compiled=False)
        got, got_logits = _decode_all(runner, prompt, 30)
    assert got == want
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-5, atol=1e-5)


def test_compiled_step_agrees_with_its_eager_form(monkeypatch):
    """The inductor graph against the same function run eagerly: one compile, windows 8 to 40."""
    monkeypatch.setattr(cpu_step, "WINDOW", 8)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = tiny_model(4)
    prompt = list(range(2, 9))
    with torch.inference_mode():
        eager = CompiledCpuRunner(model, model.new_cache(48), compiled=False)
        want, want_logits = _decode_all(eager, prompt, 33)
        compiled = CompiledCpuRunner(model, model.new_cache(48), compiled=True)
        got, got_logits = _decode_all(compiled, prompt, 33)
    # One graph for every window (the window length is dynamic, the offset a tensor): no recompiles.
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert got == want
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-4, atol=1e-4)
    # The cache holds what the eager runner wrote (the graph returns K/V; the runner writes them).
    end = len(prompt) + 33
    torch.testing.assert_close(compiled.cache.k[:, :, :, :end], eager.cache.k[:, :, :, :end],
                               rtol=1e-4, atol=1e-4)


def test_cpu_compile_setting():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_cpu_compile("auto", cpu, "gguf-blocks") and resolve_cpu_compile("auto", cpu, "bfloat16")
    assert not resolve_cpu_compile("auto", cpu, "float32")  # the reference stays the plain forward
    assert resolve_cpu_compile("on", cpu, "float32") and not resolve_cpu_compile("off", cpu, "gguf-blocks")
    assert not resolve_cpu_compile("auto", cuda, "float32")
    with pytest.raises(ValueError, match="CPU only"):
        resolve_cpu_compile("on", cuda, "float32")
    with pytest.raises(ValueError, match="unknown"):
        resolve_cpu_compile("yes", cpu, "float32")


def test_too_long_a_step_is_refused():
    model = tiny_model(0)
    runner = CompiledCpuRunner(model, model.new_cache(16), compiled=False)
    with pytest.raises(ValueError, match="do not fit"):
        runner.decode([1, 2], [15, 16], 15)


Trees = list[tuple[list[int], list[int]]]


def _tree_against_chains(runner: CompiledCpuRunner, prompt: list[int], trees: Trees) -> None:
    """Each tree (tokens, parents) at the prompt's end: every node's logits must be bit for bit those of
    decoding its root path one token at a time from the same cache, through the same runner."""
    with torch.inference_mode():
        runner.prefill(prompt)
        offset = len(prompt)
        saved = runner.cache.k.clone(), runner.cache.v.clone()
        for tokens, parents in trees:
            runner.cache.k.copy_(saved[0])
            runner.cache.v.copy_(saved[1])
            depth = [0] * len(parents)
            for i in range(1, len(parents)):
                depth[i] = depth[parents[i]] + 1
            anc = ancestors_from_parents(parents)
            tree = runner.decode(tokens, [offset + d for d in depth], offset, anc).logits.clone()
            for node in range(len(tokens)):
                runner.cache.k.copy_(saved[0])
                runner.cache.v.copy_(saved[1])
                path = [j for j in range(len(tokens)) if anc[node, j]]  # root first: parents precede children
                for d, j in enumerate(path):
                    alone = runner.decode([tokens[j]], [offset + d], offset + d).logits[0]
                assert torch.equal(tree[node], alone), (parents, node)


def _random_trees(gen: torch.Generator, sizes: tuple[int, ...]) -> Trees:
    out = []
    for n in sizes:
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
        out.append(([int(t) for t in torch.randint(0, 40, (n,), generator=gen)], parents))
    return out


@pytest.mark.parametrize("seed", range(3))
def test_tree_nodes_get_their_one_token_logits_bit_for_bit(monkeypatch, seed):
    """The property greedy speculative == vanilla rests on, for the eager step (the reference).

    On row-invariant float32 layers (the fast path's int4 layers are row-invariant too, but round their
    input to bfloat16, which would hide last-bit differences). The window is 8 slots here, so a deep
    tree's window is wider than its shallow nodes' one-token windows: extra masked columns must change
    nothing. (Run through ``ForwardRunner``'s SDPA forward, or the two-part attention this step had
    before, these trees fail.)
    """
    monkeypatch.setattr(cpu_step, "WINDOW", 8)
    model = rowwise_tiny_model(seed)
    gen = torch.Generator().manual_seed(seed)
    prompt = [int(t) for t in torch.randint(0, 40, (int(torch.randint(3, 22, (1,), generator=gen)),),
                                            generator=gen)]
    runner = CompiledCpuRunner(model, model.new_cache(64), compiled=False)
    _tree_against_chains(runner, prompt, _random_trees(gen, (2, 5, 9, 12)))


def test_compiled_tree_nodes_get_their_one_token_logits_bit_for_bit(monkeypatch):
    """The same through inductor: the one-token graph and the tree graph (the node count dynamic, so
    trees of any size share it) agree row for row, and nothing recompiles per tree size."""
    monkeypatch.setattr(cpu_step, "WINDOW", 8)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = rowwise_tiny_model(7)
    gen = torch.Generator().manual_seed(7)
    runner = CompiledCpuRunner(model, model.new_cache(64), compiled=True)
    _tree_against_chains(runner, list(range(3, 16)), _random_trees(gen, (3, 6, 11)))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2  # one-token and tree
