"""The GGUF-built tokenizer against fixed ids and an independent pure-Python BPE."""

from __future__ import annotations

import pytest

SAMPLES = [
    "Hello world",
    "  leading  spaces\n\n\ttabs and trailing   ",
    "12345 + 678 = 13023",
    "naïve café, 日本語, emoji 🙂 and Ω≈ç√",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "def f(x):\n    return x ** 2  # square\n",
]


def reference_bpe(tokenizer, text: str) -> list[int]:
    """Rank-ordered pair merging over the pre-tokenized pieces: the textbook BPE algorithm."""
    backend = tokenizer.backend
    model = __import__("json").loads(backend.to_str())["model"]
    ranks = {tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m): i for i,
             m in enumerate(model["merges"])}
    vocab = model["vocab"]
    ids: list[int] = []
    for piece, _ in backend.pre_tokenizer.pre_tokenize_str(text):
        parts = list(piece)
        while len(parts) > 1:
            pairs = [(ranks.get((a, b), 1 << 30), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
            rank, i = min(pairs)
            if rank == 1 << 30:
                break
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        ids.extend(vocab[p] for p in parts)
    return ids


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip(weights, text):
    tok = weights.tokenizer
    assert tok.decode(tok.encode(text)) == text


def test_fixed_ids(weights):
    tok = weights.tokenizer
    assert tok.encode("Hello world") == [19556, 905]
    assert tok.encode("<|im_start|>user\nhi<|im_end|>") == [1, 4093, 198, 6004, 2]
    # Digits are split one by one (SmolLM's pre-tokenizer).
    assert tok.encode("12345") == [33, 34, 35, 36, 37]
    assert tok.token_to_id("<|im_end|>") == 2 and 2 in tok.eos_ids


@pytest.mark.parametrize("text", [s for s in SAMPLES if "<|" not in s])
def test_matches_reference_bpe(weights, text):
    tok = weights.tokenizer
    assert tok.encode(text) == reference_bpe(tok, text)


def test_chat_template_has_generation_prompt(weights):
    tok = weights.tokenizer
    text = tok.render_chat([{"role": "user", "content": "Hi"}])
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert text.startswith("<|im_start|>system\n")
    ids = tok.encode_chat([{"role": "user", "content": "Hi"}])
    assert ids[0] == 1 and ids.count(1) == 3  # three <|im_start|> markers, each one token


def test_tokenizer_serialisation_round_trip(weights):
    from elesium.inference.weights.tokenizer import Tokenizer

    tok = weights.tokenizer
    again = Tokenizer.from_json(tok.to_json())
    for text in SAMPLES:
        assert again.encode(text) == tok.encode(text)
    assert again.eos_ids == tok.eos_ids and again.chat_template == tok.chat_template
