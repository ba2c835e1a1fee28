"""Span nodes: extraction that points at words of the input, scored on the engine's hidden states.

Why. Asked to write a ticket's product, the bundled 135M model invented names ("Axelon"); asked to
copy one under a grammar that only admits the ticket's own words, it copied the wrong words (0 of 40
products right on the dev split: it starts at a sentence start and runs on). What it does hold is a
representation of each token in context. A span node lists the candidate spans of the text (runs of
up to ``max_words`` words inside one sentence), describes each by the hidden states of its tokens
(mean, first, last, and the token before it) and a few shape features, and picks the best-scoring
one with a linear pointer fitted on the workflow's dev split, or "none" when the learned none-score
wins. The answer is a verbatim span by construction, and the input never leaves the text it came from.

The pointer is a listwise softmax over one example's candidates plus "none" (a conditional logit
model), fitted by L-BFGS with an L2 penalty; the file is part of the node's fingerprint.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from langchain_core.runnables import RunnableConfig

from elesium.graphs.context import get_run_context
from elesium.graphs.fitted_files import file_digest, load_cached, write_json
from elesium.graphs.prompts import PromptSource, TemplateFormat, render

_WORD = re.compile(r"\S+")
_STRIP_LEFT = "\"'“‘(«[¿¡*"
_STRIP_RIGHT = "\"'”’)»],.;:!?*"
_SENTENCE_END = re.compile(r"[.!?]['\"”’)]*$")


class SpanError(ValueError):
    """A span file that does not load, or a node that cannot be fitted."""


class TokenStates(Protocol):
    """What a span node needs of an engine."""

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]: ...

    def hidden_states(self, prompt_ids: list[int], layers: Sequence[int]) -> torch.Tensor: ...


def words(text: str) -> list[tuple[int, int, bool]]:
    """Each word's character span without surrounding quotes and punctuation, and whether a
    sentence ends after it (its own punctuation, or a line break next)."""
    out = []
    for m in _WORD.finditer(text):
        raw = m.group()
        start = m.start() + (len(raw) - len(raw.lstrip(_STRIP_LEFT)))
        end = m.end() - (len(raw) - len(raw.rstrip(_STRIP_RIGHT)))
        ends = bool(_SENTENCE_END.search(raw)) or "\n" in text[m.end():m.end() + 2] or raw.endswith(":")
        if end > start:
            out.append((start, end, ends))
        elif out:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] or ends)
    return out


def candidates(text: str, max_words: int) -> list[tuple[int, int]]:
    """Character spans of every run of 1..``max_words`` words that stays inside one sentence."""
    ws = words(text)
    spans = []
    for i in range(len(ws)):
        for j in range(i, min(len(ws), i + max_words)):
            spans.append((ws[i][0], ws[j][1]))
            if ws[j][2]:
                break
    return spans


SHAPE_FEATURES = 8


def _shape(text: str, start: int, end: int, n_words: int, subject_end: int) -> list[float]:
    span = text[start:end]
    caps = sum(w[:1].isupper() for w in span.split())
    before = text[max(0, start - 2):start]
    return [
        float(n_words), float(n_words) ** 0.5, float(any(c.isdigit() for c in span)),
        float(span[:1].isupper()), caps / max(n_words, 1), float(start < subject_end),
        float(start == 0 or before.endswith(("\n", ". ", "! ", "? "))), float(len(span) > 60),
    ]


def span_features(engine: TokenStates, text: str, layer: int, max_words: int,
                  subject_end: int = 0) -> tuple[list[tuple[int, int]], torch.Tensor]:
    """The candidates of ``text`` and their features ``[C, 4 * H + SHAPE_FEATURES]`` (float64)."""
    ids, offsets = engine.encode_with_offsets(text)
    spans = candidates(text, max_words)
    if not ids or not spans:
        return [], torch.zeros(0, 0, dtype=torch.float64)
    states = engine.hidden_states(ids, [layer])[0].to(torch.float64)  # [T, H]
    return spans, features_of_spans(states, offsets, text, spans, subject_end)


def _token_ranges(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]],
                  n_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each span's tokens ``[t0, t1)``: from the first token ending after its start to the last one
    starting before its end, at least one token, within the ``n_tokens`` tokens."""
    starts = torch.tensor([a for a, _ in offsets])
    ends = torch.tensor([b for _, b in offsets])
    t0 = torch.searchsorted(ends, torch.tensor([a for a, _ in spans]), right=True)
    t1 = torch.searchsorted(starts, torch.tensor([b for _, b in spans]), right=False)
    t1 = torch.clamp(torch.maximum(t1, t0 + 1), max=n_tokens)
    return torch.minimum(t0, t1 - 1), t1


def features_of_spans(states: torch.Tensor, offsets: Sequence[tuple[int, int]], text: str,
                      spans: Sequence[tuple[int, int]], subject_end: int = 0) -> torch.Tensor:
    """Every span's features at once: ``[mean, first, last, previous token, shape]`` of its tokens.

    Why in one pass: a ticket has hundreds of candidate spans, and one span at a time cost about a
    dozen small torch calls each, tens of milliseconds of GIL-holding Python per node that slowed the
    engine's step loop whenever 32 runs were in flight (BENCHMARKS 20). The arithmetic is the
    per-span reference's (:func:`features_of_spans_reference`), element for element, so the features
    are the same bits (``tests/test_spans.py``)."""
    t0, t1 = _token_ranges(offsets, spans, states.shape[0])
    zero = torch.zeros(1, states.shape[1], dtype=states.dtype)
    cum = torch.cat([zero, states.cumsum(0)])
    counts = (t1 - t0).to(states.dtype).unsqueeze(1)
    mean = (cum[t1] - cum[t0]) / counts
    previous = torch.cat([zero, states])[t0]  # the token before the span; zeros at the text's start
    shape = torch.tensor([_shape(text, a, b, len(text[a:b].split()), subject_end) for a, b in spans],
                         dtype=states.dtype)
    return torch.cat([mean, states[t0], states[t1 - 1], previous, shape], dim=1)


def features_of_spans_reference(states: torch.Tensor, offsets: Sequence[tuple[int, int]], text: str,
                                spans: Sequence[tuple[int, int]], subject_end: int = 0) -> torch.Tensor:
    """One span at a time: the definition :func:`features_of_spans` is tested against."""
    cum = torch.cat([torch.zeros(1, states.shape[1], dtype=states.dtype), states.cumsum(0)])
    starts = torch.tensor([a for a, _ in offsets])
    ends = torch.tensor([b for _, b in offsets])
    rows = []
    for start, end in spans:
        t0 = int(torch.searchsorted(ends, start, right=True))  # first token ending after the start
        t1 = max(int(torch.searchsorted(starts, end, right=False)), t0 + 1)  # tokens starting before the end
        t1 = min(t1, states.shape[0])
        t0 = min(t0, t1 - 1)
        mean = (cum[t1] - cum[t0]) / (t1 - t0)
        prev = states[t0 - 1] if t0 > 0 else torch.zeros_like(states[0])
        n_words = len(text[start:end].split())
        rows.append(torch.cat([mean, states[t0], states[t1 - 1], prev,
                               torch.tensor(_shape(text, start, end, n_words, subject_end),
                                            dtype=states.dtype)]))
    return torch.stack(rows)


@dataclasses.dataclass(frozen=True)
class SpanPointer:
    """``score(span) = w . ((phi(span) - mean) / scale)``; "none" scores ``none_bias``."""

    layer: int
    max_words: int
    mean: torch.Tensor
    scale: torch.Tensor
    weight: torch.Tensor
    none_bias: float
    meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def scores(self, features: torch.Tensor) -> torch.Tensor:
        return ((features - self.mean) / self.scale) @ self.weight

    def to_json(self) -> dict[str, Any]:
        return {"layer": self.layer, "max_words": self.max_words, "mean": self.mean.tolist(),
                "scale": self.scale.tolist(), "weight": self.weight.tolist(), "none_bias": self.none_bias,
                "meta": dict(self.meta)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SpanPointer:
        try:
            return cls(int(data["layer"]), int(data["max_words"]),
                       torch.tensor(data["mean"], dtype=torch.float64),
                       torch.tensor(data["scale"], dtype=torch.float64),
                       torch.tensor(data["weight"], dtype=torch.float64), float(data["none_bias"]),
                       dict(data.get("meta") or {}))
        except (KeyError, TypeError, ValueError) as exc:
            raise SpanError(f"not a span pointer: {exc}") from None

    def save(self, path: Path) -> None:
        write_json(path, self.to_json())


def load_pointer(path: Path) -> SpanPointer:
    return load_cached(path, SpanPointer.from_json, SpanError, "span pointer")


@dataclasses.dataclass(frozen=True)
class SpanNode:
    """A graph node that writes a verbatim span of ``source`` (or None) to ``output_key``."""

    name: str
    source: PromptSource
    output_key: str
    pointer_path: Path
    label_key: str
    subject_key: str | None = None
    max_words: int = 4
    layer: int = 12
    template_format: TemplateFormat = "f-string"

    @property
    def __name__(self) -> str:  # LangGraph names a node added without a name by it
        return self.name

    def features(self, engine: TokenStates, values: Mapping[str, Any], layer: int,
                 max_words: int) -> tuple[str, list[tuple[int, int]], torch.Tensor]:
        text = render(self.source, values, self.template_format, node=self.name)
        subject_end = len(str(values.get(self.subject_key, ""))) if self.subject_key else 0
        spans, feats = span_features(engine, text, layer, max_words, subject_end)
        return text, spans, feats

    def extract(self, engine: TokenStates, values: Mapping[str, Any]) -> tuple[str | None, float]:
        """The span (None for "none") and the probability the pointer gives it."""
        pointer = load_pointer(self.pointer_path)
        text, spans, feats = self.features(engine, values, pointer.layer, pointer.max_words)
        if not spans:
            return None, 1.0
        scores = torch.cat([pointer.scores(feats), torch.tensor([pointer.none_bias], dtype=torch.float64)])
        probs = torch.softmax(scores, 0)
        best = int(probs.argmax())
        if best == len(spans):
            return None, round(float(probs[best]), 4)
        start, end = spans[best]
        return text[start:end], round(float(probs[best]), 4)

    def __call__(self, state: Any, config: RunnableConfig) -> dict[str, Any]:
        values = state if isinstance(state, Mapping) else dict(state)
        span, _ = self.extract(get_run_context(config).engine, values)
        return {self.output_key: span}

    def fingerprint(self) -> dict[str, Any]:
        """What decides this node's output, for the workflow version hash: the pointer file's bytes."""
        source = self.source if isinstance(self.source, str) else repr(self.source)
        digest = file_digest(self.pointer_path)
        return {"kind": "span", "name": self.name, "source": source, "output_key": self.output_key,
                "subject_key": self.subject_key, "max_words": self.max_words, "layer": self.layer,
                "template_format": self.template_format, "pointer": digest}


def span_node(name: str, *, source: PromptSource, output_key: str, pointer: str | Path,
              label_key: str | None = None, subject_key: str | None = None, max_words: int = 4,
              layer: int = 12, template_format: TemplateFormat = "f-string") -> SpanNode:
    """A node that copies one span of the rendered ``source`` (or None) with the pointer at ``pointer``
    (fitted by ``elesium fit-classifier`` on the evaluation set's ``expected[label_key]``).

    ``subject_key``: a state key whose text opens ``source`` (a ticket's subject): whether a span
    lies in it is a feature. ``max_words``: the longest span; ``layer``: whose hidden states
    describe the tokens (both used when fitting; the fitted file records them).
    """
    if not name or not output_key:
        raise ValueError("span_node needs a name and an output_key")
    if max_words < 1:
        raise ValueError("span_node needs max_words >= 1")
    return SpanNode(name, source, output_key, Path(pointer), label_key or output_key, subject_key,
                    max_words, layer, template_format)


def _target(text: str, spans: Sequence[tuple[int, int]], expected: str | None) -> int:
    """The candidate that is the expected span (or overlaps it most); len(spans) for "none"."""
    if expected is None:
        return len(spans)
    want = expected.strip().strip(_STRIP_RIGHT).strip(_STRIP_LEFT)
    at = text.find(want)
    if at < 0:
        return -1
    lo, hi = at, at + len(want)
    best, best_overlap = -1, 0.0
    for k, (a, b) in enumerate(spans):
        inter = max(0, min(b, hi) - max(a, lo))
        overlap = inter / (max(b, hi) - min(a, lo))
        if overlap > best_overlap:
            best, best_overlap = k, overlap
    return best


def fit_span_pointer(engine: TokenStates, node: SpanNode, rows: Sequence[Mapping[str, Any]], *,
                     l2: float = 10.0, negatives: int = 150,
                     meta: Mapping[str, Any] | None = None) -> SpanPointer:
    """Fit ``node``'s pointer on evaluation rows (``expected[label_key]``: a span of the text or None).

    Each example keeps its target and up to ``negatives`` other candidates (every candidate when
    there are fewer; a deterministic spread otherwise), so memory stays bounded on long texts."""
    layer, max_words = node.layer, node.max_words
    groups: list[tuple[torch.Tensor, int]] = []
    for r in rows:
        expected = r.get("expected", {})
        if node.label_key not in expected:
            continue
        text, spans, feats = node.features(engine, r["input"], layer, max_words)
        if not spans:
            continue
        target = _target(text, spans, expected[node.label_key])
        if target < 0:
            continue
        keep = list(range(len(spans)))
        if len(keep) > negatives:
            step = len(keep) / negatives
            keep = sorted({int(i * step) for i in range(negatives)}
                          | ({target} if target < len(spans) else set()))
        new_target = keep.index(target) if target < len(spans) else len(keep)
        groups.append((feats[keep], new_target))
    if len(groups) < 10:
        raise SpanError(f"node {node.name!r}: {len(groups)} usable rows; fitting needs at least 10")
    every = torch.cat([g for g, _ in groups])
    mean, scale = every.mean(0), every.std(0, unbiased=False).clamp_min(1e-6)
    normed = [((g - mean) / scale, t) for g, t in groups]
    weight = torch.zeros(every.shape[1], dtype=torch.float64, requires_grad=True)
    none_bias = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([weight, none_bias], lr=1.0, max_iter=300, tolerance_grad=1e-8,
                            tolerance_change=1e-11, history_size=20, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = l2 * weight.pow(2).sum()
        for g, t in normed:
            scores = torch.cat([g @ weight, none_bias])
            loss = loss - torch.log_softmax(scores, 0)[t]
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(closure)
    info = {**dict(meta or {}), "examples": len(groups), "l2": l2, "label_key": node.label_key}
    return SpanPointer(layer, max_words, mean, scale, weight.detach(), float(none_bias.detach()), info)
