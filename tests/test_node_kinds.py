"""The node kinds that make a small model reliable: classifier probes, span pointers, span grammars.

The maths (fitting, ensembles, the pointer's softmax over candidates) is checked on synthetic features
with a known answer; the shipped probes and pointers on the real bundled model, with tickets written
here (not from the evaluation set), where the right answer is plain.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from elesium.graphs import classifier as clf
from elesium.graphs import spans
from elesium.graphs.versioning import graph_version
from elesium.graphs.workflows import ticket_triage
from elesium.inference.constraints import Constraint
from elesium.inference.sampling import SamplingParams


class FeatureEngine:
    """Hidden states that are a fixed function of the text: 'alpha' words push one direction,
    'beta' words another, so the right probe is known."""

    def __init__(self, hidden: int = 8) -> None:
        self.hidden = hidden

    def encode_prompt(self, prompt: Any, *, raw: bool = False) -> list[int]:
        return [1 + (sum(map(ord, w)) % 97) for w in str(prompt).split()]

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        offsets = [(w.start(), w.end()) for w in spans._WORD.finditer(text)]
        return self.encode_prompt(text), offsets

    def hidden_states(self, prompt_ids: list[int], layers: list[int]) -> torch.Tensor:
        gen = torch.Generator().manual_seed(sum(prompt_ids))
        noise = torch.randn(len(layers), len(prompt_ids), self.hidden, generator=gen) * 0.1
        signal = torch.zeros(len(layers), len(prompt_ids), self.hidden)
        for t, token in enumerate(prompt_ids):
            signal[:, t, token % self.hidden] = 1.0
        return noise + signal


def test_fit_probe_separates_separable_classes_and_is_deterministic() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(30, 5, generator=gen) + 3, torch.randn(30, 5, generator=gen) - 3])
    labels = ["a"] * 30 + ["b"] * 30
    probe = clf.fit_probe(x, labels, ("a", "b"), layers=(3,), l2=1.0)
    assert (probe.logits(x).argmax(-1) == torch.tensor([0] * 30 + [1] * 30)).all()
    again = clf.fit_probe(x, labels, ("a", "b"), layers=(3,), l2=1.0)
    assert torch.equal(probe.weight, again.weight) and torch.equal(probe.bias, again.bias)
    with pytest.raises(clf.ProbeError, match="not among the classes"):
        clf.fit_probe(x, ["c"] * 60, ("a", "b"), layers=(3,))
    # A stronger penalty shrinks the weights.
    assert clf.fit_probe(x, labels, ("a", "b"), layers=(3,), l2=100.0).weight.norm() < probe.weight.norm()


def _rows(n: int) -> list[dict[str, Any]]:
    words = {"billing": "invoice charged refund", "access": "password login locked"}
    rows = []
    for i in range(n):
        label = "billing" if i % 2 else "access"
        rows.append({"input": {"subject": f"case {i}", "body": f"{words[label]} please help {i}"},
                     "expected": {"category": label}})
    return rows


def test_fitted_probe_set_round_trips_and_classifies(tmp_path: Path) -> None:
    node = clf.classifier_node("c", prompt="{subject} {body}", output_key="category",
                               labels=("billing", "access"), probe=tmp_path / "p.json",
                               lexicon={"money": r"invoice|refund", "login": r"password|login"})
    engine = FeatureEngine()
    probe = clf.fit_node_probe(engine, node, _rows(40), layers=(0, 1), l2s=(1.0, 10.0))
    assert probe.meta["examples"] == 40 and probe.meta["cv_accuracy"] >= 0.95 and probe.layers == (0, 1)
    probe.save(node.probe_path)
    loaded = clf.load_probe_set(node.probe_path)
    assert loaded.labels == probe.labels and loaded.lexicon == ("money", "login")
    for a, b in zip(loaded.members, probe.members, strict=True):
        assert torch.equal(a.weight, b.weight) and torch.equal(a.scale, b.scale)
    label, scores = node.classify(engine, {"subject": "new", "body": "my invoice was charged twice"})
    assert label == "billing" and scores["billing"] > 0.5 and abs(sum(scores.values()) - 1) < 1e-3
    # The node's fingerprint (and so the workflow version) follows the probe file's bytes.
    before = node.fingerprint()
    data = json.loads(node.probe_path.read_text())
    data["members"][0]["bias"][0] += 1.0
    node.probe_path.write_text(json.dumps(data))
    assert node.fingerprint()["probe"] != before["probe"]


def test_a_probe_for_other_labels_or_lexicon_is_refused(tmp_path: Path) -> None:
    node = clf.classifier_node("c", prompt="{subject} {body}", output_key="category",
                               labels=("billing", "access"), probe=tmp_path / "p.json")
    clf.fit_node_probe(FeatureEngine(), node, _rows(20), layers=(0,), l2s=(1.0,)).save(node.probe_path)
    other = clf.classifier_node("c", prompt="{subject} {body}", output_key="category",
                                labels=("billing", "other"), probe=tmp_path / "p.json")
    with pytest.raises(clf.ProbeError, match="refit it"):
        other.classify(FeatureEngine(), {"subject": "a", "body": "b"})
    missing = clf.classifier_node("c", prompt="x", output_key="y", labels=("a", "b"),
                                  probe=tmp_path / "no.json")
    with pytest.raises(clf.ProbeError, match="no probe at"):
        missing.classify(FeatureEngine(), {})
    with pytest.raises(ValueError, match="not a regex"):
        clf.classifier_node("c", prompt="x", output_key="y", labels=("a", "b"), probe="p", lexicon={"k": "("})


def test_candidates_stay_inside_sentences_and_strip_punctuation() -> None:
    text = 'Sync Agent 4.2 crashes. "Reports" is slow!\nNext line'
    ws = spans.words(text)
    assert [text[a:b] for a, b, _ in ws] == ["Sync", "Agent", "4.2", "crashes", "Reports", "is", "slow",
                                             "Next", "line"]
    got = {text[a:b] for a, b in spans.candidates(text, 3)}
    assert {"Sync Agent 4.2", "Reports", "is slow", "Next line", "crashes"} <= got
    assert not any("crashes" in c and "Reports" in c for c in got)  # no span crosses a sentence end
    assert not any(len(c.split()) > 3 for c in got)


def test_span_pointer_learns_to_point_and_to_say_none(tmp_path: Path) -> None:
    """Synthetic: the product is always the word after 'product', or absent."""
    rows = []
    for i in range(40):
        name = f"Widget{i}"
        has = i % 3 != 0
        body = f"hello product {name} broke today" if has else f"hello nothing {name} broke today"
        rows.append({"input": {"text": body}, "expected": {"product": name if has else None}})
    node = spans.span_node("p", source="{text}", output_key="product", pointer=tmp_path / "s.json",
                           max_words=2, layer=0)
    pointer = spans.fit_span_pointer(FeatureEngine(hidden=16), node, rows, l2=0.1)
    pointer.save(node.pointer_path)
    hits = 0
    for r in rows:
        got, prob = node.extract(FeatureEngine(hidden=16), r["input"])
        hits += got == r["expected"]["product"]
        assert got is None or got in r["input"]["text"]
        assert 0.0 < prob <= 1.0
    assert hits >= 36  # fitted on these rows: a pointer that cannot point would get ~13


def test_substring_constraint_only_copies(engine) -> None:
    text = "My Sync Agent 4.2 keeps crashing on startup since Monday"
    c = Constraint.substring(text, none="none")
    for seed in range(3):
        gen = engine.generate("Which product crashes?", SamplingParams(max_tokens=12, temperature=1.0,
                                                                       seed=seed), constraint=c)
        answer = gen.text.strip()
        assert answer == "none" or answer in text
    assert c.parse("none") is None and c.parse("Sync Agent") == "Sync Agent"


def test_hidden_states_are_the_forward_and_leave_the_cache_alone(engine) -> None:
    ids = engine.encode_prompt("Hello there")
    before = engine.cache.k.clone()
    states = engine.hidden_states(ids, [0, engine.model.config.num_layers])
    assert states.shape == (2, len(ids), engine.model.config.hidden_size)
    assert torch.equal(engine.cache.k, before)
    with torch.inference_mode():
        cache = engine.model.new_cache(len(ids))
        final = engine.model(torch.tensor([ids]), torch.arange(len(ids)), cache, 0)[0]
        embedded = engine.model.embed(torch.tensor(ids))
    torch.testing.assert_close(engine.model.norm(states[1]), final)
    assert torch.equal(states[0], embedded.float())
    assert torch.equal(engine.hidden_states(ids, [3]), engine.hidden_states(ids, [3]))
    with pytest.raises(ValueError, match="layers must be in"):
        engine.hidden_states(ids, [99])


TICKETS = [
    ("Charged twice this month", "Our card was charged twice for the November invoice. Please refund one.",
     "billing"),
    ("Password reset email never arrives", "I can't log in and the reset link never shows up in my inbox.",
     "access"),
    ("Everything is down", "Your whole site returns 502 for all of our users since 9am. Nobody can work.",
     "outage"),
]


@pytest.mark.parametrize("subject,body,category", TICKETS)
def test_shipped_probe_and_pointer_on_plain_tickets(engine, subject: str, body: str, category: str) -> None:
    values = {"subject": subject, "body": body}
    label, scores = ticket_triage.classify_category.classify(engine, values)
    assert label == category, scores
    problem, _ = ticket_triage.extract_problem.extract(engine, values)
    assert problem is not None and problem in f"{subject}\n{body}"


def test_shipped_pointer_finds_a_named_product(engine) -> None:
    values = {"subject": "Sync Agent 4.2 crashes",
              "body": "Since the update Sync Agent 4.2 closes on launch."}
    product, _ = ticket_triage.extract_product.extract(engine, values)
    assert product == "Sync Agent 4.2"


def test_workflow_version_follows_the_probe_files(tmp_path: Path, monkeypatch) -> None:
    builder = ticket_triage.build()
    version = graph_version(builder, ticket_triage.TicketInput)
    copy = tmp_path / "category.json"
    copy.write_bytes(ticket_triage.classify_category.probe_path.read_bytes()[:-2] + b" }")
    monkeypatch.setattr(ticket_triage, "classify_category",
                        clf.classifier_node("classify_category", prompt=ticket_triage.TICKET,
                                            output_key="category", labels=ticket_triage.CATEGORIES,
                                            lexicon=ticket_triage.LEXICON, scores_key="category_scores",
                                            probe=copy))
    assert graph_version(ticket_triage.build(), ticket_triage.TicketInput) != version
