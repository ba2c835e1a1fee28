"""The engine as everything above ``inference/`` sees it: one request type, one handle per generation in
flight, and the :class:`TextEngine` protocol that the engine, the run's recording wrapper
(``graphs/execution.py``) and a batched scheduler all implement.

Why a protocol and not the ``Engine`` class: graphs and the API must not care whether a generation
runs alone on a FIFO-gated engine (today), inside a batch of many sequences (batched serving), or is
served from a run's record (audit replay). A request is a value that says everything the tokens depend
on (prompt, sampling with its seed, grammar, decode mode, tree policy), so starting two requests at
once is just calling :meth:`TextEngine.start` twice; each handle is iterated, closed and read on its
own. Importing this module loads no model and no torch kernels.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from elesium.inference.records import Chunk, Generation, StepRecord
from elesium.inference.sampling import SamplingParams

if TYPE_CHECKING:
    import torch

    from elesium.inference.constraints import Constraint
    from elesium.inference.decoding.tree_policy import TreePolicy

Message = Mapping[str, str]
"""One chat message: ``{"role": ..., "content": ...}``."""

Prompt = str | Sequence[Message] | Sequence[int]
"""A user message (through the chat template), a chat, or token ids as they are."""

StepHook = Callable[[StepRecord], None]
"""Called after each decode step with what the step drafted and accepted (the acceptance log's entry)."""

__all__ = ["CallTag", "Chunk", "Generation", "GenerationHandle", "GenerationRequest", "Message", "Prompt",
           "SamplingParams", "StepHook", "StepRecord", "TextEngine"]


@dataclass(frozen=True)
class CallTag:
    """Which LLM call of a run a request is: its graph node and that node's call index.

    The index comes from the run's checkpointed state (``llm_calls``), never from a counter in process
    memory, so a run resumed after its worker died numbers its calls as the dead attempt did: the same
    seeds, and records that line up with the ones already written.
    """

    node: str
    index: int


@dataclass(frozen=True)
class GenerationRequest:
    """Everything one generation's tokens depend on, besides the engine's own fingerprint.

    ``sampling.seed`` fixes the draws (None: a fresh random seed, reported on the result); ``sampling``
    also holds ``max_tokens`` and the stop strings. ``mode`` None means the engine's default mode;
    ``policy`` replaces the engine's tree policy for this generation only (a node's calibration);
    ``raw`` skips the chat template for a string prompt; ``tag`` names the run's call it serves.
    ``arrived_at`` (``time.perf_counter()``) is when the request reached the server, for a caller that
    queues it before the engine sees it (the API's engine thread): the generation's serving latencies
    (queue time, time to first token) count from there; None counts from when the engine got it. It
    changes no token, so requests that differ only in it are equal. ``tenant`` is who asked: while
    generations wait for a slot, the engine admits the one whose tenant holds the fewest slots, so
    one tenant's burst cannot hold every slot while another waits (it changes no token either).
    """

    prompt: Prompt
    sampling: SamplingParams = field(default_factory=SamplingParams)
    mode: str | None = None
    constraint: Constraint | None = None
    policy: TreePolicy | None = None
    raw: bool = False
    tag: CallTag | None = None
    arrived_at: float | None = field(default=None, compare=False)
    tenant: str | None = field(default=None, compare=False)


@runtime_checkable
class GenerationHandle(Protocol):
    """One generation in flight: iterate it for chunks, then read ``result``; ``close`` abandons it and
    releases what it holds (its place in the engine, its cache) at the next step boundary."""

    def __iter__(self) -> Iterator[Chunk]: ...

    def close(self) -> None: ...

    @property
    def result(self) -> Generation: ...


@runtime_checkable
class TextEngine(Protocol):
    """What graphs, the API and replay need from an engine.

    ``start`` validates the request at once (an empty or too long prompt, a mode without draft heads
    raise here, before anything runs) and returns a handle; decoding happens as the handle is iterated.
    ``fingerprint(mode)`` is what a run's tokens depend on besides input and seed: a run recorded on
    one fingerprint is only resumed or re-executed on an equal one.
    """

    def start(self, request: GenerationRequest, *, on_step: StepHook | None = None) -> GenerationHandle: ...

    def encode_prompt(self, prompt: Prompt, *, raw: bool = False) -> list[int]: ...

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]: ...

    def hidden_states(self, prompt_ids: list[int], layers: Sequence[int]) -> torch.Tensor: ...

    def describe(self) -> dict[str, str]: ...

    def fingerprint(self, mode: str | None = None) -> dict[str, str]: ...

    def resolve_mode(self, mode: str | None) -> str: ...

    def step_cost(self, nodes: int) -> float: ...

    @property
    def policy(self) -> TreePolicy:
        """The engine's own tree policy: what a request without ``policy`` drafts with, and what a
        node's calibration adjusts."""
        ...

    @property
    def modes(self) -> tuple[str, ...]: ...

    @property
    def default_mode(self) -> str: ...

    @property
    def context_length(self) -> int: ...


def generate(engine: TextEngine, request: GenerationRequest, *,
             on_step: StepHook | None = None) -> Generation:
    """Run ``request`` on ``engine`` to the end and return the result (the handle closed either way)."""
    handle = engine.start(request, on_step=on_step)
    try:
        for _ in handle:
            pass
        return handle.result
    finally:
        handle.close()
