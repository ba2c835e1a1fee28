"""Quantised heads files: the int8 / int4 codecs against element-wise references, and the heads round trip."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from elesium.inference.drafters import storage as hs
from elesium.inference.drafters.files import (
    MANIFEST_FORMAT,
    build_heads,
    load_heads,
    read_manifest,
    save_heads,
)
from elesium.inference.drafters.hydra import HydraHeads
from elesium.inference.drafters.medusa import MedusaHeads
from elesium.inference.prompts import write_jsonl
from elesium.inference.training.head_training import TrainConfig, cache_hidden_states, evaluate, train
from helpers import SHA, cycle_records, tiny_engine, tiny_model


def random_weight(rows: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Rows of very different magnitudes, and one all-zero row: scales must be per row / per group.
    w = torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g).mul(4)
    w[1] = 0
    return w.half().float()


def dequantize_int4_reference(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """One element at a time, straight from the layout in the module docstring."""
    rows, half = packed.shape
    group = 2 * half // scale.shape[1]
    out = torch.empty(rows, 2 * half)
    for r in range(rows):
        for c in range(2 * half):
            byte = int(packed[r, c // 2])
            nibble = byte & 0xF if c % 2 == 0 else byte >> 4
            out[r, c] = (nibble - 8) * float(scale[r, c // group])
    return out


@pytest.mark.parametrize("seed", range(3))
def test_int8_is_within_half_a_step_of_every_weight(seed):
    w = random_weight(16, 96, seed)
    q, scale = hs.quantize_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (16, 1)
    back = hs.dequantize_int8(q, scale)
    torch.testing.assert_close(back, q.float() * scale.float(), rtol=0, atol=0)
    assert ((back - w).abs() <= scale.float() * 0.5 * 1.01).all()
    assert back[1].abs().sum() == 0 and torch.isfinite(back).all()
    torch.testing.assert_close(scale, (w.abs().amax(1, keepdim=True) / 127).half(), rtol=0, atol=0)


@pytest.mark.parametrize(("seed", "group"), [(0, 64), (1, 32), (2, 8)])
def test_int4_matches_the_elementwise_reference(seed, group):
    w = random_weight(6, 128, seed)
    packed, scale = hs.quantize_int4(w, group)
    assert packed.dtype == torch.uint8 and packed.shape == (6, 64) and scale.shape == (6, 128 // group)
    back = hs.dequantize_int4(packed, scale)
    torch.testing.assert_close(back, dequantize_int4_reference(packed, scale), rtol=0, atol=0)
    step = scale.float().repeat_interleave(group, dim=1)
    assert ((back - w).abs() <= step * 0.5 * 1.01).all()
    # The scale is the smallest that represents each group's largest weight (+-7 steps), so no range is
    # wasted.
    torch.testing.assert_close(scale, (w.view(6, -1, group).abs().amax(2) / 7).half(), rtol=0, atol=0)
    assert torch.isfinite(back).all() and back[1].abs().sum() == 0


def test_int4_rejects_sizes_it_cannot_group():
    with pytest.raises(ValueError, match="multiple of"):
        hs.quantize_int4(torch.randn(4, 100), 64)


@pytest.mark.parametrize("scheme", ["int8", "int4", "mixed"])
def test_requantising_what_was_loaded_is_lossless(scheme):
    """Saving heads that were loaded from a quantised file (train-heads does this) must not drift."""
    state = {"a.weight": random_weight(8, 128, 5), "a.bias": torch.randn(8)}
    tensors, meta = hs.encode_state(state, scheme)
    again, meta_again = hs.encode_state(hs.decode_state(tensors, meta), scheme)
    assert meta == meta_again and tensors.keys() == again.keys()
    for name in tensors:
        torch.testing.assert_close(tensors[name], again[name], rtol=0, atol=0)


def test_encode_keeps_biases_in_float_and_names_its_schemes():
    state = {"a.weight": random_weight(8, 128, 6), "a.bias": torch.randn(8)}
    tensors, meta = hs.encode_state(state, "int4", torch.float16)
    assert set(tensors) == {"a.weight.q", "a.weight.scale", "a.bias"}
    assert tensors["a.bias"].dtype == torch.float16
    assert json.loads(meta["elesium.quantization"]) == {"a.weight": "int4"}
    hydra = {"h.skip.weight": random_weight(8, 128, 7), "h.linear.weight": random_weight(8, 128, 8),
             "h.linear.bias": torch.randn(8)}
    _, mixed = hs.encode_state(hydra, "mixed")
    assert json.loads(mixed["elesium.quantization"]) == {"h.skip.weight": "int8", "h.linear.weight": "int4"}
    plain, no_meta = hs.encode_state(state, "float", torch.float32)
    assert no_meta == {} and torch.equal(plain["a.weight"], state["a.weight"])
    with pytest.raises(ValueError, match="unknown heads storage"):
        hs.encode_state(state, "int3")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="missing"):
        hs.decode_state({"a.bias": tensors["a.bias"]}, meta)
    with pytest.raises(ValueError, match="cannot read"):
        hs.decode_state(tensors, {"elesium.quantization": json.dumps({"a.weight": "nf4"})})


@pytest.mark.parametrize("scheme", ["int8", "int4", "mixed"])
@pytest.mark.parametrize("kind", ["medusa", "hydra"])
def test_quantised_heads_round_trip(tmp_path: Path, scheme, kind):
    torch.manual_seed(0)
    heads = (MedusaHeads(64, num_heads=2) if kind == "medusa"
             else HydraHeads(64, num_heads=2, conditioning="chain"))
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    heads = heads.half()
    save_heads(heads, tmp_path / "q", {"base_model": {"sha256": SHA}}, storage=scheme)
    save_heads(heads, tmp_path / "f", {"base_model": {"sha256": SHA}})
    assert read_manifest(tmp_path / "q")["heads"]["storage"] == scheme
    assert read_manifest(tmp_path / "f")["heads"]["storage"] == "float"
    size = {d: (tmp_path / d / "heads.safetensors").stat().st_size for d in ("q", "f")}
    assert size["q"] < {"int8": 0.6, "int4": 0.35, "mixed": 0.5}[scheme] * size["f"]
    with safe_open(str(tmp_path / "q" / "heads.safetensors"), "pt") as f:
        assert f.metadata()["format"] == MANIFEST_FORMAT == "elesium-draft-heads/1"
    loaded = load_heads(tmp_path / "q", base_sha256=SHA)
    expected = hs.round_trip(heads.state_dict(), scheme, torch.float16)
    for name, value in loaded.state_dict().items():
        torch.testing.assert_close(value, expected[name].float(), rtol=0, atol=0)


def test_train_heads_evaluates_the_weights_it_ships(tmp_path: Path):
    """The manifest's held-out figures must be those of the quantised file, not of the float weights."""
    model = tiny_model()
    recs = cycle_records()
    data = write_jsonl(tmp_path / "data.jsonl", recs)
    engine = tiny_engine(model)
    cfg = TrainConfig(out=tmp_path / "h", data=data, steps=8, batch_size=32, lr=3e-2, warmup=2, eval_every=4,
                      ckpt_every=8, num_heads=2, loss="ce", storage="int4", save_dtype="float32",
                      command="test", val_fraction=0.25, kind="medusa", num_layers=1, drafter="none")
    manifest = train(cfg, engine, log=lambda _msg: None)
    assert manifest["heads"]["storage"] == "int4"
    # The held-out split, as train() draws it (by prompt id, seeded).
    ids = sorted({r["id"] for r in recs})
    random.Random(cfg.seed).shuffle(ids)
    held_ids = set(ids[:int(len(ids) * cfg.val_fraction)])
    held = cache_hidden_states(model, [(r["prompt_ids"],
                                        r["response_ids"]) for r in recs if r["id"] in held_ids])
    shipped = evaluate(load_heads(tmp_path / "h", base_sha256=SHA), model, held)
    unquantised = build_heads(manifest["heads"])
    unquantised.load_state_dict(torch.load(tmp_path / "h" / "ckpt.pt", weights_only=False)["heads"])
    trained = evaluate(unquantised.eval(), model, held)
    for reported, ours, theirs in zip(manifest["eval"]["held_out"], shipped, trained):
        assert reported["positions"] == ours["positions"] > 0
        assert reported["loss"] == pytest.approx(ours["loss"], rel=1e-6)
        assert reported["loss"] != pytest.approx(theirs["loss"], rel=1e-6)
