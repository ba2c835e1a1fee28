"""Span features computed for all candidates at once are the per-span reference's bits."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from elesium.graphs.spans import candidates, features_of_spans, features_of_spans_reference

TICKETS = Path(__file__).resolve().parent.parent / "graphs" / "workflows" / "evals" / "ticket_triage.jsonl"
_PIECE = re.compile(r"\w{1,5}|[^\w\s]")  # sub-word pieces and punctuation, as a BPE tokenizer cuts


def _offsets(text: str, rng: torch.Generator) -> list[tuple[int, int]]:
    """Token spans of ``text``; some pieces take the space before them, as byte-level BPE does."""
    out = []
    for m in _PIECE.finditer(text):
        start = m.start()
        if start > 0 and text[start - 1] == " " and torch.rand(1, generator=rng).item() < 0.5:
            start -= 1
        out.append((start, m.end()))
    return out


def _texts() -> list[str]:
    rows = [json.loads(line) for line in TICKETS.read_text().splitlines() if line.strip()]
    texts = [f"Subject: {r['input']['subject']}\n\n{r['input']['body']}" for r in rows[:12]]
    return texts + ["Hi", "One. Two three! Four?\nFive six: seven (eight) 'nine'."]


def test_all_spans_at_once_equal_one_span_at_a_time() -> None:
    rng = torch.Generator().manual_seed(0)
    checked = 0
    for text in _texts():
        offsets = _offsets(text, rng)
        for max_words in (1, 4, 12):
            spans = candidates(text, max_words)
            states = torch.randn(len(offsets), 16, generator=rng, dtype=torch.float64) * 3
            subject_end = text.find("\n")
            fast = features_of_spans(states, offsets, text, spans, subject_end)
            ref = features_of_spans_reference(states, offsets, text, spans, subject_end)
            assert fast.shape == ref.shape == (len(spans), 4 * 16 + 8)
            assert torch.equal(fast, ref), (text[:40], max_words)
            checked += len(spans)
    assert checked > 1000


def test_a_span_at_the_start_has_no_previous_token_and_a_long_one_is_averaged() -> None:
    text = "Alpha beta gamma."
    offsets = [(0, 5), (5, 10), (10, 16), (16, 17)]
    states = torch.arange(4 * 2, dtype=torch.float64).reshape(4, 2)
    feats = features_of_spans(states, offsets, text, [(0, 5), (6, 16)])
    assert feats[0, 6:8].tolist() == [0.0, 0.0]  # previous token of the first word: none
    assert feats[1, 0:2].tolist() == [3.0, 4.0]  # mean of tokens 1 and 2
    assert feats[1, 2:4].tolist() == [2.0, 3.0] and feats[1, 4:6].tolist() == [4.0, 5.0]  # first, last
    assert feats[1, 6:8].tolist() == [0.0, 1.0]  # the token before it
