"""Incremental detokenisation: the streamed text equals a full decode, stop strings behave as before,
and the work per token stays constant."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from elesium.inference.sampling import SamplingParams
from elesium.inference.text_stream import TextStream

MULTIBYTE = [
    "東京は日本の首都です。富士山は美しい。",
    "Emoji: 🙂👍🏽🚀 and a family 👨‍👩‍👧 in one line.",
    "Mixed: naïve café, Ελληνικά, русский, 한국어, and 中文字符.",
]


class ReferenceTextStream:
    """The previous implementation (a full decode per token), kept as the oracle for stop semantics."""

    def __init__(self, tokenizer, stop: Sequence[str]) -> None:
        self.tokenizer, self.stop = tokenizer, tuple(stop)
        self.token_ids: list[int] = []
        self.text, self.emitted, self.stopped = "", 0, False

    def push(self, token: int) -> str:
        self.token_ids.append(token)
        text = self.tokenizer.decode(self.token_ids)
        for s in self.stop:
            at = text.find(s, max(0, len(self.text) - len(s) + 1))
            if at != -1:
                self.stopped = True
                self.text = text[:at]
                return self.flush()
        self.text = text
        final = len(text)
        if text.endswith("\ufffd"):
            final = len(text.rstrip("\ufffd"))
        for s in self.stop:
            for k in range(min(len(s) - 1, final), 0, -1):
                if text[:final].endswith(s[:k]):
                    final = min(final, len(text[:final]) - k)
                    break
        if final <= self.emitted:
            return ""
        out = text[self.emitted:final]
        self.emitted = final
        return out

    def flush(self) -> str:
        out = self.text[self.emitted:]
        self.emitted = len(self.text)
        return out


class CountingTokenizer:
    """The real tokenizer, counting how many ids each ``decode`` call is given."""

    def __init__(self, tokenizer) -> None:
        self.inner = tokenizer
        self.decoded_ids = 0

    def decode(self, ids, **kwargs) -> str:
        self.decoded_ids += len(ids)
        return self.inner.decode(ids, **kwargs)


def run(stream, ids: Sequence[int]) -> tuple[list[str], str]:
    pieces = []
    for t in ids:
        pieces.append(stream.push(t))
        if stream.stopped:
            break
    pieces.append(stream.flush())
    return pieces, stream.text


@pytest.fixture(scope="module")
def model_outputs(engine) -> list[list[int]]:
    """Real generations, greedy and sampled, including some in scripts with multi-byte characters."""
    prompts = [
        ("Translate 'good morning, my friend' into Japanese and Chinese.", SamplingParams(max_tokens=24)),
        ("Reply with a few emoji that describe a happy birthday party.",
         SamplingParams(max_tokens=16, temperature=1.0, seed=3)),
    ]
    return [list(engine.generate(p, params, mode="vanilla").token_ids) for p, params in prompts]


def test_streamed_text_equals_full_decode_on_model_outputs(weights, model_outputs):
    tok = weights.tokenizer
    for ids in model_outputs:
        pieces, text = run(TextStream(tok, ()), ids)
        assert "".join(pieces) == text == tok.decode(ids)


@pytest.mark.parametrize("text", MULTIBYTE)
def test_multibyte_characters_are_never_split(weights, text):
    tok = weights.tokenizer
    ids = tok.encode(text)
    # The byte-level vocabulary splits these characters across tokens; the test needs that case.
    assert any("\ufffd" in tok.decode(ids[:i]) for i in range(1, len(ids)))
    stream = TextStream(tok, ())
    pieces, full = run(stream, ids)
    assert "".join(pieces) == full == text
    assert all("\ufffd" not in p for p in pieces)


STOP_CASES = [
    ("Hello world, this is a test of stop strings.", "o wor"),
    ("Count: 1, 2, 3, 4, 5, 6, 7", "4, 5"),
    (MULTIBYTE[0], "首都"),
    (MULTIBYTE[1], "👍🏽"),
    ("no stop string in here at all", "zzz"),
    ("ends with a partial sto", "stop"),
]


@pytest.mark.parametrize("text, stop", STOP_CASES)
def test_stop_strings_cut_the_text_and_hold_back_partial_matches(weights, text, stop):
    tok = weights.tokenizer
    stream = TextStream(tok, (stop, "END"))
    released = ""
    for t in tok.encode(text):
        released += stream.push(t)
        # Never release a character of a stop string, nor half a character.
        assert stop not in released and "\ufffd" not in released
        if stream.stopped:
            break
    released += stream.flush()
    expected = text[: text.index(stop)] if stop in text else text
    assert stream.stopped == (stop in text)
    assert released == stream.text == expected


@pytest.mark.parametrize("text, stop", [c for c in STOP_CASES if c[0].isascii()])
def test_stop_strings_match_the_previous_implementation_chunk_for_chunk(weights, text, stop):
    """Where the old full-decode version was right (it could miss a stop string that ended in a
    character split across tokens, as the multi-byte cases above do), the chunks are identical."""
    tok = weights.tokenizer
    new, ref = TextStream(tok, (stop, "END")), ReferenceTextStream(tok, (stop, "END"))
    for t in tok.encode(text):
        assert new.push(t) == ref.push(t)
        assert new.stopped == ref.stopped
        if ref.stopped:
            break
    assert new.flush() == ref.flush()
    assert new.text == ref.text


def test_stop_strings_on_model_outputs(weights, model_outputs):
    tok = weights.tokenizer
    for ids in model_outputs:
        full = tok.decode(ids)
        stops = [full[len(full) // 2: len(full) // 2 + 4], full[-3:], "\n\n"]  # real, split across tokens
        stream = TextStream(tok, stops)
        pieces, text = run(stream, ids)
        assert stream.stopped and "".join(pieces) == text
        assert full.startswith(text) and any(full[len(text):].startswith(s) for s in stops)
        assert not any(s in text for s in stops)


def test_work_per_token_is_constant(weights, engine):
    """At 1,500 tokens the decoder sees a few ids per token, not the whole output each time."""
    tok = weights.tokenizer
    ids = tok.encode(" ".join(["The quick brown fox jumps over the lazy dog; 東京 🙂."] * 100))[:1500]
    counting = CountingTokenizer(tok)
    pieces, text = run(TextStream(counting, ("never-seen-stop",)), ids)
    assert "".join(pieces) == text == tok.decode(ids)
    assert counting.decoded_ids < 12 * len(ids)  # a full decode per token would be ~len(ids)**2 / 2
