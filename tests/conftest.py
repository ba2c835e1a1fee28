"""Shared fixtures: the real bundled model, loaded once per session on the CPU in float32."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MT_BENCH = REPO.parent / "shared" / "data" / "mt_bench_questions.jsonl"


@pytest.fixture(scope="session")
def engine():
    from elesium.inference.engine import Engine

    return Engine.load(device="cpu", dtype="float32", max_len=2048)


@pytest.fixture(scope="session")
def weights(engine):
    return engine.weights_info


@pytest.fixture(scope="session")
def mt_bench_prompts() -> list[str]:
    import json

    path = Path(os.environ.get("ELESIUM_MT_BENCH", MT_BENCH))
    if not path.exists():
        pytest.skip(f"MT-Bench prompts not found at {path}")
    return [json.loads(line)["turns"][0] for line in path.read_text().splitlines() if line.strip()]
