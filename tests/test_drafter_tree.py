"""The eagle drafter tree: the attention drafter drafts every level from its own features.

The unrolled training path (``FeatureDrafter.unrolled``) and the cached tree expansion
(``DrafterTree.expand``) must be one function, row for row; decoding with it must stay exact; its files
round-trip and refuse another base model; ``train-heads --kind eagle`` trains, resumes and ships it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from elesium.inference.decoding.speculative import TreeDecoder
from elesium.inference.decoding.tree_policy import TreePolicy
from elesium.inference.drafters.attention_drafter import FeatureDrafter, unrolled_mask
from elesium.inference.drafters.drafter_tree import DrafterTree
from elesium.inference.drafters.files import HeadsMismatchError, load_heads, read_manifest, save_heads
from elesium.inference.prompts import write_jsonl
from elesium.inference.runtime.forward import ForwardRunner
from elesium.inference.sampling import Sampler, SamplingParams
from elesium.inference.training.drafter_training import depth_logits, padded
from elesium.inference.training.head_training import TrainConfig, train
from helpers import (
    SHA,
    VOCAB,
    ChainRunner,
    cycle_records,
    fit_drafter,
    greedy_continuation,
    tiny_engine,
    tiny_model,
)


def random_tree(seed: int = 0, depth: int = 4) -> tuple:
    """Tiny base model and a drafter tree with random (not default-initialised-small) weights."""
    model = tiny_model(seed)
    torch.manual_seed(seed + 1)
    drafter = FeatureDrafter.for_model(model.config)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return model, DrafterTree(drafter, depth).eval().requires_grad_(False)


def test_unrolled_mask_is_the_chain_of_ancestors():
    m = unrolled_mask(6, 3, torch.device("cpu"))
    # depth 3, row 4: context up to t = 2 in depth 1, then its depth-2 ancestor (row 3) and itself (row 4)
    assert m[4].nonzero().flatten().tolist() == [0, 1, 2, 6 + 3, 12 + 4]
    assert m[0].nonzero().flatten().tolist() == [12]  # no context: only itself (callers mask the row)


@torch.no_grad()
def test_unrolled_depth_one_is_the_sequence_path():
    model, tree = random_tree()
    hidden, tokens = torch.randn(2, 11, 32), torch.randint(VOCAB, (2, 11))
    torch.testing.assert_close(tree.drafter.unrolled(model, hidden, tokens, 1)[0],
                               tree.drafter.sequence(model, hidden, tokens), rtol=1e-5, atol=1e-5)


def _path(parents: torch.Tensor, tokens: torch.Tensor, level_rows: list[int], level: int, row: int,
          topk: int) -> list[int]:
    """The drafted tokens leading to ``row`` of ``level`` (oldest first), from expand's layout."""
    path = []
    while level > 0:
        flat = int(parents[level_rows[level] + row])
        prev_row, rank = divmod(flat, topk)
        path.append(int(tokens[level_rows[level - 1] + prev_row, rank]))
        level, row = level - 1, prev_row
    return path[::-1]


@torch.no_grad()
@pytest.mark.parametrize("live", [True, False], ids=["eager-live-slots", "whole-cache"])
def test_cached_tree_expansion_equals_the_unrolled_path(live):
    """Every row of every level of a drafted tree scores exactly what the unrolled (training) path
    scores for the same context and drafted path."""
    model, tree = random_tree(1, depth=4)
    drafter = tree.drafter
    width, topk, prefix = 3, 3, 9
    context = torch.randint(VOCAB, (prefix + 1,))  # x_0 .. x_t and the chosen x_{t+1}
    hidden = model(context[None, :-1], torch.arange(prefix), model.new_cache(prefix + 1), 0)[0]
    runner = ForwardRunner(model, model.new_cache(64), tree)
    cache = runner.drafter_cache
    start = torch.tensor(0) if not live else 0
    tokens, logprobs, parents = tree.draft_tree(model, hidden, context[1:], start,
                                                torch.tensor([prefix - 1]), width, topk, cache)
    level_rows = [0, 1, 1 + width, 1 + 2 * width]
    assert tokens.shape == (1 + 3 * width, topk) and parents[0] == -1
    t = prefix - 1
    for level in range(4):
        for row in range(1 if level == 0 else width):
            path = _path(parents, tokens, level_rows, level, row, topk)
            seq = torch.cat([context, torch.tensor(path, dtype=torch.long)])  # x_0 .. x_{t+1+level}
            n = seq.numel() - 1
            h = torch.cat([hidden, torch.zeros(n - prefix, 32)])  # rows past t never reach depth-d rows
            feats = drafter.unrolled(model, h[None], seq[None, 1:], level + 1)[level][0, t + level]
            want = torch.log_softmax(model.logits(feats), -1).topk(topk)
            got_row = level_rows[level] + row
            assert tokens[got_row].tolist() == want.indices.tolist(), (level, row)
            torch.testing.assert_close(logprobs[got_row], want.values, rtol=1e-4, atol=1e-4)
    # the scratch region sits past every slot a real or padding row may write
    assert cache[0].shape[2] == 64 + runner.draft_rows + tree.scratch_slots


@pytest.fixture(scope="module")
def fitted() -> tuple:
    """A tiny model, a depth-4 drafter tree fitted (unrolled) to vanilla's greedy continuation of PROMPT,
    and that continuation: drafts get accepted several levels deep."""
    model, tree = random_tree(3, depth=4)
    want = greedy_continuation(model, PROMPT, 60)
    fit_drafter(tree.drafter, model, PROMPT + want, 80, depth=4)
    return model, tree, want


PROMPT = [(5 * i + 1) % VOCAB for i in range(11)]


def _decode(model, tree, runner, temperature: float = 0.0) -> tuple[list[int], list[int]]:
    params = SamplingParams(max_tokens=60, temperature=temperature, seed=7)
    dec = TreeDecoder(runner, tree, params, Sampler(7), TreePolicy(kind="dynamic", max_nodes=12, topk=3,
                                                                   expand_width=4, adapt=False))
    got, accepted = [dec.prefill(PROMPT)], []
    while len(got) < 60:
        step_tokens, record = dec.step(128 - dec.offset)
        got.extend(step_tokens)
        accepted.append(record.accepted_length)
    return got[:60], accepted


@torch.inference_mode()
def test_greedy_with_the_drafter_tree_equals_vanilla(fitted):
    """Host tree steps: vanilla's tokens, with drafts accepted past the first levels."""
    model, tree, want = fitted
    got, accepted = _decode(model, tree, ForwardRunner(model, model.new_cache(128), tree))
    assert got == want
    assert max(accepted) >= 4, f"levels past the second should be accepted (accepted lengths {accepted})"


@torch.inference_mode()
def test_chained_tree_steps_with_the_drafter_tree_equal_vanilla(fitted):
    """The self-feeding tree step (runtime/tree_chain.py, the CUDA path), its body run eagerly: the
    drafter tree drafts on the static (whole-cache) path inside it."""
    model, tree, want = fitted
    runner = ChainRunner(model, model.new_cache(128), tree)
    got, accepted = _decode(model, tree, runner)
    assert got == want
    assert len(runner.chains_started) == 1, "the chain should have carried the whole generation"
    assert max(accepted) >= 4, f"levels past the second should be accepted (accepted lengths {accepted})"


def test_save_load_round_trip_and_wrong_model(tmp_path: Path):
    _, tree = random_tree(4, depth=5)
    save_heads(tree, tmp_path / "f", {"base_model": {"sha256": SHA}})
    assert not (tmp_path / "f" / "heads.safetensors").exists()
    block = read_manifest(tmp_path / "f")["heads"]
    assert block["kind"] == "eagle" and block["num_heads"] == 5
    assert block["drafter"]["file"] == "drafter.safetensors"
    loaded = load_heads(tmp_path / "f", base_sha256=SHA)
    assert isinstance(loaded, DrafterTree) and loaded.num_heads == 5
    for name, value in tree.drafter.state_dict().items():
        torch.testing.assert_close(loaded.drafter.state_dict()[name], value, rtol=0, atol=0)
    assert loaded.source_sha256
    with pytest.raises(HeadsMismatchError, match="trained for base model"):
        load_heads(tmp_path / "f", base_sha256="0" * 64)
    manifest = read_manifest(tmp_path / "f")
    del manifest["heads"]["drafter"]
    (tmp_path / "f" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="needs the manifest's heads.drafter"):
        load_heads(tmp_path / "f", base_sha256=SHA)
    with pytest.raises(TypeError, match="whole context"):
        tree.teacher_forced(tiny_model(), torch.randn(2, 32), torch.zeros(2, 5, dtype=torch.long))


def test_train_eagle_resumes_ships_and_scores_every_depth(tmp_path: Path):
    """train(kind="eagle"): unrolled training lowers every depth's loss, a resumed run equals an
    uninterrupted one, the manifest scores the stored drafter by depth, and --init-drafter starts from
    another directory's drafter."""
    model = tiny_model()
    engine = tiny_engine(model)
    data = write_jsonl(tmp_path / "data.jsonl", cycle_records())

    def cfg(out: Path, steps: int, resume: bool = False, **kw) -> TrainConfig:
        return TrainConfig(out=out, data=data, kind="eagle", num_heads=3, decay=0.8, warmup=2, eval_every=20,
                           ckpt_every=20, resume=resume, save_dtype="float32", storage="float",
                           command="test",
                           drafter_steps=steps, drafter_batch=4, drafter_lr=1e-2, val_fraction=0.25, **kw)

    def quiet(_msg: str) -> None:
        pass

    straight = train(cfg(tmp_path / "a", 40), engine, log=quiet)
    train(cfg(tmp_path / "b", 3), engine, log=quiet)  # warmup 2: its 3 rates are the 8-step run's
    train(cfg(tmp_path / "b", 40, resume=True), engine, log=quiet)
    a, b = (load_heads(tmp_path / d, base_sha256=SHA) for d in ("a", "b"))
    assert isinstance(a, DrafterTree) and a.num_heads == 3
    for name, value in a.drafter.state_dict().items():
        torch.testing.assert_close(b.drafter.state_dict()[name], value, rtol=0, atol=0)
    depths = straight["eval"]["held_out_by_depth"]["as_stored"]
    assert [d["depth"] for d in depths] == [1, 2, 3] and depths[0]["positions"] > 0
    assert straight["training"]["depth"] == 3 and straight["training"]["steps"] == 40
    # Every depth learnt the base model's own next-token choice (the KL target; the data's tokens are not
    # what this random tiny model would say).
    seqs = [r["prompt_ids"] + r["response_ids"] for r in cycle_records()]
    tokens, valid = padded(seqs, torch.device("cpu"))

    def agreement(drafter: FeatureDrafter) -> list[float]:
        with torch.no_grad():
            students, hidden = depth_logits(drafter, model, tokens, 3)
            teacher = model.logits(hidden[:, 1:-1]).argmax(-1)
            rates = []
            for d, s in enumerate(students):
                rows = valid[:, 2:].clone()
                rows[:, :d] = False  # depth d + 1's rows with a context
                rates.append(float((s.argmax(-1) == teacher)[rows].float().mean()))
            return rates

    trained, untrained = agreement(a.drafter), agreement(FeatureDrafter.for_model(model.config))
    assert all(t > u + 0.2 for t, u in zip(trained, untrained)), (trained, untrained)
    # No step: the manifest scores a's drafter as it was loaded.
    warm = train(cfg(tmp_path / "c", 0, init_drafter=tmp_path / "a"), engine, log=quiet)
    assert warm["training"]["init_drafter"] == str(tmp_path / "a")
    assert warm["eval"]["held_out_by_depth"]["as_stored"] == depths
    with pytest.raises(ValueError, match="cannot go with --drafter none"):
        train(cfg(tmp_path / "d", 1, drafter="none"), engine, log=quiet)


@torch.inference_mode()
def test_set_depth_drafts_more_levels_and_changes_the_heads_identity(fitted):
    """``set_depth`` (``--draft-depth``): the same drafter drafts 6 levels instead of its 4, greedy output
    stays vanilla's, and the heads' sha256 (what fingerprints and profiles key on) changes with the depth
    and comes back with the manifest's."""
    import copy

    model, fitted_tree, want = fitted
    tree = copy.deepcopy(fitted_tree)
    tree.source_sha256 = "f" * 64
    tree.set_depth(6)
    assert tree.num_heads == 6 and tree.manifest_depth == 4 and tree.source_sha256 != "f" * 64
    deeper = tree.source_sha256
    runner = ForwardRunner(model, model.new_cache(128), tree)
    assert runner.drafter_cache[0].shape[2] == 128 + 7 + tree.scratch_slots  # slack for 6 levels' rows
    first = torch.randn(1, model.config.hidden_size)
    tokens, _, parents = tree.expand(model, first, torch.tensor([3]), 4, 3, runner.drafter_cache, 20)
    # rows drafted from, one per level's path: the root, 3 at level 2 (level 1 offers 3), 4 at levels 3-6
    assert parents.numel() == 1 + 3 + 4 * 4 and tokens.shape == (parents.numel(), 3)
    got, _ = _decode(model, tree, runner)
    assert got == want
    tree.set_depth(4)
    assert tree.source_sha256 == "f" * 64
    tree.set_depth(6)
    assert tree.source_sha256 == deeper  # a function of the files and the depth, not of the history
    for bad in (0, 17):
        with pytest.raises(ValueError, match="from 1 to 16"):
            tree.set_depth(bad)


def test_engine_draft_depth_needs_a_drafter_tree_and_enters_the_fingerprint():
    """``Engine.load(draft_depth=)`` on the bundled model: the shipped eagle drafter drafts 7 levels,
    under a heads sha256 of its own (so the run fingerprint records it); without a drafter tree it is a
    user error, not a silent no-op."""
    from elesium.errors import SettingsError
    from elesium.inference.drafters.drafter_tree import DrafterTree
    from elesium.inference.drafters.files import default_heads_dir
    from elesium.inference.engine import Engine

    eagle = default_heads_dir().with_name("smollm2-135m-instruct-eagle")
    with pytest.raises(SettingsError, match="eagle drafter tree.*no draft heads"):
        Engine.load(device="cpu", dtype="float32", heads=None, draft_depth=7, max_len=256)
    five = Engine.load(device="cpu", dtype="float32", heads=eagle, max_len=256)
    seven = Engine.load(device="cpu", dtype="float32", heads=eagle, draft_depth=7, max_len=256)
    assert isinstance(seven.heads, DrafterTree) and seven.heads.num_heads == 7 and five.heads.num_heads == 5
    assert seven.fingerprint()["heads_sha256"] != five.fingerprint()["heads_sha256"]
    assert "drafting 7 levels" in seven.describe()["heads_reason"]
    ids = seven.encode_prompt("List the first twelve prime numbers, separated by commas.")
    gen = seven.generate(ids, SamplingParams(max_tokens=32), mode="speculative")
    depths, accepted = [s.tree_depth for s in gen.steps], [s.accepted_length for s in gen.steps]
    assert gen.new_tokens == 32 and max(depths) == 7, depths
    assert max(accepted) > 6, f"no step accepted a draft past level 5: {accepted}"
