"""Structured outputs of LLM nodes: a pydantic model, a choice list, a regex, or free text.

A 135M model does not write valid JSON by luck, so structured nodes decode under a grammar
(:class:`elesium.inference.constraints.Constraint`) and the answer is parsed, not hoped for. An engine
that takes no constraints (a caller's own wrapper) gets free text: choices then fall back to matching
the text against the options (first mentioned wins, else the first option), and a pydantic output
fails loudly instead of guessing.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from elesium.inference.constraints import Constraint


class StructuredOutputError(ValueError):
    """The model's answer does not parse into the node's output type."""


@dataclass(frozen=True)
class OutputSpec:
    """What an LLM node's answer must be.

    Exactly one of ``model``, ``choices``, ``regex`` is set, or none (free text).
    """

    model: type[BaseModel] | None = None
    choices: tuple[str, ...] | None = None
    regex: str | None = None
    span: bool = False
    """A run of whole words copied from ``source`` (or ``none``): set per call by ``llm_node(span_of=)``."""
    source: str | None = None
    none: str | None = None

    @classmethod
    def of(cls, output: type[BaseModel] | Sequence[str] | None, regex: str | None = None) -> OutputSpec:
        if output is not None and regex is not None:
            raise ValueError("give output= (a pydantic model or a choice list) or regex=, not both")
        if output is None:
            return cls(regex=regex)
        if isinstance(output, type) and issubclass(output, BaseModel):
            return cls(model=output)
        if isinstance(output, str):
            raise ValueError("output= takes a list of choices, not one string")  # noqa: TRY004 - CLI shows ValueErrors
        options = tuple(output)
        if not options or not all(isinstance(o, str) and o for o in options):
            raise ValueError("output= choices must be a non-empty list of non-empty strings")
        if len(set(options)) != len(options):
            raise ValueError(f"output= choices repeat an option: {list(options)}")
        return cls(choices=options)

    @classmethod
    def span_of(cls, none: str | None) -> OutputSpec:
        return cls(span=True, none=none)

    @property
    def free_text(self) -> bool:
        return self.model is None and self.choices is None and self.regex is None and not self.span

    def describe(self) -> dict[str, Any]:
        """A stable description for the workflow version hash."""
        if self.model is not None:
            return {"json_schema": self.model.model_json_schema()}
        if self.choices is not None:
            return {"choices": list(self.choices)}
        if self.regex is not None:
            return {"regex": self.regex}
        if self.span:
            return {"span_of_input": True, "none": self.none}
        return {"free_text": True}

    def constraint(self) -> Any:
        """The Constraint for this output (None for free text)."""
        if self.free_text:
            return None
        if self.model is not None:
            return Constraint.json_schema(self.model)
        if self.choices is not None:
            return Constraint.choice(self.choices)
        if self.span:
            if not self.source or not self.source.strip():
                raise StructuredOutputError("a span output needs the text it copies from (span_of)")
            return Constraint.substring(self.source, none=self.none)
        return Constraint.regex(self.regex)  # type: ignore[arg-type]

    def grammar_fingerprint(self) -> str:
        """Identifies the grammar a call decoded under."""
        if self.free_text:
            return ""
        c = self.constraint()
        if c is not None and hasattr(c, "fingerprint"):
            return str(c.fingerprint())
        return hashlib.sha256(json.dumps(self.describe(), sort_keys=True).encode()).hexdigest()

    def parse(self, text: str, *, constrained: bool, truncated: bool = False) -> Any:
        """The state value for ``text``: a dict (model), an option (choices), or the text itself.

        ``truncated``: the call hit max_tokens, the usual reason a constrained answer is incomplete.
        """
        if self.model is not None:
            try:
                return self.model.model_validate_json(text).model_dump(mode="json")
            except ValidationError as exc:
                err = exc.errors()[0]
                why = (
                    "the token budget ran out first; raise max_tokens"
                    if truncated
                    else f"{'.'.join(str(p) for p in err['loc']) or '(root)'}: {err['msg']}"
                )
                raise StructuredOutputError(
                    f"the answer {text[:60]!r} does not parse as {self.model.__name__} ({why})"
                ) from exc
        if self.choices is not None:
            stripped = text.strip()
            if stripped in self.choices:
                return stripped
            if constrained:
                raise StructuredOutputError(f"constrained answer {text!r} is not one of {list(self.choices)}")
            return match_choice(text, self.choices)
        if self.span:
            answer = text.strip().rstrip(",;:").strip()
            if self.none is not None and answer == self.none:
                return None
            if answer and self.source is not None and answer in self.source:
                return answer
            if constrained:
                raise StructuredOutputError(f"constrained answer {text!r} is not a span of the input")
            return None
        if self.regex is not None and constrained and re.fullmatch(self.regex, text) is None:
            raise StructuredOutputError(f"constrained answer {text!r} does not match {self.regex!r}")
        return text


def match_choice(text: str, choices: Sequence[str]) -> str:
    """Unconstrained fallback: the option mentioned first in ``text`` (case-insensitive), else the first."""
    lowered = text.lower()
    best: tuple[int, str] | None = None
    for option in choices:
        m = re.search(r"(?<![a-z0-9])" + re.escape(option.lower()) + r"(?![a-z0-9])", lowered)
        if m is not None and (best is None or m.start() < best[0]):
            best = (m.start(), option)
    return best[1] if best is not None else choices[0]
