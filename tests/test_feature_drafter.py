"""The attention drafter (level 1 for Hydra heads): its two paths, the engine's use of it, storage,
training."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from elesium.inference.decoding.speculative import TreeDecoder
from elesium.inference.decoding.tree_policy import TreePolicy
from elesium.inference.drafters.attention_drafter import FeatureDrafter
from elesium.inference.drafters.files import load_heads, read_manifest, save_heads
from elesium.inference.drafters.hydra import HydraHeads
from elesium.inference.prompts import write_jsonl
from elesium.inference.runtime.forward import ForwardRunner
from elesium.inference.sampling import Sampler, SamplingParams
from elesium.inference.training.drafter_training import drafter_logits, drafter_loss, padded
from elesium.inference.training.head_training import TrainConfig, train
from helpers import SHA, VOCAB, cycle_records, fit_drafter, greedy_continuation, tiny_engine, tiny_model


def random_setup(seed: int = 0) -> tuple:
    """Tiny base model, Hydra chain heads with random weights and a random drafter attached."""
    model = tiny_model(seed)
    torch.manual_seed(seed + 1)
    heads = HydraHeads(32, num_heads=3, num_layers=1, conditioning="chain")
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    heads.drafter = FeatureDrafter.for_model(model.config)
    return model, heads.eval().requires_grad_(False)


@torch.no_grad()
def test_cached_path_matches_sequence_path():
    """``forward`` (cache, any chunking) and ``sequence`` (fused causal attention) are one function."""
    model, heads = random_setup()
    drafter = heads.drafter
    hidden, tokens = torch.randn(2, 13, 32), torch.randint(VOCAB, (2, 13))
    whole = drafter.sequence(model, hidden, tokens)
    k, v = (t.expand(2, -1, -1, -1).clone() for t in drafter.new_cache(16, "cpu", torch.float32))
    cached = drafter(model, hidden, tokens, torch.arange(13), k, v, 0, model.causal(13))
    torch.testing.assert_close(cached, whole, rtol=1e-5, atol=1e-5)
    k, v = drafter.new_cache(16, "cpu", torch.float32)
    pieces, lo = [], 0
    for n in (5, 1, 7):  # prompt chunk, one decode row, a step's accepted rows
        pieces.append(drafter(model, hidden[:1, lo:lo + n], tokens[:1, lo:lo + n], torch.arange(lo, lo + n),
                              k, v,
                              lo, model.causal(n)))
        lo += n
    torch.testing.assert_close(torch.cat(pieces, dim=1), whole[:1], rtol=1e-5, atol=1e-5)
    # it attends
    assert not torch.equal(whole[:, 5], drafter.sequence(model, hidden[:, 5:6], tokens[:, 5:6])[:, 0])


@torch.no_grad()
def test_padded_static_drafting_matches_eager():
    """The CUDA-graph form (tensor offset, padding rows) drafts what the eager form drafts, and leaves
    the drafter cache's real slots identical, over several steps of varying accepted length."""
    model, heads = random_setup(1)
    eager = ForwardRunner(model, model.new_cache(64), heads)
    static_cache = tuple(t.clone() for t in eager.drafter_cache)
    r_max = eager.draft_rows
    start = 0
    for step, n in enumerate((1, 4, 2, r_max, 3)):
        rows, tokens = torch.randn(n, 32), torch.randint(VOCAB, (n,))
        want = eager.expand(heads, rows, tokens.tolist(), start, 4, 3)
        pad_rows = torch.cat([rows, torch.randn(r_max - n, 32)])
        pad_tokens = torch.cat([tokens, torch.randint(VOCAB, (r_max - n,))])
        got = heads.draft_tree(model, pad_rows, pad_tokens, torch.tensor(start), torch.tensor([n - 1]), 4, 3,
                               static_cache)
        for w, g in zip(want, got):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=f"step {step}")
        start += n
        for live, static in zip(eager.drafter_cache, static_cache):
            torch.testing.assert_close(static[:, :, :start], live[:, :, :start], rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_drafter_replaces_level_one_only():
    """Level 0's candidates come from the drafter's feature; deeper levels still come from the chain."""
    model, heads = random_setup(2)
    hidden, token = torch.randn(32), torch.tensor([3])
    feature = torch.randn(1, 32)
    tokens, logprobs, _ = heads.expand(model, hidden, token, 4, 3, first=feature)
    top = torch.log_softmax(model.logits(feature), -1).topk(3)
    assert tokens[0].tolist() == top.indices[0].tolist()
    torch.testing.assert_close(logprobs[0], top.values[0])
    # With the chain's own head-1 output as the feature, nothing changes.
    own, _ = heads.advance(0, hidden[None], model.embed(token))
    plain = heads.expand(model, hidden, token, 4, 3)
    for a, b in zip(heads.expand(model, hidden, token, 4, 3, first=own), plain):
        torch.testing.assert_close(a, b)
    assert tokens[0].tolist() != plain[0][0].tolist()  # the random drafter disagrees with head 1


@torch.inference_mode(False)
@pytest.mark.parametrize("policy", [TreePolicy(kind="dynamic", max_nodes=12, topk=3),
                                    TreePolicy(kind="static",
                                               static_paths=((0,), (1,), (0, 0), (0, 1), (0, 0, 0)))],
                         ids=["dynamic", "static"])
def test_greedy_with_drafter_equals_vanilla(policy):
    """Greedy decoding with drafter-led trees commits exactly vanilla's tokens, across prompt chunks."""
    import elesium.inference.runtime.forward as fwd

    model, heads = random_setup(3)
    prompt = [(5 * i + 1) % VOCAB for i in range(11)]
    params = SamplingParams(max_tokens=60)
    want = greedy_continuation(model, prompt, 60)
    # Fit the drafter to this very continuation, so that its level-1 drafts do get accepted.
    fit_drafter(heads.drafter, model, prompt + want, 60)
    old_chunk = fwd.PREFILL_CHUNK
    fwd.PREFILL_CHUNK = 4  # the prompt reaches the drafter in several chunks
    try:
        dec = TreeDecoder(ForwardRunner(model, model.new_cache(128), heads), heads, params, Sampler(0),
                          policy)
        got = [dec.prefill(prompt)]
        accepted = []
        while len(got) < 60:
            tokens, record = dec.step(128 - dec.offset)
            got.extend(tokens)
            accepted.append(record.accepted_length)
    finally:
        fwd.PREFILL_CHUNK = old_chunk
    assert got[:60] == want[:60]
    assert dec.row_start + len(dec.row_tokens) == dec.offset  # the drafter has read every committed position
    assert max(accepted) > 1  # drafts were accepted, so the drafter read several rows at once


def test_save_load_round_trip_with_drafter(tmp_path: Path):
    _, heads = random_setup(4)
    save_heads(heads, tmp_path / "f", {"base_model": {"sha256": SHA}})
    save_heads(copy.deepcopy(heads).half(), tmp_path / "q", {"base_model": {"sha256": SHA}}, storage="mixed")
    block = read_manifest(tmp_path / "f")["heads"]["drafter"]
    assert block == {**heads.drafter.config(), "file": "drafter.safetensors", "storage": "float"}
    loaded = load_heads(tmp_path / "f", base_sha256=SHA)
    for name, value in heads.drafter.state_dict().items():
        torch.testing.assert_close(loaded.drafter.state_dict()[name], value, rtol=0, atol=0)
    quantised = load_heads(tmp_path / "q", base_sha256=SHA)
    assert quantised.drafter is not None and quantised.drafter.fc.weight.dtype == torch.float32
    size = {d: (tmp_path / d / "drafter.safetensors").stat().st_size for d in ("q", "f")}
    assert size["q"] < 0.5 * size["f"]
    # The profile key covers the drafter too.
    heads.drafter = None
    save_heads(heads, tmp_path / "plain", {"base_model": {"sha256": SHA}})
    assert load_heads(tmp_path / "plain", base_sha256=SHA).source_sha256 != loaded.source_sha256
    # Re-saving without a drafter removes the old drafter file; a manifest naming a missing one fails.
    save_heads(heads, tmp_path / "f", {"base_model": {"sha256": SHA}})
    assert not (tmp_path / "f" / "drafter.safetensors").exists()
    assert load_heads(tmp_path / "f", base_sha256=SHA).drafter is None
    manifest = read_manifest(tmp_path / "q")
    (tmp_path / "q" / "drafter.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="drafter.safetensors is missing"):
        load_heads(tmp_path / "q", base_sha256=SHA)
    manifest["heads"]["kind"] = "medusa"
    (tmp_path / "q" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="only supported with hydra"):
        load_heads(tmp_path / "q", base_sha256=SHA)


def test_drafter_training_lowers_the_loss():
    """The KL target is the base model's own distribution: training must approach it, loss and argmax."""
    model = tiny_model()
    torch.manual_seed(0)
    drafter = FeatureDrafter.for_model(model.config)
    seqs = [r["prompt_ids"] + r["response_ids"] for r in cycle_records()]
    tokens, valid = padded(seqs, torch.device("cpu"))

    def measure() -> tuple[float, float]:
        with torch.no_grad():
            student, hidden = drafter_logits(drafter, model, tokens)
            agree = student.argmax(-1) == model.logits(hidden[:, 1:-1]).argmax(-1)
            return float(drafter_loss(drafter, model, tokens,
                                      valid)), float(agree[valid[:, 2:]].float().mean())

    before, agree_before = measure()
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    for _ in range(40):
        loss = drafter_loss(drafter, model, tokens, valid)
        opt.zero_grad()
        loss.backward()
        opt.step()
    after, agree_after = measure()
    assert after < 0.5 * before
    assert agree_after > agree_before + 0.2


def test_train_heads_with_drafter_resumes_and_ships(tmp_path: Path):
    """train() with a drafter: a resumed run equals an uninterrupted one; the manifest scores the stored
    drafter."""
    engine = tiny_engine(tiny_model())
    data = write_jsonl(tmp_path / "data.jsonl", cycle_records())

    def cfg(out: Path, steps: int, resume: bool = False, **kw) -> TrainConfig:
        return TrainConfig(out=out, data=data, steps=4, batch_size=32, lr=1e-2, warmup=2, eval_every=3,
                           ckpt_every=3,
                           num_heads=2, kind="hydra", conditioning="chain", loss="kl", resume=resume,
                           save_dtype="float32", command="test", drafter="attention", drafter_steps=steps,
                           drafter_batch=4, drafter_lr=1e-2, val_fraction=0.25, **kw)

    def quiet(_msg: str) -> None:
        pass

    straight = train(cfg(tmp_path / "a", 6), engine, log=quiet)
    train(cfg(tmp_path / "b", 3), engine, log=quiet)
    train(cfg(tmp_path / "b", 6, resume=True), engine, log=quiet)
    a, b = (load_heads(tmp_path / d, base_sha256=SHA) for d in ("a", "b"))
    for name, value in a.drafter.state_dict().items():
        torch.testing.assert_close(b.drafter.state_dict()[name], value, rtol=0, atol=0)
    assert straight["training"]["drafter"]["steps"] == 6
    assert [h["step"] for h in straight["training"]["drafter"]["history"]] == [3, 6]
    held = straight["eval"]["held_out_drafter"]
    assert held["as_stored"]["positions"] > 0 and 0 <= held["as_stored"]["top1"] <= 1
    stored = train(cfg(tmp_path / "q", 2, storage="int4"), engine, log=quiet)
    assert stored["heads"]["drafter"]["storage"] == "int4"
    with pytest.raises(ValueError, match="hydra heads"):
        train(TrainConfig(out=tmp_path / "m", data=data, steps=1, kind="medusa", drafter="attention"), engine,
              log=quiet)
