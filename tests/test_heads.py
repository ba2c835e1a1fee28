"""Medusa heads, their training loop and the distillation prompt set, on tiny synthetic models (fast)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from elesium.inference.drafters.files import (
    HeadsMismatchError,
    default_heads_dir,
    load_heads,
    read_manifest,
    save_heads,
)
from elesium.inference.drafters.medusa import MedusaHeads
from elesium.inference.prompts import read_jsonl, read_prompts, write_jsonl
from elesium.inference.training.distill import build_prompts
from elesium.inference.training.head_training import (
    TrainConfig,
    cache_hidden_states,
    evaluate,
    head_losses,
    lr_at,
    train,
)
from helpers import MT_BENCH, SHA, VOCAB, cycle_records, tiny_engine, tiny_model


def test_shapes_and_head_logits():
    model = tiny_model()
    heads = MedusaHeads(32, num_heads=3, num_layers=2)
    hidden = torch.randn(2, 5, 32)
    assert heads(hidden).shape == (3, 2, 5, 32)
    logits = heads.head_logits(model, hidden)
    assert logits.shape == (3, 2, 5, VOCAB) and logits.dtype == torch.float32
    with pytest.raises(ValueError, match="hidden size"):
        heads(torch.randn(2, 16))


def test_zero_init_heads_reproduce_lm_head():
    model = tiny_model()
    heads = MedusaHeads(32, num_heads=4)
    hidden = torch.randn(7, 32)
    expected = model.logits(hidden)
    out = heads(hidden)
    logits = heads.head_logits(model, hidden)
    for k in range(4):
        # x + SiLU(0 x + 0) is x exactly; the [K, ...] matmul may round differently from the [...] one.
        torch.testing.assert_close(out[k], hidden, rtol=0, atol=0)
        torch.testing.assert_close(model.logits(out[k]), expected, rtol=0, atol=0)
        torch.testing.assert_close(logits[k], expected, rtol=1e-5, atol=1e-5)


def test_every_block_owns_its_weights():
    """Medusa's reference repeats one block object; ours must not share parameters between layers/heads."""
    heads = MedusaHeads(32, num_heads=2, num_layers=3)
    ptrs = [p.data_ptr() for p in heads.parameters()]
    assert len(ptrs) == len(set(ptrs)) == 2 * 3 * 2
    with torch.no_grad():
        heads.heads[0][0].linear.weight.fill_(1.0)
    assert heads.heads[0][1].linear.weight.abs().sum() == 0
    assert heads.heads[1][0].linear.weight.abs().sum() == 0


def test_fp16_heads_run_on_a_float32_model():
    model = tiny_model()
    heads = MedusaHeads(32, num_heads=2).to(torch.float16)
    hidden = torch.randn(3, 32)
    out = heads(hidden)
    assert out.dtype == torch.float32
    assert heads.head_logits(model, hidden).shape == (2, 3, VOCAB)


def test_hidden_cache_targets_align_with_tokens():
    model = tiny_model()
    recs = cycle_records(n=3, length=10)
    cache = cache_hidden_states(model, [(r["prompt_ids"], r["response_ids"]) for r in recs], batch_size=2)
    assert len(cache) == 3 * 6  # rows t = P-1 .. L-2
    # Row 0 is the last prompt token of sequence 0; its next token is the first answer token.
    assert int(cache.next_token[0]) == recs[0]["response_ids"][0]
    # Head k's target row stays inside the sequence: the last k+1 rows of each sequence have none.
    _, valid = cache.target_rows(torch.arange(len(cache)), 1)
    assert valid.tolist() == ([True] * 4 + [False] * 2) * 3
    # A batch-of-1 forward gives the same hidden states as the padded batch.
    alone = cache_hidden_states(model, [(recs[1]["prompt_ids"], recs[1]["response_ids"])])
    torch.testing.assert_close(alone.hidden, cache.hidden[6:12], rtol=1e-5, atol=1e-5)


def fit_briefly(heads, model, cache, loss: str, lr: float, measure: str,
                head: int) -> tuple[float, float, float, float]:
    """25 full-batch AdamW steps on ``loss``: (``measure`` loss before, after, head's top-1 before, after)."""
    opt = torch.optim.AdamW(heads.parameters(), lr=lr)
    rows = torch.arange(len(cache))

    def measured() -> tuple[float, float]:
        total = sum(float(x.detach()) for x in head_losses(heads, model, cache, rows, measure)[0])
        return total, evaluate(heads, model, cache)[head]["top1"]

    before, top1_before = measured()
    for _ in range(25):
        losses, _, _ = head_losses(heads, model, cache, rows, loss)
        opt.zero_grad()
        sum(losses).backward()
        opt.step()
    after, top1_after = measured()
    return before, after, top1_before, top1_after


@pytest.mark.parametrize("loss", ["ce", "kl"])
def test_training_lowers_the_loss(loss):
    model = tiny_model()
    recs = cycle_records()
    cache = cache_hidden_states(model, [(r["prompt_ids"], r["response_ids"]) for r in recs])
    before, after, top1_before, top1_after = fit_briefly(MedusaHeads(32, num_heads=2), model, cache, loss,
                                                         lr=3e-2, measure="ce", head=0)
    assert after < 0.7 * before
    assert top1_after > top1_before + 0.05


def test_train_end_to_end_resume_and_ship(tmp_path: Path):
    """The whole recipe on a tiny model: a resumed run equals an uninterrupted one, bit for bit."""
    model = tiny_model()
    data = write_jsonl(tmp_path / "data.jsonl", cycle_records())
    engine = tiny_engine(model)

    def cfg(out: Path, steps: int, resume: bool = False) -> TrainConfig:
        return TrainConfig(out=out, data=data, steps=steps, batch_size=32, lr=1e-2, warmup=2, eval_every=3,
                           ckpt_every=3, num_heads=2, loss="ce", resume=resume, save_dtype="float32",
                           command="test", kind="medusa", num_layers=1, storage="float", drafter="none")

    quiet = lambda _msg: None  # noqa: E731
    straight = train(cfg(tmp_path / "a", 6), engine, log=quiet)
    train(cfg(tmp_path / "b", 3), engine, log=quiet)
    resumed = train(cfg(tmp_path / "b", 6, resume=True), engine, log=quiet)
    a = load_heads(tmp_path / "a", base_sha256=SHA)
    b = load_heads(tmp_path / "b", base_sha256=SHA)
    for pa, pb in zip(a.state_dict().values(), b.state_dict().values()):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0)
    assert resumed["training"]["steps"] == straight["training"]["steps"] == 6
    assert straight["eval"]["held_out"][0]["head"] == 1
    assert straight["heads"]["num_heads"] == 2 and straight["base_model"]["sha256"] == SHA
    foreign = write_jsonl(tmp_path / "foreign.jsonl",
                          [{**r, "model_sha256": "b" * 64} for r in cycle_records(2)])
    with pytest.raises(ValueError, match="generated by base model"):
        train(TrainConfig(out=tmp_path / "c", data=foreign, steps=1), engine, log=quiet)


def test_lr_schedule_warms_up_then_decays():
    cfg = TrainConfig(steps=100, warmup=10, lr=1.0, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(0.1)
    assert lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(10, cfg) == pytest.approx(1.0)
    assert lr_at(100, cfg) == pytest.approx(0.1)
    assert lr_at(40, cfg) > lr_at(60, cfg)


def test_save_load_round_trip(tmp_path: Path):
    heads = MedusaHeads(32, num_heads=3, num_layers=2)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_()
    save_heads(heads, tmp_path / "h", {"base_model": {"sha256": SHA}, "eval": {"x": 1}})
    loaded = load_heads(tmp_path / "h", base_sha256=SHA, device="cpu", dtype=torch.float32)
    assert (loaded.num_heads, loaded.num_layers) == (3, 2)
    x = torch.randn(4, 32)
    torch.testing.assert_close(loaded(x), heads(x), rtol=0, atol=0)
    manifest = read_manifest(tmp_path / "h")
    assert manifest["heads"] == {"kind": "medusa", "num_heads": 3, "num_layers": 2, "hidden_size": 32,
                                 "dtype": "float32", "storage": "float"}
    assert manifest["eval"] == {"x": 1}
    half = load_heads(tmp_path / "h" / "heads.safetensors", base_sha256=SHA, dtype=torch.float16)
    assert half.dtype == torch.float16


def test_mismatched_base_model_is_refused(tmp_path: Path):
    save_heads(MedusaHeads(32, num_heads=1), tmp_path, {"base_model": {"sha256": SHA}})
    other = "b" * 64
    with pytest.raises(HeadsMismatchError) as err:
        load_heads(tmp_path, base_sha256=other)
    assert SHA in str(err.value) and other in str(err.value)
    assert isinstance(err.value, ValueError)
    with pytest.raises(FileNotFoundError, match="heads not found"):
        load_heads(tmp_path / "missing", base_sha256=SHA)
    with pytest.raises(ValueError, match="base_model.sha256"):
        save_heads(MedusaHeads(32, num_heads=1), tmp_path / "x", {})


def test_manifests_from_before_the_format_rename_still_load(tmp_path: Path):
    """Heads written as "elesium-medusa-heads/1" (before Hydra heads and the drafter) load unchanged."""
    heads = MedusaHeads(32, num_heads=2)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_()
    save_heads(heads, tmp_path, {"base_model": {"sha256": SHA}})
    path = tmp_path / "manifest.json"
    manifest = json.loads(path.read_text())
    assert manifest["format"] == "elesium-draft-heads/1"
    manifest["format"] = "elesium-medusa-heads/1"
    path.write_text(json.dumps(manifest))
    assert read_manifest(tmp_path)["format"] == "elesium-medusa-heads/1"
    loaded = load_heads(tmp_path, base_sha256=SHA)
    x = torch.randn(3, 32)
    torch.testing.assert_close(loaded(x), heads(x), rtol=0, atol=0)
    manifest["format"] = "elesium-heads/9"
    path.write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="unknown heads format 'elesium-heads/9'"):
        load_heads(tmp_path, base_sha256=SHA)


def test_shipped_heads_fit_the_budget():
    directory = default_heads_dir()
    manifest = read_manifest(directory)
    # Hydra (chain) heads: 4 x (2 x 576 x 1152) weights, int8 R + int4 W = 4.2 MB; tracked files stay < 5 MiB.
    assert (directory / "heads.safetensors").stat().st_size < 5 * 2**20
    assert manifest["heads"]["storage"] == "mixed"
    assert manifest["heads"]["kind"] == "hydra" and manifest["heads"]["conditioning"] == "chain"
    assert manifest["heads"]["num_heads"] == 4 and manifest["heads"]["hidden_size"] == 576
    assert manifest["heads"]["vocab_size"] == 49152
    for key in ("training", "eval", "command", "hardware"):
        assert manifest[key]


def test_prompt_set_is_deterministic_diverse_and_not_mt_bench():
    a, b = build_prompts(400, seed=3), build_prompts(400, seed=3)
    assert a == b and a != build_prompts(400, seed=4)
    assert len({p["prompt"] for p in a}) == 400
    # enterprise + general tasks
    assert len({p["task"] for p in a}) >= 30 and len({p["domain"] for p in a}) >= 10
    turns = {t for line in MT_BENCH.read_text().splitlines() if line.strip() for t
             in json.loads(line)["turns"]}
    assert len(turns) == 160
    assert not turns & {p["prompt"] for p in build_prompts(3000, seed=0)}


def test_jsonl_io_and_eval_prompt_formats(tmp_path: Path):
    gz = write_jsonl(tmp_path / "x.jsonl.gz", [{"prompt": "hi"}, {"turns": ["first", "second"]}])
    assert list(read_jsonl(gz))[1]["turns"][0] == "first"
    assert read_prompts(gz) == ["hi", "first"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match="line 1"):
        read_prompts(bad)
    with pytest.raises(FileNotFoundError):
        read_prompts(tmp_path / "nope.jsonl")


def test_train_heads_defaults_are_the_shipped_recipe():
    """`elesium train-heads` with no flags must train what we ship, so the one command reproduces it."""
    from elesium.cli import build_parser

    args = build_parser().parse_args(["train-heads"])
    manifest = read_manifest(default_heads_dir())
    heads, training = manifest["heads"], manifest["training"]
    assert (args.kind, args.conditioning, args.num_heads, args.num_layers, args.storage) == (
        heads["kind"], heads["conditioning"], heads["num_heads"], heads["num_layers"], heads["storage"])
    assert (args.loss, args.decay, args.steps, args.batch_size, args.lr, args.warmup, args.seed) == (
        training["loss"], training["decay"], training["steps"], training["batch_size"], training["lr"],
        training["warmup"], training["seed"])
    assert args.drafter == ("attention" if "drafter" in heads else "none")
    if "drafter" in heads:
        drafter = training["drafter"]
        assert (args.drafter_steps, args.drafter_batch, args.drafter_lr) == (
            drafter["steps"], drafter["batch_sequences"], drafter["lr"])
        assert args.drafter_intermediate in (None, heads["drafter"]["intermediate_size"])
    assert args.prompts == training["data"]["prompts"]
    assert sorted(args.temperatures) == training["data"]["temperatures"]
    assert args.max_new_tokens == training["data"]["max_new_tokens"]
