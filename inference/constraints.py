"""Grammar-constrained decoding: JSON schemas, choice lists and regexes as token masks.

A 135M-parameter model does not write valid JSON by luck, so structured calls decode under a
grammar. A ``Constraint`` is the grammar (its source text is what ``fingerprint`` hashes for run
records); ``Constraint.start`` compiles it against a tokenizer into a ``GrammarState``, the matcher
one generation advances token by token. At every position the decoders mask the logits to the tokens
the state allows *before* temperature, top-k and top-p (``sampling.target_probs``), so the target
distribution becomes the masked, renormalised one, in vanilla decoding and at every node of the
speculative tree alike (``ConstrainedDrafts`` gives each tree node the state reached along its own
path, and drops drafts the grammar forbids before the tree is chosen). When the grammar is complete
the state allows only the end-of-turn tokens, which ends the generation.

Why llguidance (PyPI ``llguidance``) and not xgrammar: both compile JSON schema / regex / CFG into
token masks with an Earley-style parser and are well kept. Measured here on the bundled SmolLM2
vocabulary (49,152 tokens, 2 CPU cores): llguidance builds its tokenizer from our own
``tokenizers.Tokenizer`` JSON in 0.37 s (no ``transformers`` needed: our tokenizer is rebuilt from
GGUF metadata), compiles a small schema in ~1 ms, computes a full mask in ~0.14 ms, deep-copies a
matcher in ~2 us and checks one token in ~1 us. Cheap copies and single-token checks are what the
tree needs: one state per tree node, and a check per drafted candidate. It is one 3 MB wheel with no
Python dependencies; xgrammar's wheel requires ``transformers``, ``triton`` and ``apache-tvm-ffi`` and
pins ``torch>=1.10`` (a risk to the pinned CPU torch), for no capability we need.

JSON output has one fixed layout (``{"a": 1, "b": 2}``, ``whitespace_flexible=False``: no free
whitespace the model could spend its token budget on), and object schemas from pydantic models get
``additionalProperties: false`` unless they say otherwise: pydantic ignores unknown keys by
default, so forbidding them changes no parse result and keeps the model from wandering into
invented keys.
"""

from __future__ import annotations

import copy
import hashlib
import json
import threading
import weakref
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import llguidance as llg
import numpy as np
import pydantic
import torch

from elesium.inference.weights.tokenizer import Tokenizer

if TYPE_CHECKING:
    from elesium.inference.decoding.drafts import DraftSet

Path = tuple[int, ...]
"""A rank path into a draft set (``drafts.py``): ``(0, 2)`` is the third draft under the best first one."""

# One fixed layout, the one small chat models write by habit (``{"a": 1, "b": 2}``): no free
# whitespace the model could spend its token budget on, and separators its drafts tend to guess.
# No ``\uXXXX`` escapes: non-ASCII is written as itself (valid JSON), and a small model that starts
# escaping control characters spends ~6 tokens per character and runs out of budget (seen on a
# Windows path full of backslashes). ``\n \t \" \\`` etc. stay available.
_JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", ",
                                 "json_allowed_escapes": "nrbtf\\\""}


class ConstraintError(ValueError):
    """The grammar does not compile (bad regex, unsupported schema): one line saying why."""


class Constraint(ABC):
    """A grammar the output must match. Build with ``json_schema``, ``choice`` or ``regex``."""

    kind: str

    @property
    @abstractmethod
    def grammar(self) -> str:
        """The llguidance grammar source (a JSON document); hashed by ``fingerprint``."""

    def fingerprint(self) -> str:
        """sha256 of the grammar source: which constraint a recorded run decoded under."""
        return hashlib.sha256(self.grammar.encode("utf-8")).hexdigest()

    def parse(self, text: str) -> Any:
        """The value the output text stands for (the text itself, unless a subclass knows better)."""
        return text

    def start(self, tokenizer: Tokenizer | llg.LLTokenizer, vocab_size: int | None = None) -> GrammarState:
        """A fresh matcher for one generation (compiled once per tokenizer and grammar, then copied)."""
        vocab = _vocabulary(tokenizer, vocab_size)
        return GrammarState(vocab.template(self.grammar).deep_copy(), vocab)

    def _validate(self) -> None:
        message = llg.LLMatcher.validate_grammar(self.grammar)
        if message and not message.startswith("WARNING"):
            raise ConstraintError(f"invalid {self.kind} constraint: {_first_line(message)}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.fingerprint()[:12]})"

    # -- constructors ---------------------------------------------------------------------------
    @staticmethod
    def json_schema(schema: dict[str, Any] | type[pydantic.BaseModel]) -> JsonSchemaConstraint:
        """Output is one JSON value valid under ``schema`` (a dict, or a pydantic model's schema)."""
        return JsonSchemaConstraint(schema)

    @staticmethod
    def choice(options: Sequence[str]) -> ChoiceConstraint:
        """Output is exactly one of ``options``."""
        return ChoiceConstraint(options)

    @staticmethod
    def regex(pattern: str) -> RegexConstraint:
        """Output matches ``pattern`` in full (Rust ``regex`` syntax, as llguidance reads it)."""
        return RegexConstraint(pattern)

    @staticmethod
    def substring(text: str, *, none: str | None = None) -> SubstringConstraint:
        """Output is a run of whole words copied from ``text`` (or exactly ``none``, when given)."""
        return SubstringConstraint(text, none)


class JsonSchemaConstraint(Constraint):
    """JSON valid under a schema; ``parse`` returns the pydantic instance when built from a model."""

    kind = "json_schema"

    def __init__(self, schema: dict[str, Any] | type[pydantic.BaseModel]) -> None:
        self.model: type[pydantic.BaseModel] | None = None
        if isinstance(schema, type) and issubclass(schema, pydantic.BaseModel):
            self.model = schema
            self.schema = closed_objects(schema.model_json_schema())
        elif isinstance(schema, dict):
            self.schema = copy.deepcopy(schema)
        else:
            raise ConstraintError("json_schema takes a dict or a pydantic model class, "
                                  f"not {type(schema).__name__}")
        try:
            self._grammar = llg.LLMatcher.grammar_from_json_schema(self.schema, overrides=_JSON_OPTIONS)
        except ValueError as e:
            raise ConstraintError(f"invalid json_schema constraint: {_first_line(str(e))}") from None
        self._validate()

    @property
    def grammar(self) -> str:
        return self._grammar

    def parse(self, text: str) -> Any:
        if self.model is not None:
            return self.model.model_validate_json(text)
        return json.loads(text)


class ChoiceConstraint(Constraint):
    """One of a fixed list of strings (a Lark alternation of string literals)."""

    kind = "choice"

    def __init__(self, options: Sequence[str]) -> None:
        if isinstance(options, str) or not options or not all(isinstance(o, str) and o for o in options):
            raise ConstraintError("choice takes a non-empty list of non-empty strings")
        self.options = tuple(options)
        # JSON string literals are Lark string literals; non-ASCII is kept as-is, not \u-escaped.
        lark = "start: " + " | ".join(json.dumps(o, ensure_ascii=False) for o in self.options)
        self._grammar = llg.LLMatcher.grammar_from_lark(lark)
        self._validate()

    @property
    def grammar(self) -> str:
        return self._grammar


class RegexConstraint(Constraint):
    """Text matching a regular expression in full."""

    kind = "regex"

    def __init__(self, pattern: str) -> None:
        if not isinstance(pattern, str) or not pattern:
            raise ConstraintError("regex takes a non-empty pattern string")
        self.pattern = pattern
        self._grammar = llg.LLMatcher.grammar_from_regex(pattern)
        self._validate()

    @property
    def grammar(self) -> str:
        return self._grammar


class SubstringConstraint(Constraint):
    """A run of whole words of a given text, or a fixed "none" answer.

    Why: extraction from a 135M model invents names ("Axelon") when it may write anything; under
    this grammar it can only copy, so every answer is verbatim from the input by construction
    (llguidance's ``substring_words`` lexeme: any contiguous sequence of the text's words).
    """

    kind = "substring"

    def __init__(self, text: str, none: str | None = None) -> None:
        if not isinstance(text, str) or not text.strip():
            raise ConstraintError("substring takes a non-empty text")
        self.text, self.none = text, none
        lexeme = "%regex " + json.dumps({"substring_words": text}, ensure_ascii=False)
        lark = f"start: {json.dumps(none, ensure_ascii=False)} | span\nspan: {lexeme}" if none else \
            f"start: {lexeme}"
        self._grammar = llg.LLMatcher.grammar_from_lark(lark)
        self._validate()

    @property
    def grammar(self) -> str:
        return self._grammar

    def parse(self, text: str) -> Any:
        return None if self.none is not None and text == self.none else text


class GrammarState:
    """One generation's position in the grammar: which tokens may come next.

    Wraps an ``llguidance.LLMatcher``. ``advanced`` returns a copy one token further (the
    speculative tree keeps one per node); ``advance`` moves this one in place (after a token is
    committed). Masks are cached per state: a state is immutable between ``advance`` calls.
    """

    __slots__ = ("_matcher", "_vocab", "_mask")

    def __init__(self, matcher: llg.LLMatcher, vocab: _Vocabulary) -> None:
        self._matcher = matcher
        self._vocab = vocab
        self._mask: np.ndarray | None = None

    @property
    def stopped(self) -> bool:
        """Complete: nothing but an end-of-turn token may follow."""
        return self._matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        """The text so far is a complete match (more may still follow)."""
        return self._matcher.is_accepting()

    def allows(self, token: int) -> bool:
        if self._matcher.is_stopped():  # llguidance validates no token here, yet consumes end tokens
            return token in self._vocab.eos_ids
        return self._matcher.validate_tokens([token]) == 1

    def allowed_ids(self) -> np.ndarray:
        """Bool ``[tokenizer vocab]``; never empty: a dead end (which a well-formed grammar never
        reaches) allows the end-of-turn tokens, so decoding stops instead of sampling from nothing."""
        if self._mask is None:
            bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
            mask = np.unpackbits(bits, bitorder="little")[: self._vocab.size].astype(bool)
            if not mask.any():
                mask[list(self._vocab.eos_ids)] = True
            self._mask = mask
        return self._mask

    def mask(self, vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Bool ``[vocab_size]`` on ``device``: True where the grammar allows the token. Rows past the
        tokenizer's vocabulary (padded embeddings) are never allowed."""
        allowed = self.allowed_ids()
        if vocab_size != allowed.shape[0]:
            padded = np.zeros(vocab_size, dtype=bool)
            n = min(vocab_size, allowed.shape[0])
            padded[:n] = allowed[:n]
            allowed = padded
        return torch.from_numpy(allowed).to(device)

    def advance(self, token: int) -> None:
        """Consume a committed token. Decoders only commit allowed tokens, so failure is a bug
        (except an end token at a dead end, which ``allowed_ids`` lets through to stop decoding)."""
        if not self._matcher.consume_token(token) and token not in self._vocab.eos_ids:
            raise RuntimeError(f"token {token} violates the grammar: {self._matcher.get_error()}")
        self._mask = None

    def advanced(self, token: int) -> GrammarState | None:
        """A copy one token further, or None if the grammar forbids ``token`` here."""
        if not self.allows(token):
            return None
        child = GrammarState(self._matcher.deep_copy(), self._vocab)
        child.advance(token)
        return child

    def copy(self) -> GrammarState:
        out = GrammarState(self._matcher.deep_copy(), self._vocab)
        out._mask = self._mask
        return out


class ConstrainedDrafts:
    """A ``DraftSet`` with the grammar's forbidden drafts removed, and a grammar state per path.

    Wraps the heads' drafts: under each path, the children are the drafted tokens the grammar allows
    after that path (ranks renumbered, order kept, so sibling scores still fall with rank). The tree
    policy then spends its budget on drafts that can be accepted. ``state(path)`` is the grammar
    state after the root token and the path's drafts, which verification masks node logits with.
    States are made lazily, only for paths the policy looks under.
    """

    def __init__(self, inner: DraftSet, root: GrammarState) -> None:
        self.inner = inner
        self._states: dict[Path, GrammarState] = {(): root}
        self._inner_path: dict[Path, Path] = {(): ()}
        self._kept: dict[Path, list[int]] = {}

    def _children(self, path: Path) -> list[int]:
        kept = self._kept.get(path)
        if kept is None:
            state, base = self.state(path), self._inner_path[path]
            kept = [r for r in range(self.inner.num_children(base))
                    if state.allows(self.inner.token(base + (r,)))]
            for rank, r in enumerate(kept):
                self._inner_path[path + (rank,)] = base + (r,)
            self._kept[path] = kept
        return kept

    def num_children(self, path: Path) -> int:
        if path not in self._inner_path:
            return 0
        return len(self._children(path))

    def token(self, path: Path) -> int:
        self._children(path[:-1])
        return self.inner.token(self._inner_path[path])

    def score(self, path: Path) -> float:
        self._children(path[:-1])
        return self.inner.score(self._inner_path[path])

    def state(self, path: Path) -> GrammarState:
        """Grammar state after ``path``'s drafts (made from its parent's on first use)."""
        found = self._states.get(path)
        if found is None:
            child = self.state(path[:-1]).advanced(self.token(path))
            if child is None:  # unreachable: only allowed children are numbered
                raise RuntimeError(f"draft path {path} is not allowed by the grammar")
            found = self._states[path] = child
        return found


# -- tokenizer vocabularies, compiled once ------------------------------------------------------
class _Vocabulary:
    """An llguidance tokenizer plus compiled-grammar templates (LRU), shared by all generations."""

    def __init__(self, tokenizer: llg.LLTokenizer) -> None:
        self.tokenizer = tokenizer
        self.size = tokenizer.vocab_size
        self.eos_ids = tuple(tokenizer.eos_tokens)
        self._templates: OrderedDict[str, llg.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def template(self, grammar: str) -> llg.LLMatcher:
        with self._lock:
            found = self._templates.get(grammar)
            if found is not None:
                self._templates.move_to_end(grammar)
                return found
        matcher = llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ConstraintError(f"constraint does not compile: {_first_line(matcher.get_error())}")
        with self._lock:
            self._templates[grammar] = matcher
            while len(self._templates) > 64:
                self._templates.popitem(last=False)
        return matcher


_VOCABS: weakref.WeakKeyDictionary[Any, dict[int | None, _Vocabulary]] = weakref.WeakKeyDictionary()
_RAW_VOCABS: dict[int, _Vocabulary] = {}
_VOCAB_LOCK = threading.Lock()


def _vocabulary(tokenizer: Tokenizer | llg.LLTokenizer, vocab_size: int | None) -> _Vocabulary:
    """The llguidance view of ``tokenizer``: built from its HF ``tokenizers`` JSON (0.4 s) once."""
    if isinstance(tokenizer, llg.LLTokenizer):
        with _VOCAB_LOCK:
            return _RAW_VOCABS.setdefault(id(tokenizer), _Vocabulary(tokenizer))
    with _VOCAB_LOCK:
        per_size = _VOCABS.setdefault(tokenizer, {})
        found = per_size.get(vocab_size)
        if found is None:
            lltok = llg.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size,
                                    eos_token=sorted(tokenizer.eos_ids) or None)
            found = per_size[vocab_size] = _Vocabulary(lltok)
        return found


def closed_objects(schema: Any) -> Any:
    """``additionalProperties: false`` on every object schema with properties that does not say: output valid
    under the closed schema is valid under the given one, and a small model invents no keys."""
    if isinstance(schema, dict):
        out = {k: closed_objects(v) for k, v in schema.items()}
        if out.get("type") == "object" and "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [closed_objects(v) for v in schema]
    return schema


def _first_line(message: str) -> str:
    return next((line.strip() for line in message.splitlines() if line.strip()), "unknown error")
