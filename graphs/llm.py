"""LLM nodes: render a prompt from the state, decode on the engine, write the answer back.

Authors write plain LangGraph ``StateGraph`` code; :func:`llm_node` returns a node callable to
``add_node``. What it adds over calling a model by hand is what a deterministic, audited run
needs:

- the call's seed derives from (run seed, node name, call index), the index counted in the graph
  state (``llm_calls``, a summing reducer), so it is checkpointed and survives resumes, unlike a
  counter in process memory;
- tokens stream through LangGraph's own stream modes: LangChain chat-model callbacks feed
  ``stream_mode="messages"`` (AIMessageChunks as tokens decode), and ``get_stream_writer`` feeds
  ``stream_mode="custom"`` (dicts with the token ids);
- structured outputs decode under a grammar (:mod:`elesium.graphs.structured`);
- every call's steps go to the run's acceptance stream (:mod:`elesium.graphs.audit`).
"""

from __future__ import annotations

import dataclasses
import inspect
import tokenize
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any, TypedDict

from langchain_core.callbacks import CallbackManager
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, HumanMessage, SystemMessage
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, LLMResult
from langchain_core.runnables import RunnableConfig
from langgraph.config import get_stream_writer
from pydantic import BaseModel

from elesium.graphs.audit import record_call
from elesium.graphs.calibration import node_policy
from elesium.graphs.context import RunContext, get_run_context
from elesium.graphs.prompts import PromptSource, TemplateFormat, render
from elesium.graphs.seeds import derive_seed
from elesium.graphs.structured import OutputSpec
from elesium.inference.records import Generation
from elesium.inference.sampling import SamplingParams
from elesium.inference.types import CallTag, GenerationRequest

CALLS_KEY = "llm_calls"


def count_calls(left: Mapping[str, int] | None, right: Mapping[str, int] | None) -> dict[str, int]:
    """Reducer of ``llm_calls``: adds per-node call counts (each LLM node returns ``{name: 1}``)."""
    merged = dict(left or {})
    for node, n in (right or {}).items():
        merged[node] = merged.get(node, 0) + int(n)
    return merged


class WorkflowState(TypedDict, total=False):
    """Base of a workflow's state: subclass it and add your fields.

    ``llm_calls`` counts each LLM node's calls so far in the run; the next call's index (and so its
    seed) is read from it.
    """

    llm_calls: Annotated[dict[str, int], count_calls]


def _state_mapping(state: Any) -> Mapping[str, Any]:
    if isinstance(state, Mapping):
        return state
    if isinstance(state, BaseModel):
        return {k: getattr(state, k) for k in type(state).model_fields}
    if dataclasses.is_dataclass(state) and not isinstance(state, type):
        return {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}
    raise TypeError(
        f"unsupported state type {type(state).__name__}; use a TypedDict, dataclass or pydantic model"
    )


def _coerce_params(params: SamplingParams | Mapping[str, Any] | None) -> SamplingParams:
    if params is None:
        return SamplingParams(max_tokens=48)
    if isinstance(params, SamplingParams):
        return params
    fields: dict[str, Any] = {k: tuple(v) if k == "stop" else v for k, v in params.items()}
    return SamplingParams(**fields)


@dataclasses.dataclass(frozen=True)
class LLMCall:
    """One finished LLM call: where it ran, its seed, what came out."""

    node: str
    call_index: int
    seed: int
    prompt: str
    value: Any
    generation: Generation
    constrained: bool


def call_llm(
    config: RunnableConfig,
    *,
    node: str,
    call_index: int,
    prompt: str,
    system: str | None = None,
    params: SamplingParams | None = None,
    output: OutputSpec | None = None,
    mode: str | None = None,
) -> LLMCall:
    """Decode one LLM call inside a graph node, seeded, streamed and audited.

    Usable from hand-written nodes too; the caller owns ``call_index`` (it must be the same when the
    run is re-executed, so count it in the state, as :class:`LLMNode` does).
    """
    ctx: RunContext = get_run_context(config)
    spec = output or OutputSpec()
    seed = derive_seed(ctx.seed, node, call_index)
    sampling = dataclasses.replace(params or SamplingParams(max_tokens=48), seed=seed)
    messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": prompt})
    constrained = not spec.free_text
    decode_mode = mode or ctx.mode
    policy = node_policy(ctx, node, decode_mode)  # the node's calibrated tree policy, if any
    if ctx.record_trees and hasattr(ctx.engine, "policy"):
        # The same policy (node's or engine's), asked to keep each step's whole tree in its record.
        policy = dataclasses.replace(policy or ctx.engine.policy, record_trees=True)

    message_id = f"{ctx.run_id}:{node}:{call_index}"
    lc_messages: list[BaseMessage] = [SystemMessage(content=system)] if system else []
    lc_messages.append(HumanMessage(content=prompt))
    manager = CallbackManager.configure(
        config.get("callbacks"),
        None,
        inheritable_tags=config.get("tags"),
        inheritable_metadata=config.get("metadata"),
    )
    run = manager.on_chat_model_start(
        {"name": "elesium", "id": ["elesium", "graphs", "llm"]},
        [lc_messages],
        name=node,
        invocation_params={
            "seed": seed,
            "temperature": sampling.temperature,
            "max_tokens": sampling.max_tokens,
            "mode": decode_mode or "",
            "call_index": call_index,
            **spec.describe(),
        },
    )[0]
    try:
        writer = get_stream_writer()
    except RuntimeError:  # called outside a LangGraph run (a plain function call in a test or script)
        writer = None

    try:
        # Tokenised once: the same ids decode and go to the acceptance log (train-heads --from-log).
        prompt_ids = ctx.engine.encode_prompt(messages)
        stream = ctx.engine.start(GenerationRequest(
            prompt_ids, sampling, mode=decode_mode, constraint=spec.constraint() if constrained else None,
            policy=policy, tag=CallTag(node, call_index), tenant=ctx.tenant))
        for chunk in stream:
            if not chunk.text and not chunk.token_ids:
                continue
            run.on_llm_new_token(
                chunk.text,
                chunk=ChatGenerationChunk(
                    message=AIMessageChunk(
                        content=chunk.text,
                        id=message_id,
                        response_metadata={"token_ids": list(chunk.token_ids)},
                    )
                ),
            )
            if writer is not None:
                writer(
                    {
                        "node": node,
                        "call_index": call_index,
                        "text": chunk.text,
                        "token_ids": list(chunk.token_ids),
                    }
                )
        gen = stream.result
        truncated = gen.finish_reason in ("length", "deadline")
        value = spec.parse(gen.text, constrained=constrained, truncated=truncated)
    except BaseException as exc:
        run.on_llm_error(exc)
        raise
    usage = {
        "input_tokens": gen.prompt_tokens,
        "output_tokens": gen.new_tokens,
        "total_tokens": gen.prompt_tokens + gen.new_tokens,
    }
    final = AIMessage(
        content=gen.text,
        id=message_id,
        usage_metadata=usage,  # type: ignore[arg-type]
        response_metadata={"finish_reason": gen.finish_reason, "seed": seed, "mode": gen.mode},
    )
    run.on_llm_end(LLMResult(generations=[[ChatGeneration(message=final)]]))
    if ctx.log is not None:
        # The prompt's ids beside the answer: ``train-heads --from-log`` distils from the pair.
        record_call(ctx.log, ctx.run_id, node, call_index, seed, gen,
                    prompt_ids=prompt_ids, temperature=sampling.temperature)
    return LLMCall(
        node=node,
        call_index=call_index,
        seed=seed,
        prompt=prompt,
        value=value,
        generation=gen,
        constrained=constrained,
    )


@dataclasses.dataclass(frozen=True)
class LLMNode:
    """A graph node that asks the model and writes the answer to ``output_key``.

    Build it with :func:`llm_node`; add it with ``builder.add_node(node)`` (LangGraph takes the
    node's ``name``).
    """

    name: str
    prompt: PromptSource
    output_key: str
    params: SamplingParams
    output: OutputSpec
    mode: str | None = None
    system: str | None = None
    template_format: TemplateFormat = "f-string"
    span_of: PromptSource | None = None
    choices_of: Callable[[Mapping[str, Any]], Sequence[str]] | None = None

    @property
    def __name__(self) -> str:  # LangGraph names a node added without a name by it
        return self.name

    def __call__(self, state: Any, config: RunnableConfig) -> dict[str, Any]:
        values = _state_mapping(state)
        call_index = int((values.get(CALLS_KEY) or {}).get(self.name, 0))
        prompt = render(self.prompt, values, self.template_format, node=self.name)
        output = self.output
        if self.span_of is not None:
            source = render(self.span_of, values, self.template_format, node=self.name)
            output = dataclasses.replace(output, source=source)
        if self.choices_of is not None:
            output = OutputSpec.of(list(self.choices_of(values)))
        call = call_llm(
            config,
            node=self.name,
            call_index=call_index,
            prompt=prompt,
            system=self.system,
            params=self.params,
            output=output,
            mode=self.mode,
        )
        return {self.output_key: call.value, CALLS_KEY: {self.name: 1}}

    def fingerprint(self) -> dict[str, Any]:
        """What decides this node's output, for the workflow version hash."""
        params = dataclasses.asdict(self.params)
        params.pop("seed", None)  # derived per call
        params["stop"] = list(params["stop"])
        prompt = self.prompt if isinstance(self.prompt, str) else inspect.getsource(self.prompt)
        return {
            "kind": "llm",
            "name": self.name,
            "prompt": prompt,
            "system": self.system,
            "template_format": self.template_format,
            "output_key": self.output_key,
            "params": params,
            "output": self.output.describe(),
            "mode": self.mode,
            **({"span_of": self.span_of if isinstance(self.span_of, str) else inspect.getsource(self.span_of)}
               if self.span_of is not None else {}),
            **({"choices_of": _source_or_repr(self.choices_of)} if self.choices_of is not None else {}),
        }


def _source_or_repr(fn: Callable[..., Any]) -> str:
    """A callable's source, with the values of the module-level names it reads (a lambda over a table of
    options changes its node's fingerprint when the table changes)."""
    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError, SyntaxError, tokenize.TokenError):  # no or unreadable source: bytecode
        code = getattr(fn, "__code__", None)
        source = repr(fn) if code is None else f"{code.co_code.hex()} {code.co_consts!r} {code.co_names!r}"
    code = getattr(fn, "__code__", None)
    names = code.co_names if code is not None else ()
    values = {n: repr(fn.__globals__[n]) for n in names if n in getattr(fn, "__globals__", {})
              and not callable(fn.__globals__[n]) and not inspect.ismodule(fn.__globals__[n])}
    return source + (repr(sorted(values.items())) if values else "")


def llm_node(
    name: str,
    *,
    prompt: PromptSource,
    output_key: str,
    params: SamplingParams | Mapping[str, Any] | None = None,
    output: type[BaseModel] | Sequence[str] | None = None,
    regex: str | None = None,
    span_of: PromptSource | None = None,
    none: str | None = None,
    choices_of: Callable[[Mapping[str, Any]], Sequence[str]] | None = None,
    mode: str | None = None,
    system: str | None = None,
    template_format: TemplateFormat = "f-string",
) -> LLMNode:
    """An LLM node.

    Args:
        name: the node's name in the graph; also keys its seeds and its acceptance-log entries.
        prompt: a template rendered from the state (``template_format``), or ``f(state) -> str``.
        output_key: the state key the answer is written to.
        params: SamplingParams (or its fields as a dict); its seed is ignored (derived per call).
        output: a pydantic model (the state gets its ``model_dump``), a list of choices (the state
            gets the option), or None for free text.
        regex: constrain free text to a regular expression instead.
        span_of: a template rendered from the state: the answer is a run of its whole words, copied
            (so an extraction is verbatim from the input by construction); ``none``, when given, is
            the answer that means "not there" and writes None to the state.
        choices_of: ``f(state) -> options``: a choice list that depends on the state (the options
            that fit a ticket's category); the node's fingerprint holds the function's source and
            the module-level tables it reads.
        mode: decode mode for this node (default: the run's, else the engine's).
        system: an optional system message.
    """
    if not name or not output_key:
        raise ValueError("llm_node needs a name and an output_key")
    if sum(x is not None for x in (span_of, choices_of, output if output is not None else regex)) > 1:
        raise ValueError("give one of output=/regex=, span_of= and choices_of=")
    if none is not None and span_of is None:
        raise ValueError("none= names the 'not there' answer of a span_of= node")
    return LLMNode(
        name=name,
        prompt=prompt,
        output_key=output_key,
        params=_coerce_params(params),
        output=(OutputSpec.span_of(none) if span_of is not None
                else OutputSpec.of(["?"]) if choices_of is not None else OutputSpec.of(output, regex)),
        mode=mode,
        system=system,
        template_format=template_format,
        span_of=span_of,
        choices_of=choices_of,
    )
