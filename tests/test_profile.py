"""Tuning profiles are matched to the model, device, dtype and the heads they were measured with."""

from __future__ import annotations

from pathlib import Path

import torch

from elesium.inference.tuning.profile import TuneProfile, find_profile, profile_path

SHA = "b" * 64


def profile(heads_sha256: str) -> TuneProfile:
    return TuneProfile(device_kind="cpu-test", dtype="float32", model_sha256=SHA, cost_sizes=[1, 2],
                       cost_ms=[1.0, 1.5],
                       step_overhead_ms=0.1, acceptance=[[0.5]], heads_sha256=heads_sha256)


def test_profile_for_other_heads_is_not_used(tmp_path: Path):
    dev, dt = torch.device("cpu"), torch.float32
    path = profile_path(tmp_path, SHA, dev, dt)
    profile("h" * 64).save(path)
    assert find_profile(tmp_path, SHA, dev, dt, "h" * 64) is not None
    assert find_profile(tmp_path, SHA, dev, dt, "g" * 64) is None  # tuned with other heads
    assert find_profile(tmp_path, "c" * 64, dev, dt, "h" * 64) is None  # another model
    profile("").save(path)  # profiles from before heads were recorded match any heads
    loaded = find_profile(tmp_path, SHA, dev, dt, "g" * 64)
    assert loaded is not None and loaded.heads_sha256 == "" and loaded.policy().max_tree_size == 64


def test_shipped_profiles_were_tuned_with_the_shipped_heads():
    """New heads need `elesium tune` on each profiled machine; a stale profile would silently be skipped."""
    import hashlib

    from elesium.inference.drafters.files import (
        DRAFTER_FILE,
        WEIGHTS_FILE,
        default_heads_dir,
        load_heads,
        read_manifest,
    )
    from elesium.inference.tuning.profile import SHIPPED

    # The key profiles match on: the heads' file and, when shipped, the drafter's.
    heads_sha = load_heads(None, base_sha256=read_manifest(None)["base_model"]["sha256"]).source_sha256
    files = [default_heads_dir() / WEIGHTS_FILE, default_heads_dir() / DRAFTER_FILE]
    assert heads_sha == hashlib.sha256(b"".join(f.read_bytes() for f in files if f.exists())).hexdigest()
    shipped = sorted(SHIPPED.glob("*.json"))
    assert shipped, f"no shipped profiles in {SHIPPED}"
    for path in shipped:
        assert TuneProfile.load(path).heads_sha256 == heads_sha, f"{path.name} was tuned with other heads"


def test_tuner_scores_level_one_with_the_drafter(restored_engine):
    """The calibration that sizes static trees must measure what drafts level 1: the drafter, when present.

    The shipped drafter is the better level-1 drafter (MT-Bench head-1 top-1 0.61 against the MLP head's
    0.50, HEADS.md), so calibrating with it must show higher level-1 acceptance; levels 2+ are the heads'.
    """
    from elesium.inference.tuning.tuner import head_acceptance

    engine = restored_engine
    heads = engine.heads
    assert heads is not None and heads.drafter is not None
    prompts = ["List three causes of a failed database backup.", "Write a haiku about autumn rain."]
    with_drafter = head_acceptance(engine, prompts, max_tokens=32)
    heads.drafter = None
    engine.heads = heads  # re-arm the runner without the drafter (the fixture puts it back)
    without = head_acceptance(engine, prompts, max_tokens=32)
    assert with_drafter[1:] == without[1:]
    # Top-1 at level 1 is what a tree's first draft gets accepted on (here 0.48 against 0.41 of 56 positions).
    assert with_drafter[0][0] > without[0][0], (with_drafter[0][:3], without[0][:3])


def test_tuner_scores_every_level_of_a_drafter_tree(restored_engine):
    """With the shipped eagle drafter tree, every level is the drafter's (unrolled along the true path):
    five levels, and levels 2-4 beat the Hydra heads' (MT-Bench top-1 0.60 / 0.59 / 0.58 against 0.40 /
    0.40 / 0.38, HEADS.md)."""
    from elesium.inference.drafters.drafter_tree import DrafterTree
    from elesium.inference.drafters.files import default_heads_dir, load_heads
    from elesium.inference.tuning.tuner import head_acceptance

    engine = restored_engine
    prompts = ["List three causes of a failed database backup.", "Write a haiku about autumn rain."]
    hydra = head_acceptance(engine, prompts, max_tokens=32)
    engine.heads = load_heads(default_heads_dir().with_name("smollm2-135m-instruct-eagle"),
                              base_sha256=engine.weights_info.sha256, device=engine.model.device,
                              dtype=engine.model.dtype)
    assert isinstance(engine.heads, DrafterTree) and engine.heads.num_heads == 5
    tree = head_acceptance(engine, prompts, max_tokens=32)
    assert len(tree) == 5 and len(hydra) == 4
    deep_tree, deep_hydra = sum(tree[d][0] for d in (1, 2, 3)), sum(hydra[d][0] for d in (1, 2, 3))
    assert deep_tree > deep_hydra, ([row[0] for row in tree], [row[0] for row in hydra])
