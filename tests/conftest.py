"""Shared fixtures: the real bundled model, loaded once per session on the CPU in float32.

The session's cache directory (packed CPU weights, compiled step graphs, tuned profiles) is a fresh
temporary one, set before anything loads, so a test run neither reads nor writes the user's
``~/.cache/elesium`` (``ELESIUM_TEST_CACHE_DIR`` names a directory to reuse between local runs instead;
CI leaves it unset).
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile

import pytest

if os.environ.get("ELESIUM_TEST_CACHE_DIR"):
    os.environ["ELESIUM_CACHE_DIR"] = os.environ["ELESIUM_TEST_CACHE_DIR"]
else:
    _cache = tempfile.mkdtemp(prefix="elesium-test-cache-")
    os.environ["ELESIUM_CACHE_DIR"] = _cache
    atexit.register(shutil.rmtree, _cache, True)

from helpers import MT_BENCH


@pytest.fixture(scope="session")
def engine():
    from elesium.inference.engine import Engine

    return Engine.load(device="cpu", dtype="float32", max_len=2048)


@pytest.fixture(scope="session")
def default_engine():
    """What a user's ``Engine.load()`` builds on this machine, every setting at its default (on a CPU:
    the GGUF's 4-bit blocks, decode steps through the compiled step). Loaded once, when first asked for:
    its weight packing and compile cost about a minute on 2 cores (in the session's cache directory)."""
    from elesium.inference.engine import Engine

    return Engine.load()


@pytest.fixture(scope="session")
def weights(engine):
    return engine.weights_info


@pytest.fixture(scope="session")
def mt_bench_prompts() -> list[str]:
    """MT-Bench's first turns, from the copy vendored in tests/data (a missing file is a failure, not a
    skip)."""
    if not MT_BENCH.exists():
        pytest.fail(f"MT-Bench prompts not found at {MT_BENCH}; they ship with the repository "
                    f"(tests/data/README.md)")
    return [json.loads(line)["turns"][0] for line in MT_BENCH.read_text().splitlines() if line.strip()]


@pytest.fixture
def restored_engine(engine):
    """The session engine for a test that swaps its heads, tree policy or default: all put back afterwards,
    so later tests see the engine exactly as ``Engine.load`` built it."""
    heads, policy, speculate = engine.heads, engine.policy, engine.speculate
    drafter = None if heads is None else heads.drafter
    yield engine
    if heads is not None and heads.drafter is not drafter:
        heads.drafter = drafter
        engine.heads = heads  # re-arm the runner (the drafter's cache) for the restored drafter
    elif engine.heads is not heads:
        engine.heads = heads
    engine.policy, engine.speculate = policy, speculate


def pytest_collection_modifyitems(config, items):
    """``identity_full`` tests (the whole identity sets, tens of minutes) run only when ``-m`` names them;
    otherwise each is skipped with the command that runs it, so ``-ra`` lists what was left out."""
    if "identity_full" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(
        reason="full identity set: ./dev test -m identity_full tests/test_identity_sets.py")
    for item in items:
        if "identity_full" in item.keywords:
            item.add_marker(skip)
