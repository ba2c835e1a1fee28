"""``ChatElesium``: the engine as a LangChain chat model, usable in any LangChain or LangGraph code.

Messages go through the model's own chat template (``Engine.encode_chat``), sampling settings and
the decode mode map onto ``SamplingParams`` and ``Engine.generate``/``stream``, and the answer comes
back as an ``AIMessage`` with usage metadata (input/output tokens) and the run's replay facts (seed,
mode, finish reason, tau) in ``response_metadata``. Streaming yields one chunk per piece of text
the engine makes final, so LangChain's callbacks (``on_llm_new_token``) and LangGraph's
``stream_mode="messages"`` see tokens as they are decoded.

``with_structured_output(PydanticModel)`` does not ask the model nicely for JSON: it binds a
``Constraint.json_schema``, so decoding is masked to the schema's grammar and the
output always parses; the parse returns the validated pydantic instance.

The async forms run the engine on one worker thread per call (the engine is synchronous, and a
stream holds the engine's FIFO lock from the thread that started it), handing chunks to the event
loop through a queue; leaving the ``async for`` early closes the stream and frees the engine.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from operator import itemgetter
from pathlib import Path
from typing import Any

import pydantic
from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.messages.ai import UsageMetadata
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableLambda, RunnableMap, RunnablePassthrough
from pydantic import ConfigDict, Field

from elesium.inference.constraints import Constraint
from elesium.inference.records import Generation
from elesium.inference.sampling import SamplingParams
from elesium.inference.types import GenerationRequest, TextEngine, generate

# Per-call options ``invoke(..., **kwargs)`` / ``bind(...)`` may set; anything else is an error.
_CALL_OPTIONS = ("temperature", "top_p", "top_k", "max_tokens", "seed", "mode", "constraint", "deadline_s")


class ChatElesium(BaseChatModel):
    """A LangChain chat model running on an Elesium ``Engine`` (in process, no server).

    Example::

        llm = ChatElesium(engine=Engine.load(), temperature=0.0, max_tokens=64)
        llm.invoke("Summarise: ...").content
        llm.with_structured_output(Ticket).invoke("Classify: ...")   # a Ticket instance
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    engine: TextEngine = Field(exclude=True)
    """The engine to decode on (:class:`~elesium.inference.types.TextEngine`: the ``Engine``, or the run's
    recording wrapper inside a workflow)."""
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 256
    seed: int | None = None
    """None draws a fresh seed per call (recorded in ``response_metadata["seed"]``)."""
    mode: str | None = None
    """"vanilla", "speculative" (alias "medusa") or "typical"; None: the engine's default."""
    stop: list[str] | None = None
    deadline_s: float | None = None
    """Seconds after which a call ends with what it has (``finish_reason`` "deadline"); None: no limit."""
    streaming: bool = False
    """Stream even through ``invoke`` (so callbacks get ``on_llm_new_token``)."""

    @property
    def _llm_type(self) -> str:
        return "elesium"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model_name": self._model_name(),
                "model_sha256": self.engine.describe().get("model_sha256", ""),
                "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                "max_tokens": self.max_tokens, "seed": self.seed, "mode": self.mode}

    def _model_name(self) -> str:
        model = self.engine.describe().get("model", "")
        return Path(model).name if model else "elesium"

    # -- request building -------------------------------------------------------------------------
    def _request(self, messages: list[BaseMessage], stop: list[str] | None,
                 kwargs: dict[str, Any]) -> GenerationRequest:
        unknown = sorted(set(kwargs) - set(_CALL_OPTIONS) - {"stream", "ls_structured_output_format"})
        if unknown:
            raise ValueError(f"ChatElesium does not take {', '.join(unknown)}; "
                             f"options: {', '.join(_CALL_OPTIONS)}")
        opt = {name: kwargs.get(name, getattr(self, name, None)) for name in _CALL_OPTIONS}
        stops = tuple(dict.fromkeys([*(self.stop or ()), *(stop or ())]))
        params = SamplingParams(temperature=float(opt["temperature"]), top_p=float(opt["top_p"]),
                                top_k=int(opt["top_k"]), max_tokens=int(opt["max_tokens"]), seed=opt["seed"],
                                stop=stops, deadline_s=opt["deadline_s"])
        constraint = opt["constraint"]
        if constraint is not None and not isinstance(constraint, Constraint):
            raise TypeError(f"constraint must be an elesium Constraint, not {type(constraint).__name__}")
        return GenerationRequest(to_chat_messages(messages), params, mode=opt["mode"], constraint=constraint)

    # -- sync -------------------------------------------------------------------------------------
    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        if self.streaming or kwargs.get("stream"):
            chunks = list(self._stream(messages, stop, run_manager, **kwargs))
            return _result_from_chunks(chunks)
        result = generate(self.engine, self._request(messages, stop, kwargs))
        message = AIMessage(content=result.text, usage_metadata=_usage(result),
                            response_metadata=self._metadata(result))
        generation = ChatGeneration(message=message, generation_info=self._metadata(result))
        return ChatResult(generations=[generation],
                          llm_output={"token_usage": dict(_usage(result)), "model_name": self._model_name()})

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None,
                **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        stream = self.engine.start(self._request(messages, stop, kwargs))
        try:
            for piece in stream:
                if not piece.text:
                    continue
                chunk = ChatGenerationChunk(message=AIMessageChunk(content=piece.text))
                if run_manager is not None:
                    run_manager.on_llm_new_token(piece.text, chunk=chunk)
                yield chunk
            result = stream.result
        finally:
            stream.close()
        meta = self._metadata(result)
        yield ChatGenerationChunk(
            message=AIMessageChunk(content="", usage_metadata=_usage(result), response_metadata=meta,
                                   chunk_position="last"),
            generation_info=meta)

    # -- async ------------------------------------------------------------------------------------
    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None,
                         **kwargs: Any) -> ChatResult:
        if self.streaming or kwargs.get("stream"):
            chunks = [c async for c in self._astream(messages, stop, run_manager, **kwargs)]
            return _result_from_chunks(chunks)
        return await asyncio.to_thread(self._generate, messages, stop, None, **kwargs)

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        leave = threading.Event()
        done = object()

        def post(item: Any) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the loop is gone: nobody is listening any more
                leave.set()

        def produce() -> None:
            chunks = self._stream(messages, stop, None, **kwargs)
            try:
                for chunk in chunks:
                    if leave.is_set():
                        break
                    post(chunk)
            except BaseException as e:  # handed to the consumer, which re-raises it
                post(_Failure(e))
            finally:
                chunks.close()  # closes the engine stream (and frees the engine) on this thread
                post(done)

        worker = threading.Thread(target=produce, name="elesium-astream", daemon=True)
        worker.start()
        try:
            while True:
                item = await queue.get()
                if item is done:
                    break
                if isinstance(item, _Failure):
                    raise item.error
                if run_manager is not None and item.text:
                    await run_manager.on_llm_new_token(item.text, chunk=item)
                yield item
        finally:
            leave.set()

    # -- structured output ------------------------------------------------------------------------
    def with_structured_output(
        self, schema: dict[str, Any] | type, *, include_raw: bool = False, **kwargs: Any,
    ) -> Runnable[LanguageModelInput, dict[str, Any] | pydantic.BaseModel]:
        """Decode under ``schema``'s grammar and parse the answer.

        ``schema`` is a pydantic model class (the result is a validated instance) or a JSON schema
        dict (the result is the parsed JSON). No tool calling and no "please answer in JSON"
        prompt: the constraint makes any other output impossible.
        """
        if kwargs.get("method") not in (None, "json_schema"):
            raise ValueError("ChatElesium structures output with method='json_schema' "
                             "(constrained decoding) only")
        constraint = Constraint.json_schema(schema)  # type: ignore[arg-type]
        llm = self.bind(constraint=constraint)
        parser = RunnableLambda(lambda message: constraint.parse(_text(message)),
                                name="ElesiumStructuredParser")
        if not include_raw:
            return llm | parser
        parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        empty = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parsed.with_fallbacks([empty], exception_key="parsing_error")

    def _metadata(self, result: Generation) -> dict[str, Any]:
        """What the call's ``AIMessage`` carries in ``response_metadata`` (LangChain merges the generation's
        info there too): what the output depends on, nothing about how it was decoded. A graph keeps the
        message in its state (``MessagesState``), which replay compares: a wall time would differ in every
        re-execution, and a replay from the record has the tokens but not the decoding's steps. Timing and
        acceptance are in the engine's spans, metrics and the run's acceptance log."""
        return {"finish_reason": result.finish_reason, "model_name": self._model_name(), "mode": result.mode,
                "seed": result.seed}


class _Failure:
    """An exception raised on the worker thread, carried to the consuming coroutine."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


def to_chat_messages(messages: Sequence[BaseMessage]) -> list[dict[str, str]]:
    """LangChain messages as the ``{"role", "content"}`` list the chat template renders."""
    out: list[dict[str, str]] = []
    for message in messages:
        if isinstance(message, SystemMessage):
            role = "system"
        elif isinstance(message, HumanMessage):
            role = "user"
        elif isinstance(message, AIMessage):
            role = "assistant"
        elif isinstance(message, ToolMessage):
            role = "tool"
        elif isinstance(message, ChatMessage):
            role = message.role
        else:
            raise ValueError(f"ChatElesium cannot send a {type(message).__name__}")
        out.append({"role": role, "content": _text(message)})
    if not out:
        raise ValueError("no messages to send")
    return out


def _text(message: BaseMessage) -> str:
    """A message's text; list content keeps its text blocks (this model reads no images)."""
    content = message.content
    if isinstance(content, str):
        return content
    parts = [c if isinstance(c, str) else str(c.get("text", "")) for c in content
             if isinstance(c, str) or (isinstance(c, dict) and c.get("type") == "text")]
    return "".join(parts)


def _usage(result: Generation) -> UsageMetadata:
    return UsageMetadata(input_tokens=result.prompt_tokens, output_tokens=result.new_tokens,
                         total_tokens=result.prompt_tokens + result.new_tokens)


def _result_from_chunks(chunks: list[ChatGenerationChunk]) -> ChatResult:
    if not chunks:
        raise RuntimeError("the engine stream ended without output")
    total = chunks[0]
    for chunk in chunks[1:]:
        total = total + chunk
    message = AIMessage(content=_text(total.message), usage_metadata=total.message.usage_metadata,
                        response_metadata=total.message.response_metadata)
    return ChatResult(generations=[ChatGeneration(message=message, generation_info=total.generation_info)])
