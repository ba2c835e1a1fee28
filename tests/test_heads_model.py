"""Draft heads against the real bundled model: batched generation, shipped heads, the eval-heads CLI."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from elesium.cli import main
from elesium.inference.drafters.files import default_heads_dir, load_heads, save_heads
from elesium.inference.drafters.hydra import HydraHeads
from elesium.inference.drafters.medusa import MedusaHeads
from elesium.inference.training.distill import generate_batch

PROMPTS = ["Summarise: the VPN is down for the whole floor since 9am.",
           "What is 17 + 25?",
           "Write a haiku about incident reviews and the long night before the fix finally shipped to "
           "production."]


def test_batched_greedy_equals_unbatched(engine):
    ids = [engine.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    assert len({len(i) for i in ids}) == 3  # different lengths: left padding is exercised
    eos = engine.tokenizer.eos_ids
    batched = generate_batch(engine.model, ids, 4, eos_ids=eos)
    for prompt, out in zip(ids, batched):
        assert out == generate_batch(engine.model, [prompt], 4, eos_ids=eos)[0]
        assert len(out) >= 1


@pytest.mark.parametrize("which", ["default (hydra)", "medusa"])
def test_shipped_heads_load_and_beat_zero_init(engine, which):
    medusa = default_heads_dir().with_name("smollm2-135m-instruct-medusa")
    directory = None if which.startswith("default") else medusa
    heads = load_heads(directory, base_sha256=engine.weights_info.sha256, device="cpu", dtype=torch.float32)
    assert heads.num_heads == 4
    assert isinstance(heads, HydraHeads if which.startswith("default") else MedusaHeads)
    model, tok = engine.model, engine.tokenizer
    ids = tok.encode_chat([{"role": "user", "content": PROMPTS[0]}])
    answer = generate_batch(model, [ids], 16, eos_ids=tok.eos_ids)[0]
    seq = torch.tensor(ids + answer)
    rows = torch.arange(len(ids) - 1, len(seq) - 1 - heads.num_heads)
    path = seq[rows[:, None] + 1 + torch.arange(heads.num_heads)]  # x_{t+1} ... x_{t+K}
    with torch.inference_mode():
        hidden = model(seq[None], torch.arange(len(seq)), model.new_cache(len(seq)), 0)[0]
        trained = model.logits(heads.teacher_forced(model, hidden[rows], path)[0]).argmax(-1)
        untrained = MedusaHeads(576).head_logits(model, hidden[rows])[0].argmax(-1)
    target = seq[rows + 2]
    assert (trained == target).float().mean() > (untrained == target).float().mean()


def test_shipped_drafter_beats_the_mlp_head_1(engine):
    """The attention drafter is what the engine drafts level 1 with; it must earn its place on real text."""
    from elesium.inference.training.head_training import score_prompts

    heads = load_heads(None, base_sha256=engine.weights_info.sha256, device="cpu", dtype=torch.float32)
    assert heads.drafter is not None
    result = score_prompts(engine.model, engine.tokenizer, heads, PROMPTS, max_tokens=48, batch_size=4)
    head1, mlp = result["heads"][0], result["mlp_head1"]
    assert head1["source"] == "drafter" and head1["positions"] == mlp["positions"] > 50
    assert head1["top1"] > mlp["top1"] + 0.03


def test_eval_heads_cli(engine, tmp_path: Path, capsys, monkeypatch):
    # The CLI path end to end, minus a second multi-second model load: reuse the session's engine.
    from elesium.cli.commands import eval_heads

    monkeypatch.setattr(eval_heads, "load_engine", lambda args, **kwargs: engine)
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"prompt": PROMPTS[0]}, {"turns": [PROMPTS[1], "again"]}]
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert main(["eval-heads", "--prompts", str(prompts), "--max-tokens", "3", "--json", "--device", "cpu",
                 "--dtype", "float32"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [h["head"] for h in result["heads"]] == [1, 2, 3, 4]
    assert result["heads"][0]["source"] == "drafter" and result["mlp_head1"]["head"] == 1
    assert all(0.0 <= h["top1"] <= h["top5"] <= 1.0 for h in result["heads"])
    assert 2 <= result["tokens"] <= 6 and result["prompts"] == 2
    # The whole drafter decoding (--tree, on by default): under the engine's policy and as a top-1 chain.
    tree, chain = result["drafter"]["tree"], result["drafter"]["chain"]
    assert tree["steps"] >= 1 and 1.0 <= tree["tau"] <= 5.0 and 2 <= tree["tokens"] <= 6
    rates = chain["accept_rate_by_depth"]
    assert len(rates) == 4 and chain["mean_tree_size"] == 5.0  # root + one top-1 draft per head
    assert all(0.0 <= b <= a <= 1.0 for a, b in zip(rates, rates[1:]))  # depth d+1 needs depth d
    assert chain["conditional"][0] == rates[0]

    wrong = save_heads(MedusaHeads(576, num_heads=2), tmp_path / "wrong",
                       {"base_model": {"sha256": "0" * 64}})
    assert main(["eval-heads", "--prompts", str(prompts), "--heads", str(wrong), "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("elesium: error:") and "0" * 64 in err and engine.weights_info.sha256 in err
    assert main(["eval-heads", "--prompts", str(tmp_path / "none.jsonl")]) == 1
    assert "not found" in capsys.readouterr().err


def test_distill_only_writes_the_data_that_the_same_command_then_trains_on(engine, tmp_path: Path):
    from elesium.inference.prompts import read_jsonl
    from elesium.inference.training.head_training import TrainConfig, train

    quiet = lambda _msg: None  # noqa: E731
    cfg = TrainConfig(out=tmp_path / "h", prompts=2, max_new_tokens=3, gen_batch=4, distill_only=True)
    assert train(cfg, engine, log=quiet) == {"data": str(tmp_path / "h" / "distill.jsonl.gz")}
    records = list(read_jsonl(tmp_path / "h" / "distill.jsonl.gz"))
    assert len(records) == 4 and {r["sampling"]["temperature"] for r in records} == {0.0, 0.7}
    assert not (tmp_path / "h" / "heads.safetensors").exists()
    before = (tmp_path / "h" / "distill.jsonl.gz").read_bytes()
    # Small heads and no drafter: the library defaults are the shipped recipe (thousands of drafter steps).
    again = replace(cfg, distill_only=False, steps=1, batch_size=8, num_heads=2, save_dtype="float32",
                    kind="medusa", num_layers=1, storage="float", drafter="none")
    manifest = train(again, engine, log=quiet)
    assert manifest["training"]["data"]["sequences"] == 4 and manifest["training"]["steps"] == 1
    assert (tmp_path / "h" / "distill.jsonl.gz").read_bytes() == before  # reused, not regenerated
    with pytest.raises(ValueError, match="nothing to distil"):
        train(TrainConfig(out=tmp_path / "x", data=tmp_path / "h" / "distill.jsonl.gz", distill_only=True),
              engine, log=quiet)
