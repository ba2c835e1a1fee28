"""Prompt templates rendered from a node's state.

Two syntaxes, chosen explicitly (LangChain's convention), because ``{`` means different things in
each: ``"f-string"`` is ``str.format`` (``{subject}``, ``{triage[category]}``) and ``"jinja2"``
is a sandboxed Jinja template (loops, filters, conditionals). A missing key fails with the key's
name instead of rendering an empty prompt.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import lru_cache
from typing import Any, Literal

from jinja2 import StrictUndefined
from jinja2.exceptions import UndefinedError
from jinja2.sandbox import SandboxedEnvironment

TemplateFormat = Literal["f-string", "jinja2"]
PromptSource = str | Callable[[Mapping[str, Any]], str]


class PromptRenderError(KeyError):
    """A template names a state key the state does not have."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


@lru_cache(maxsize=256)
def _jinja(template: str) -> Any:
    env = SandboxedEnvironment(undefined=StrictUndefined, keep_trailing_newline=True, autoescape=False)
    return env.from_string(template)


def render(
    template: PromptSource, state: Mapping[str, Any], fmt: TemplateFormat = "f-string", *, node: str = "?"
) -> str:
    """The prompt text for ``state``. A callable template is called with the state."""
    if callable(template):
        return str(template(state))
    values = dict(state)
    try:
        if fmt == "jinja2":
            return _jinja(template).render(**values)
        return template.format(**values)
    except (KeyError, UndefinedError) as exc:
        raise PromptRenderError(
            f"node {node!r}: the prompt template needs {exc} which the state does not "
            f"have (state keys: {sorted(values)})"
        ) from exc
