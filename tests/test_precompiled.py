"""Compiled graphs saved on first use and loaded by later processes (``inference/runtime/precompiled.py``).

What must hold: a loaded graph computes the bits the freshly compiled one computes; it reads the weights
of the model it is given (they are not frozen into the file); a call that does not fit the graph's
specialisation is refused; a damaged file is compiled again, never trusted; and a new engine process
decodes through the saved step graph, the same tokens, without a dynamo trace.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch

from elesium.inference.runtime.precompiled import PrecompiledFunction, PrecompileStore
from elesium.inference.sampling import SamplingParams


def scaled(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Module level, model first: the shape of the engine's step functions."""
    return torch.relu(model(x)) * 2 + 1


def rows(n: int, width: int = 8) -> torch.Tensor:
    x = torch.randn(n, width)
    torch._dynamo.mark_dynamic(x, 0)
    return x


def test_a_saved_graph_loads_elsewhere_and_computes_the_same_bits(tmp_path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    store = PrecompileStore(tmp_path, "tiny-model")
    first = PrecompiledFunction(scaled, "tiny", store)
    first(model, rows(3))
    path = store.path("tiny")
    assert not first.loaded and path.exists() and path.with_suffix(".json").exists()

    second = PrecompiledFunction(scaled, "tiny", store)
    assert second.preload() and second.loaded
    x = rows(5)  # another row count: the dynamic dimension stayed dynamic
    assert torch.equal(second(model, x), first(model, x))
    assert torch.allclose(second(model, x), scaled(model, x))
    # The weights are the model's at call time, not the ones the graph was traced with.
    other = torch.nn.Linear(8, 4)
    assert torch.allclose(second(other, x), scaled(other, x))
    assert not torch.allclose(second(other, x), second(model, x))
    with pytest.raises(ValueError, match="do not fit"):
        second(model, torch.randn(5, 9))


def test_a_damaged_file_is_compiled_again(tmp_path, caplog) -> None:
    model = torch.nn.Linear(8, 4)
    store = PrecompileStore(tmp_path, "tiny-model")
    PrecompiledFunction(scaled, "tiny", store)(model, rows(3))
    path = store.path("tiny")
    path.write_bytes(b"not a compiled function")
    again = PrecompiledFunction(scaled, "tiny", store)
    x = rows(4)
    with caplog.at_level(logging.WARNING, logger="elesium.inference.runtime.precompiled"):
        got = again(model, x)
    assert not again.loaded and "could not load" in caplog.text
    assert torch.allclose(got, scaled(model, x))
    assert PrecompiledFunction(scaled, "tiny", store).preload()  # the rewritten file loads


def test_older_versions_of_a_graph_are_pruned_other_models_kept(tmp_path) -> None:
    store = PrecompileStore(tmp_path, "tiny-model")
    stale = tmp_path / f"{store.stem('tiny')}-0123456789abcdef0123456789abcdef.bin"
    stale.write_bytes(b"from an older elesium")
    elsewhere = PrecompileStore(tmp_path, "another-model")
    kept = tmp_path / f"{elsewhere.stem('tiny')}-0123456789abcdef0123456789abcdef.bin"
    kept.write_bytes(b"another model's graph")
    PrecompiledFunction(scaled, "tiny", store)(torch.nn.Linear(8, 4), rows(2))
    assert not stale.exists() and kept.exists() and store.path("tiny").exists()


def test_a_view_of_another_length_is_refused(tmp_path) -> None:
    """A window is a view of a longer buffer, and its strides (compiled in as constants) follow that
    buffer's length: the graph accepts windows of any width of the same buffer, nothing else."""
    model = torch.nn.Linear(8, 4)

    def window(length: int, width: int) -> torch.Tensor:
        x = torch.randn(8, length)[:, :width].T  # [width, 8], a transposed view: columns `length` apart
        torch._dynamo.mark_dynamic(x, 0)
        return x

    store = PrecompileStore(tmp_path, "tiny-model")
    fn = PrecompiledFunction(scaled, "tiny-window", store)
    fn(model, window(32, 5))
    x = window(32, 9)
    assert torch.allclose(fn(model, x), scaled(model, x))
    loaded = PrecompiledFunction(scaled, "tiny-window", store)
    assert loaded.preload() and torch.equal(loaded(model, x), fn(model, x))
    with pytest.raises(ValueError, match="do not fit"):
        loaded(model, window(64, 9))


def test_no_store_is_plain_torch_compile() -> None:
    plain = PrecompiledFunction(scaled, "tiny", None)
    model = torch.nn.Linear(8, 4)
    x = rows(3)
    assert torch.allclose(plain(model, x), scaled(model, x))
    assert not plain.preload() and not plain.loaded


CHILD = """
import json, sys, torch
torch.set_num_threads(int(sys.argv[1]))
from elesium.inference.engine import Engine
from elesium.inference.sampling import SamplingParams
engine = Engine.load()
loaded = [name for name, graph in engine.runner.graphs.items() if graph.loaded]
out = engine.generate(sys.argv[2], SamplingParams(max_tokens=24, temperature=0.0), mode="vanilla")
counters = torch._dynamo.utils.counters
print(json.dumps({"loaded": loaded, "tokens": list(out.token_ids),
                  "graphs_traced": counters["stats"]["unique_graphs"]}))
"""


@pytest.mark.slow  # a second engine process (~10 s on 2 cores)
def test_a_new_process_decodes_through_the_saved_graph_without_tracing(default_engine) -> None:
    prompt = "Name three rivers in Europe."
    want = default_engine.generate(prompt, SamplingParams(max_tokens=24, temperature=0.0), mode="vanilla")
    store = default_engine.precompile
    assert store is not None and default_engine.runner.graphs["one"].store == store
    assert store.path(default_engine.runner.graphs["one"].name).exists()
    done = subprocess.run([sys.executable, "-c", CHILD, str(torch.get_num_threads()), prompt],
                          capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["loaded"] == ["one"], got
    assert got["graphs_traced"] == 0, got
    assert got["tokens"] == list(want.token_ids)
