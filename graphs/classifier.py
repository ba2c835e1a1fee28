"""Classifier nodes: closed-set questions answered by a linear probe on the engine's hidden states.

Why. Asked to *write* a ticket's category, the bundled 135M model was right on 0.28 of hand-written
tickets (chance 0.20): it writes what is likely as text, not what is right. Its hidden states still
hold what the ticket is about; a multinomial logistic regression on them, fitted on a few dozen
labelled examples of the workflow's own dev set, separates the classes far better (the shipped
probes' accuracies are in ``graphs/workflows/evals/README.md``). It is SetFit's idea without
fine-tuning: the encoder is the engine already loaded, the head is a few kilobytes of JSON.

What a node does: render its prompt from the state, read the residual stream after a few layers
(``Engine.hidden_states``) and mean-pool it over the tokens; optionally count a lexicon's patterns
in the text (a few regexes per label, written by the author: cheap domain knowledge the small model's
representation lacks); then average the class probabilities of one linear probe per layer (an
ensemble over depths, steadier than any one layer) and take the arg-max. Deterministic for a given
engine configuration, so runs replay. The probe file and the lexicon are part of the node's
fingerprint, so a refitted probe is a new workflow version.

Fitting (``fit_probe``, ``elesium fit-classifier``) is exact arithmetic in float64 with L-BFGS
from zeros: the same examples give the same probe, bit for bit, on any machine.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from langchain_core.runnables import RunnableConfig

from elesium.graphs.context import get_run_context
from elesium.graphs.fitted_files import file_digest, load_cached, write_json
from elesium.graphs.prompts import PromptSource, TemplateFormat, render


class ProbeError(ValueError):
    """A probe file that does not load, or labels the node does not allow."""


class HiddenStates(Protocol):
    """What a classifier needs of an engine."""

    def encode_prompt(self, prompt: Any, *, raw: bool = False) -> list[int]: ...

    def hidden_states(self, prompt_ids: list[int], layers: Sequence[int]) -> torch.Tensor: ...


@dataclasses.dataclass(frozen=True)
class Probe:
    """A fitted linear probe: ``argmax(W @ ((pool(h) - mean) / scale) + b)`` over ``labels``."""

    labels: tuple[str, ...]
    layers: tuple[int, ...]
    mean: torch.Tensor  # [D] float64
    scale: torch.Tensor  # [D] float64
    weight: torch.Tensor  # [C, D] float64
    bias: torch.Tensor  # [C] float64
    meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        x = (features.to(torch.float64) - self.mean) / self.scale
        return x @ self.weight.T + self.bias

    def to_json(self) -> dict[str, Any]:
        return {
            "labels": list(self.labels),
            "layers": list(self.layers),
            "mean": self.mean.tolist(),
            "scale": self.scale.tolist(),
            "weight": self.weight.tolist(),
            "bias": self.bias.tolist(),
            "meta": dict(self.meta),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Probe:
        try:
            probe = cls(
                labels=tuple(str(x) for x in data["labels"]),
                layers=tuple(int(x) for x in data["layers"]),
                mean=torch.tensor(data["mean"], dtype=torch.float64),
                scale=torch.tensor(data["scale"], dtype=torch.float64),
                weight=torch.tensor(data["weight"], dtype=torch.float64),
                bias=torch.tensor(data["bias"], dtype=torch.float64),
                meta=dict(data.get("meta") or {}),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ProbeError(f"not a probe: {exc}") from None
        c, d = len(probe.labels), probe.mean.shape[0]
        if probe.weight.shape != (c, d) or probe.bias.shape != (c,) or probe.scale.shape != (d,):
            raise ProbeError(f"probe shapes disagree: {c} labels, {d} features, weight "
                             f"{tuple(probe.weight.shape)}")
        return probe


LEXICON_WEIGHT = 4.5
"""How much a lexicon count weighs against one hidden dimension after standardisation (as if each
count were repeated ~20 times): with 576 hidden dimensions per layer the few lexicon features would
otherwise be drowned by the L2 penalty. Chosen by cross-validation on the ticket dev split."""


def lexicon_counts(lexicon: Mapping[str, str], text: str) -> torch.Tensor:
    """``log1p`` of each pattern's match count in ``text`` (case-insensitive), in the lexicon's order."""
    return torch.tensor([math.log1p(len(_pattern(p).findall(text))) for p in lexicon.values()],
                        dtype=torch.float64)


@functools.lru_cache(maxsize=256)
def _pattern(source: str) -> re.Pattern[str]:
    return re.compile(source, re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class ProbeSet:
    """One probe per layer over ``[mean-pooled hidden state at that layer, lexicon counts]``; the
    answer is the arg-max of their averaged class probabilities."""

    labels: tuple[str, ...]
    members: tuple[Probe, ...]  # each with exactly one layer
    lexicon: tuple[str, ...]  # the lexicon's names, in feature order
    meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(m.layers[0] for m in self.members)

    def probabilities(self, pooled: Mapping[int, torch.Tensor], lex: torch.Tensor) -> torch.Tensor:
        """``pooled``: layer -> ``[..., H]`` mean-pooled states; ``lex``: ``[..., len(lexicon)]``."""
        total = torch.zeros(len(self.labels), dtype=torch.float64)
        for member in self.members:
            x = torch.cat([pooled[member.layers[0]].to(torch.float64), lex.to(torch.float64)], -1)
            total = total + torch.softmax(member.logits(x), -1)
        return total / len(self.members)

    def to_json(self) -> dict[str, Any]:
        return {"labels": list(self.labels), "lexicon": list(self.lexicon),
                "members": [m.to_json() for m in self.members], "meta": dict(self.meta)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ProbeSet:
        try:
            members = tuple(Probe.from_json(m) for m in data["members"])
            probe_set = cls(tuple(str(x) for x in data["labels"]), members,
                            tuple(str(x) for x in data.get("lexicon", [])), dict(data.get("meta") or {}))
        except (KeyError, TypeError) as exc:
            raise ProbeError(f"not a probe set: {exc}") from None
        if not members or any(m.labels != probe_set.labels or len(m.layers) != 1 for m in members):
            raise ProbeError("a probe set needs one-layer members with the set's labels")
        return probe_set

    def save(self, path: Path) -> None:
        write_json(path, self.to_json())


def load_probe_set(path: Path) -> ProbeSet:
    return load_cached(path, ProbeSet.from_json, ProbeError, "probe")


def pooled_features(engine: HiddenStates, prompt: str, layers: Sequence[int]) -> dict[int, torch.Tensor]:
    """Mean over the prompt's tokens of the residual stream after each layer: layer -> ``[H]``."""
    ids = engine.encode_prompt(prompt)
    states = engine.hidden_states(ids, sorted(set(layers)))  # [L, T, H]
    return {layer: row.to(torch.float64) for layer, row in zip(sorted(set(layers)), states.mean(dim=1),
                                                                strict=True)}


def fit_probe(features: torch.Tensor, labels: Sequence[str], classes: Sequence[str], *,
              layers: Sequence[int], l2: float = 1.0, meta: Mapping[str, Any] | None = None,
              standardise: bool = True) -> Probe:
    """Multinomial logistic regression with an L2 penalty, fitted to convergence by L-BFGS.

    ``features`` ``[N, D]``; every label must be one of ``classes``. Features are standardised by
    their mean and standard deviation over the examples (kept in the probe); ``l2`` multiplies the
    squared weights, summed, against the mean cross-entropy times N.
    """
    if features.dim() != 2 or features.shape[0] != len(labels) or not labels:
        raise ProbeError(f"{features.shape[0]} feature rows for {len(labels)} labels")
    unknown = sorted(set(labels) - set(classes))
    if unknown:
        raise ProbeError(f"labels {unknown} are not among the classes {list(classes)}")
    x = features.to(torch.float64)
    if standardise:
        mean, scale = x.mean(0), x.std(0, unbiased=False).clamp_min(1e-6)
    else:
        mean = torch.zeros(x.shape[1], dtype=torch.float64)
        scale = torch.ones(x.shape[1], dtype=torch.float64)
    x = (x - mean) / scale
    y = torch.tensor([list(classes).index(label) for label in labels])
    weight = torch.zeros(len(classes), x.shape[1], dtype=torch.float64, requires_grad=True)
    bias = torch.zeros(len(classes), dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([weight, bias], lr=1.0, max_iter=500, tolerance_grad=1e-9,
                            tolerance_change=1e-12, history_size=20, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(x @ weight.T + bias, y, reduction="sum")
        loss = loss + l2 * weight.pow(2).sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(closure)
    return Probe(tuple(classes), tuple(layers), mean, scale, weight.detach(), bias.detach(), dict(meta or {}))


@dataclasses.dataclass(frozen=True)
class ClassifierNode:
    """A graph node that writes one of ``labels`` to ``output_key`` (and the class probabilities to
    ``scores_key``, when set). Build it with :func:`classifier_node`."""

    name: str
    prompt: PromptSource
    output_key: str
    probe_path: Path
    labels: tuple[str, ...]
    label_key: str
    lexicon: Mapping[str, str] = dataclasses.field(default_factory=dict)
    scores_key: str | None = None
    template_format: TemplateFormat = "f-string"

    @property
    def __name__(self) -> str:  # LangGraph names a node added without a name by it
        return self.name

    @property
    def probe(self) -> ProbeSet:
        probe = load_probe_set(self.probe_path)
        if probe.labels != self.labels or probe.lexicon != tuple(self.lexicon):
            raise ProbeError(f"node {self.name!r}: probe {self.probe_path} was fitted for labels "
                             f"{list(probe.labels)} and lexicon {list(probe.lexicon)}; the node has "
                             f"{list(self.labels)} and {list(self.lexicon)} "
                             "(refit it: elesium fit-classifier)")
        return probe

    def features(self, engine: HiddenStates, values: Mapping[str, Any],
                 layers: Sequence[int]) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
        """The rendered prompt's pooled states at ``layers`` and its lexicon counts."""
        prompt = render(self.prompt, values, self.template_format, node=self.name)
        return pooled_features(engine, prompt, layers), lexicon_counts(self.lexicon, prompt)

    def classify(self, engine: HiddenStates, values: Mapping[str, Any]) -> tuple[str, dict[str, float]]:
        probe = self.probe
        probs = probe.probabilities(*self.features(engine, values, probe.layers))
        scores = {label: round(float(p), 4) for label, p in zip(probe.labels, probs, strict=True)}
        return probe.labels[int(probs.argmax())], scores

    def __call__(self, state: Any, config: RunnableConfig) -> dict[str, Any]:
        values = state if isinstance(state, Mapping) else dict(state)
        label, scores = self.classify(get_run_context(config).engine, values)
        out: dict[str, Any] = {self.output_key: label}
        if self.scores_key:
            out[self.scores_key] = scores
        return out

    def fingerprint(self) -> dict[str, Any]:
        """What decides this node's output, for the workflow version hash: the probe file's bytes."""
        prompt = self.prompt if isinstance(self.prompt, str) else repr(self.prompt)
        digest = file_digest(self.probe_path)
        return {"kind": "classifier", "name": self.name, "prompt": prompt, "output_key": self.output_key,
                "labels": list(self.labels), "lexicon": dict(self.lexicon), "scores_key": self.scores_key,
                "template_format": self.template_format, "probe": digest}


def classifier_node(name: str, *, prompt: PromptSource, output_key: str, labels: Sequence[str],
                    probe: str | Path, label_key: str | None = None,
                    lexicon: Mapping[str, str] | None = None,
                    scores_key: str | None = None, template_format: TemplateFormat = "f-string",
                    ) -> ClassifierNode:
    """A node that classifies its rendered prompt into one of ``labels`` with the probe set at
    ``probe`` (a JSON file made by ``elesium fit-classifier`` or :func:`fit_node_probe`).

    ``label_key``: the field of an evaluation set's ``expected`` the probe is fitted to (default:
    ``output_key``; differs where rules post-process the answer, e.g. a priority floor).
    ``lexicon``: named regular expressions (case-insensitive) whose match counts join the hidden
    states as features.
    """
    if not name or not output_key:
        raise ValueError("classifier_node needs a name and an output_key")
    options = tuple(labels)
    if len(options) < 2 or len(set(options)) != len(options):
        raise ValueError("classifier_node needs at least two distinct labels")
    for key, pattern in (lexicon or {}).items():
        try:
            _pattern(pattern)
        except re.error as exc:
            raise ValueError(f"classifier_node {name!r}: lexicon pattern {key!r} is not a regex: "
                             f"{exc}") from None
    return ClassifierNode(name, prompt, output_key, Path(probe), options, label_key or output_key,
                          dict(lexicon or {}), scores_key, template_format)


LAYERS: tuple[int, ...] = (6, 10, 14, 18, 22, 26)
L2S: tuple[float, ...] = (1.0, 10.0, 100.0)
"""What ``fit_node_probe`` uses: one member per layer (of a 30-block model; deeper or shallower
models are clipped to their depth) and the penalties cross-validation chooses among on the dev split."""


def _standardised_member(x: torch.Tensor, labels: Sequence[str], classes: Sequence[str], layer: int,
                         n_lex: int, l2: float) -> Probe:
    """A probe on standardised columns, the lexicon's (the last ``n_lex``) weighted by
    ``LEXICON_WEIGHT``: the weight is folded into the stored scale, so ``logits`` stays one formula."""
    mean, scale = x.mean(0), x.std(0, unbiased=False).clamp_min(1e-6)
    if n_lex:
        scale[-n_lex:] = scale[-n_lex:] / LEXICON_WEIGHT
    fitted = fit_probe((x - mean) / scale, labels, classes, layers=(layer,), l2=l2, standardise=False)
    return Probe(tuple(classes), (layer,), mean, scale, fitted.weight, fitted.bias)


def _ensemble_cv(views: Sequence[torch.Tensor], labels: Sequence[str], classes: Sequence[str],
                 n_lex: int, l2: float, folds: int = 5) -> float:
    """Accuracy of the averaged members over ``folds`` interleaved folds."""
    hits = 0
    for k in range(folds):
        test = [i for i in range(len(labels)) if i % folds == k]
        train = [i for i in range(len(labels)) if i % folds != k]
        total = torch.zeros(len(test), len(classes), dtype=torch.float64)
        for view in views:
            member = _standardised_member(view[train], [labels[i] for i in train], classes, 0, n_lex, l2)
            total += torch.softmax(member.logits(view[test]), -1)
        hits += sum(classes[int(p)] == labels[i] for p, i in zip(total.argmax(-1), test, strict=True))
    return hits / len(labels)


def fit_node_probe(engine: HiddenStates, node: ClassifierNode, rows: Sequence[Mapping[str, Any]], *,
                   layers: Sequence[int] = LAYERS, l2s: Sequence[float] = L2S,
                   meta: Mapping[str, Any] | None = None) -> ProbeSet:
    """Fit ``node``'s probe set on evaluation rows (``{"input": state, "expected": {label_key: label}}``):
    the penalty chosen by 5-fold cross-validation of the whole ensemble, then every member fitted on
    every row. Each row's states are computed once."""
    rows = [r for r in rows if r.get("expected", {}).get(node.label_key) is not None]
    if len(rows) < 10:
        raise ProbeError(f"node {node.name!r}: {len(rows)} labelled rows; fitting needs at least 10")
    labels = [str(r["expected"][node.label_key]) for r in rows]
    pooled, lex = [], []
    for r in rows:
        states, counts = node.features(engine, r["input"], layers)
        pooled.append(states)
        lex.append(counts)
    lex_rows = torch.stack(lex) if lex and lex[0].numel() else torch.zeros(len(rows), 0, dtype=torch.float64)
    views = [torch.cat([torch.stack([p[layer] for p in pooled]), lex_rows], 1) for layer in layers]
    n_lex = lex_rows.shape[1]
    scores = {l2: _ensemble_cv(views, labels, node.labels, n_lex, l2) for l2 in l2s}
    l2 = max(l2s, key=lambda value: (scores[value], -l2s.index(value)))
    members = tuple(_standardised_member(view, labels, node.labels, layer, n_lex, l2)
                    for view, layer in zip(views, layers, strict=True))
    info = {**dict(meta or {}), "examples": len(rows), "label_key": node.label_key, "l2": l2,
            "cv_accuracy": round(scores[l2], 4), "cv_by_l2": {str(k): round(v, 4) for k, v in scores.items()}}
    return ProbeSet(node.labels, members, tuple(node.lexicon), info)
