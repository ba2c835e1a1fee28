"""OpenAI chat completions as a service: validate, generate on the engine thread, frame the answer.

The route (:mod:`elesium.api.routers.openai`) only translates HTTP: it calls :func:`prepare`, then
either awaits :meth:`ChatCompletion.complete` or starts :meth:`ChatCompletion.start_stream` and
wraps :meth:`ChatCompletion.frames` in an SSE response, passing the channel's events filtered by the
client's disconnect. Nothing here touches Redis: a chat completion is not a run and records nothing.

What the OpenAI parameters mean here (README "OpenAI-compatible"):

* ``response_format``: ``json_schema`` decodes under :meth:`Constraint.json_schema` of the given
  schema (``strict`` or not: the output always matches it, unless ``max_tokens`` cuts it short,
  which ``finish_reason: "length"`` says); ``json_object`` under a grammar for any JSON object;
  ``text`` is plain decoding. The grammar masks every position, vanilla and speculative alike.
* ``tools`` / ``tool_choice``: a call is the text ``<tool_call>{"name": ..., "arguments": {...}}``
  (:data:`SENTINEL`). ``"required"`` or a named function decode under a grammar that allows only
  that: the sentinel, then a JSON object whose ``name`` is one of the (allowed) tools and whose
  ``arguments`` are valid under that tool's ``parameters`` schema. ``"auto"`` (the default with
  tools) decodes under a grammar allowing either the same call or plain text that does not begin
  with ``<``: the model's own distribution over the first tokens decides, nothing else.
  ``"none"`` is plain decoding and the tools are not described to the model. The tools are
  described to the model in the system message; earlier assistant calls and ``role: "tool"``
  results are rendered as plain text turns (the bundled model's chat template knows no tool
  roles): calls as the assistant's sentinel text, results as user turns naming the call.
  At most one call per turn (``parallel_tool_calls: true`` answers 400).
* ``logprobs`` / ``top_logprobs``: the base model's own distribution (log-softmax of its raw
  logits: no temperature, top-k/top-p or grammar mask), as OpenAI reports it, scored by one
  teacher-forced forward of prompt plus output after the generation.
* Everything else OpenAI defines that would change the output (``n`` > 1, penalties, ``logit_bias``,
  ``functions``, ``audio``...) and every unknown key answers 400 naming it (:data:`HARMLESS` lists
  what is accepted without effect).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from elesium.api.errors import BadRequest, NotFound
from elesium.api.events import RunChannel
from elesium.api.execution import Services
from elesium.api.schemas import ChatCompletionRequest
from elesium.inference.constraints import _JSON_OPTIONS, Constraint, ConstraintError, closed_objects
from elesium.inference.types import GenerationRequest

log = logging.getLogger("elesium.api")

SENTINEL = "<tool_call>"
"""What a tool call's text begins with; plain text answers under ``tool_choice: "auto"`` cannot."""

HARMLESS: dict[str, Callable[[Any], bool]] = {
    # Accepted without effect: bookkeeping and hints that change no token.
    "user": lambda v: True,
    "metadata": lambda v: True,
    "safety_identifier": lambda v: True,
    "prompt_cache_key": lambda v: True,
    "service_tier": lambda v: v in (None, "auto", "default"),
    "store": lambda v: v in (None, False),
    # Accepted at their neutral value only.
    "n": lambda v: v in (None, 1),
    "presence_penalty": lambda v: v in (None, 0),
    "frequency_penalty": lambda v: v in (None, 0),
    "logit_bias": lambda v: not v,
    "parallel_tool_calls": lambda v: v in (None, False),
    "modalities": lambda v: v in (None, ["text"]),
}
"""Keys outside the request model that are accepted, each at the values for which it changes nothing."""

_WHY = {
    "n": "this server returns one choice per request",
    "parallel_tool_calls": "this server makes at most one tool call per turn (send false or omit it)",
    "functions": "legacy functions are not supported; use tools",
    "function_call": "legacy function_call is not supported; use tool_choice",
    "store": "this server stores no completions",
}


def _report_late_failure(job: asyncio.Future[Any]) -> None:
    """Done callback of a generation whose client left: its outcome is read by nobody, so a failure
    is logged here (asyncio would otherwise complain that the exception was never retrieved)."""
    if not job.cancelled() and job.exception() is not None:
        log.warning("chat completion failed after its client left", exc_info=job.exception())


class ParamError(BadRequest):
    """A 400 about one request parameter, named in OpenAI's error body (``error.param``)."""

    def __init__(self, param: str, detail: str) -> None:
        super().__init__(detail)
        self.param = param


def _finish(reason: str) -> str:
    """OpenAI knows only "length" and "stop"; a stop string or the end token are both "stop", and an answer
    cut short by its deadline is "length" (cut, not finished)."""
    return "length" if reason in ("length", "deadline") else "stop"


def _usage(gen: Any) -> dict[str, int]:
    return {
        "prompt_tokens": gen.prompt_tokens,
        "completion_tokens": gen.new_tokens,
        "total_tokens": gen.prompt_tokens + gen.new_tokens,
    }


class LarkConstraint(Constraint):
    """A Lark grammar (llguidance's dialect, with ``%json`` schemas inline): the tool-call grammars."""

    kind = "lark"

    def __init__(self, lark: str) -> None:
        import llguidance as llg

        self.lark = lark
        self._grammar = llg.LLMatcher.grammar_from_lark(lark)
        self._validate()

    @property
    def grammar(self) -> str:
        return self._grammar


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]

    def call_schema(self) -> dict[str, Any]:
        return {"type": "object", "properties": {"name": {"const": self.name}, "arguments": self.parameters},
                "required": ["name", "arguments"], "additionalProperties": False}


def _tools(body: ChatCompletionRequest) -> list[Tool]:
    out: list[Tool] = []
    for i, spec in enumerate(body.tools or []):
        fn = spec.get("function") if isinstance(spec, dict) else None
        if not isinstance(spec, dict) or spec.get("type") != "function" or not isinstance(fn, dict):
            raise BadRequest(f"tools[{i}]: only function tools are supported "
                             '({"type": "function", "function": {...}})')
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise BadRequest(f"tools[{i}].function.name is missing")
        if any(t.name == name for t in out):
            raise BadRequest(f"tools[{i}].function.name {name!r} is given twice")
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise BadRequest(f"tools[{i}].function.parameters must be a JSON schema object")
        out.append(Tool(name, str(fn.get("description") or ""), closed_objects(params)))
    return out


def _tool_choice(body: ChatCompletionRequest, tools: list[Tool]) -> tuple[str, list[Tool]]:
    """("none" | "auto" | "required", the tools a call may name)."""
    choice = body.tool_choice
    if choice is None:
        return ("auto" if tools else "none"), tools
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise BadRequest(f"tool_choice {choice!r}: use none, auto, required or a named function")
        if choice != "none" and not tools:
            raise BadRequest(f"tool_choice {choice!r} needs tools")
        return choice, tools
    fn = choice.get("function") if choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    chosen = [t for t in tools if t.name == name]
    if not chosen:
        raise BadRequest(f"tool_choice names function {name!r}, which is not among tools")
    return "required", chosen


def _call_constraint(choice: str, allowed: list[Tool]) -> Constraint:
    schemas = [t.call_schema() for t in allowed]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    inline = json.dumps({**schema, "x-guidance": _JSON_OPTIONS})
    call = f"call: {json.dumps(SENTINEL)} %json {inline}"
    if choice == "required":
        return LarkConstraint(f"start: call\n{call}")
    # Plain text may not begin with "<", so the first token(s) decide between text and a call.
    return LarkConstraint(f"start: call | text\n{call}\ntext: /[^<][\\s\\S]*/")


def _format_constraint(body: ChatCompletionRequest) -> Constraint | None:
    rf = body.response_format
    if rf is None:
        return None
    kind = rf.get("type")
    try:
        if kind == "text":
            return None
        if kind == "json_object":
            return Constraint.json_schema({"type": "object"})
        if kind == "json_schema":
            spec = rf.get("json_schema")
            if not isinstance(spec, dict) or not spec.get("name"):
                raise BadRequest("response_format.json_schema needs a name and a schema")
            schema = spec.get("schema", {"type": "object"})
            if not isinstance(schema, dict):
                raise BadRequest("response_format.json_schema.schema must be a JSON schema object")
            return Constraint.json_schema(schema)
    except ConstraintError as exc:
        raise BadRequest(f"response_format: {exc}") from None
    raise BadRequest(f"response_format type {kind!r}: use text, json_object or json_schema")


def _tool_prompt(tools: list[Tool], choice: str) -> str:
    lines = ["You can call these tools:"]
    for t in tools:
        lines.append(f"- {t.name}: {t.description} Arguments (JSON schema): {json.dumps(t.parameters)}")
    how = f'{SENTINEL}{{"name": "<tool name>", "arguments": {{...}}}}'
    if choice == "required":
        lines.append(f"Call one tool now: reply with exactly {how}")
    else:
        lines.append(f"To call a tool, reply with exactly {how} and nothing else; "
                     "otherwise answer in plain text.")
    return "\n".join(lines)


def _render(body: ChatCompletionRequest, tools: list[Tool], choice: str) -> list[dict[str, str]]:
    """The chat as the template sees it: tool calls and results as plain text turns."""
    messages: list[dict[str, str]] = []
    names: dict[str, str] = {}  # tool_call_id -> function name, from earlier assistant calls
    for i, m in enumerate(body.messages):
        role = "system" if m.role == "developer" else m.role
        text = m.text()
        if m.role == "assistant" and m.tool_calls:
            calls = []
            for j, call in enumerate(m.tool_calls):
                fn = call.get("function") or {}
                args = fn.get("arguments", "{}")
                try:
                    parsed = json.loads(args) if isinstance(args, str) else args
                except json.JSONDecodeError:
                    raise BadRequest(
                        f"messages[{i}].tool_calls[{j}].function.arguments is not JSON") from None
                names[str(call.get("id"))] = str(fn.get("name"))
                calls.append(SENTINEL + json.dumps({"name": fn.get("name"), "arguments": parsed}))
            text = "\n".join(([text] if text else []) + calls)
        elif m.role == "tool":
            if m.tool_call_id is None or m.tool_call_id not in names:
                raise BadRequest(f"messages[{i}]: a tool message's tool_call_id must answer a tool call "
                                 "of an earlier assistant message")
            role = "user"
            text = f"Result of tool call {names[m.tool_call_id]} ({m.tool_call_id}):\n{text}"
        messages.append({"role": role, "content": text})
    if tools and choice != "none":
        extra = _tool_prompt(tools, choice)
        if messages[0]["role"] == "system":
            messages[0] = {"role": "system", "content": f"{messages[0]['content']}\n\n{extra}"}
        else:
            messages.insert(0, {"role": "system", "content": f"You are a helpful AI assistant.\n\n{extra}"})
    return messages


def _refuse_unsupported(body: ChatCompletionRequest) -> None:
    for key, value in (body.model_extra or {}).items():
        ok = HARMLESS.get(key)
        if ok is None or not ok(value):
            why = _WHY.get(key, "this server does not support it" if ok is None
                           else "only its neutral value is supported")
            raise ParamError(key, f"parameter {key!r} is not supported: {why}")


@dataclass
class ChatCompletion:
    """One validated request: what the engine generates from, and the ids its answer carries."""

    svc: Services
    messages: list[dict[str, str]]
    params: Any  # elesium.inference.sampling.SamplingParams
    mode: str | None
    prompt_tokens: int
    prompt_ids: list[int] = field(default_factory=list)
    constraint: Constraint | None = None
    tool_choice: str = "none"
    top_logprobs: int | None = None  # None: no logprobs
    include_usage: bool = False
    cid: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex[:24]}")
    created: int = field(default_factory=lambda: int(time.time()))
    # When the request arrived (perf_counter): its serving latencies include the wait for the engine thread.
    arrived_at: float = field(default_factory=time.perf_counter)
    tenant: str | None = None  # who asked: fair admission to the engine's batch

    @property
    def model(self) -> str:
        return self.svc.settings.model_name

    def _request(self) -> GenerationRequest:
        return GenerationRequest(self.messages, self.params, mode=self.mode, constraint=self.constraint,
                                 arrived_at=self.arrived_at, tenant=self.tenant)

    def _count(self, gen: Any) -> None:
        self.svc.metrics.generated_tokens.inc(gen.new_tokens)
        self.svc.metrics.prompt_tokens.inc(gen.prompt_tokens)
        self.svc.metrics.observe_steps(list(gen.steps))

    def _message(self, gen: Any) -> tuple[dict[str, Any], str]:
        """The assistant message and finish reason: a parsed tool call, or the text."""
        text = gen.text
        if self.tool_choice != "none" and text.startswith(SENTINEL):
            try:
                call = json.loads(text[len(SENTINEL):])
            except json.JSONDecodeError:
                call = None  # cut short by max_tokens or a stop string: returned as text
            if isinstance(call, dict):
                tool_call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                             "function": {"name": call.get("name"),
                                          "arguments": json.dumps(call.get("arguments", {}))}}
                return {"role": "assistant", "content": None, "tool_calls": [tool_call]}, "tool_calls"
        return {"role": "assistant", "content": text}, _finish(gen.finish_reason)

    def _logprobs(self, gen: Any) -> dict[str, Any] | None:
        """OpenAI's ``logprobs.content``: each output token under the base model's distribution."""
        if self.top_logprobs is None:
            return None
        import torch

        from elesium.inference.constraints import _vocabulary

        engine: Any = self.svc.engine
        ids = list(gen.token_ids)
        # Tokens past a stop string's end are not in the answer; keep those that cover its text.
        if gen.finish_reason == "stop":
            ids = ids[:next((n for n in range(len(ids) + 1)
                             if len(engine.tokenizer.decode(ids[:n])) >= len(gen.text)), len(ids))]
        if not ids:
            return {"content": [], "refusal": None}
        model = engine.model
        hidden = engine.hidden_states(self.prompt_ids + ids[:-1], [model.config.num_layers])[0]
        with torch.inference_mode():
            rows = hidden[len(self.prompt_ids) - 1:].to(device=model.device, dtype=model.norm.weight.dtype)
            logp = torch.log_softmax(model.logits(model.norm(rows)).float(), dim=-1).cpu()
        vocab = _vocabulary(engine.tokenizer, None).tokenizer

        def entry(token: int, value: float) -> dict[str, Any]:
            raw = bytes(vocab.decode_bytes([token]))
            return {"token": raw.decode("utf-8", errors="backslashreplace"), "logprob": value,
                    "bytes": list(raw)}

        content = []
        k = self.top_logprobs
        for pos, token in enumerate(ids):
            row = logp[pos]
            item = entry(token, float(row[token]))
            top = torch.topk(row, k) if k else None
            item["top_logprobs"] = [] if top is None else [
                entry(int(t), float(v))
                for v, t in zip(top.values.tolist(), top.indices.tolist(), strict=True)]
            content.append(item)
        return {"content": content, "refusal": None}

    async def complete(self, left: Awaitable[None] | None = None) -> dict[str, Any] | None:
        """The whole answer, generated in turn with runs and replays on the engine thread.

        ``left`` completes when the client goes away (:func:`elesium.api.routers.common.until_disconnect`):
        the generation then stops at its next decoding step (or never starts, if still queued), the
        engine is free for the next caller at once, and this returns None (nobody reads an answer).
        """
        cancel = threading.Event()
        started: list[Any] = []  # the generation's handle, once the engine thread has started it

        def work() -> tuple[Any, dict[str, Any] | None] | None:
            if cancel.is_set():  # the client left while the job was being taken off the queue
                self.svc.metrics.chat_completions.labels(finish_reason="abort").inc()
                return None
            handle = self.svc.tracing.engine(self.svc.engine, response_id=self.cid).start(self._request())
            started.append(handle)
            tokens, steps = 0, []
            try:
                if not cancel.is_set():
                    for chunk in handle:
                        tokens += len(getattr(chunk, "token_ids", ()) or ())
                        if getattr(chunk, "step", None) is not None:
                            steps.append(chunk.step)
                        if cancel.is_set():
                            break
                if cancel.is_set():
                    self._abandoned(tokens, steps)
                    return None
                gen = handle.result
            finally:
                handle.close()  # releases the engine at once if the loop was left early
            self._count(gen)
            return gen, self._logprobs(gen)

        def stop() -> None:
            """The client left: the generation ends after the step it is in (or while it waits for the
            engine), a job still queued is dropped unrun (the engine thread skips a cancelled future)."""
            cancel.set()
            if submitted.cancel():
                self.svc.metrics.chat_completions.labels(finish_reason="abort").inc()
            for handle in started:
                handle.close()  # thread-safe; wakes a generation still queued for the engine's gate

        submitted = self.svc.worker.submit(work)
        job = asyncio.wrap_future(submitted)
        if left is None:
            outcome = await job
        else:
            watch = asyncio.ensure_future(left)
            either: set[asyncio.Future[Any]] = {job, watch}
            try:
                await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:  # the request itself was cancelled (server shutdown)
                stop()
                job.add_done_callback(_report_late_failure)
                raise
            finally:
                watch.cancel()
            if not job.done():
                stop()
                job.add_done_callback(_report_late_failure)
                return None
            outcome = job.result()
        if outcome is None:
            return None
        gen, logprobs = outcome
        message, finish = self._message(gen)
        self.svc.metrics.chat_completions.labels(finish_reason=finish).inc()
        return {
            "id": self.cid,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": f"seed-{gen.seed}",
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": logprobs}],
            "usage": _usage(gen),
        }

    def _abandoned(self, tokens: int, steps: list[Any]) -> None:
        """Count a generation stopped because its client left: the tokens it decoded, an "abort"."""
        self.svc.metrics.generated_tokens.inc(tokens)
        self.svc.metrics.prompt_tokens.inc(self.prompt_tokens)
        self.svc.metrics.observe_steps(steps)
        self.svc.metrics.chat_completions.labels(finish_reason="abort").inc()

    def start_stream(self) -> RunChannel:
        """Queue the generation on the engine thread; its deltas, then "done" or "error", reach the channel.

        Setting ``channel.cancel`` (the client left) stops the generation at its next token and frees
        the engine at once.
        """
        channel = RunChannel()
        self.svc.worker.submit(lambda: self._stream_work(channel))
        return channel

    def _stream_work(self, channel: RunChannel) -> None:
        stream = None
        finished = False
        try:
            if channel.cancel.is_set():
                self.svc.metrics.chat_completions.labels(finish_reason="abort").inc()
                return
            stream = self.svc.tracing.engine(self.svc.engine, response_id=self.cid).start(self._request())
            for chunk in stream:
                if channel.cancel.is_set():
                    self.svc.metrics.chat_completions.labels(finish_reason="abort").inc()
                    return
                if chunk.text:
                    channel.publish("delta", chunk.text)
            finished = True
            gen = stream.result
            self._count(gen)
            self.svc.metrics.chat_completions.labels(finish_reason=_finish(gen.finish_reason)).inc()
            channel.publish("done", {"finish_reason": _finish(gen.finish_reason), "usage": _usage(gen)})
        except Exception as exc:  # noqa: BLE001
            # Safe: a chat completion records nothing and replays nothing; the headers are already
            # sent, so the failure can only be reported in-stream.
            channel.publish("error", {"message": f"{type(exc).__name__}: {exc}"})
        finally:
            if stream is not None and not finished and hasattr(stream, "close"):
                stream.close()  # releases the engine at once
            channel.close()

    def _chunk(self, delta: dict[str, Any], finish: str | None = None) -> bytes:
        data: dict[str, Any] = {
            "id": self.cid,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
        }
        if self.include_usage:
            data["usage"] = None
        return f"data: {json.dumps(data)}\n\n".encode()

    async def frames(self, events: AsyncIterator[tuple[str, Any]]) -> AsyncIterator[bytes]:
        """The OpenAI SSE body for the channel's ``events``: role, deltas, finish, usage, ``[DONE]``."""
        yield self._chunk({"role": "assistant", "content": ""})
        async for kind, data in events:
            if kind == "delta":
                yield self._chunk({"content": data})
            elif kind == "done":
                yield self._chunk({}, data["finish_reason"])
                if self.include_usage:
                    usage = {
                        "id": self.cid,
                        "object": "chat.completion.chunk",
                        "created": self.created,
                        "model": self.model,
                        "choices": [],
                        "usage": data["usage"],
                    }
                    yield f"data: {json.dumps(usage)}\n\n".encode()
            elif kind == "error":
                yield f"data: {json.dumps({'error': data})}\n\n".encode()
        yield b"data: [DONE]\n\n"


def prompt_limit(svc: Services, max_tokens: int) -> tuple[int, str]:
    """The most prompt tokens a request asking for ``max_tokens`` may send, and why: the server's
    configured limit or the model's context less the reply's room, whichever is smaller."""
    context = svc.engine.context_length
    room = context - max_tokens
    configured = svc.settings.max_prompt_tokens
    if configured is not None and configured <= room:
        return configured, "this server's max_prompt_tokens setting (ELESIUM_MAX_PROMPT_TOKENS)"
    return max(room, 0), (f"the model's context of {context:,} tokens less max_tokens {max_tokens:,} "
                          "for the reply")


def prepare(svc: Services, body: ChatCompletionRequest) -> ChatCompletion:
    """Validate everything before the engine sees it (nothing is queued for a refused request).

    Unsupported parameters and server limits answer 400 (:class:`BadRequest`) naming them, an unknown
    model 404, an unknown decode mode 422 like a run's (:meth:`Services.decode_mode`).
    """
    from elesium.inference.engine import PromptTooLongError
    from elesium.inference.sampling import SamplingParams

    if body.model not in (svc.settings.model_name, "elesium"):
        raise NotFound(f"model {body.model!r} not found; GET /v1/models lists {svc.settings.model_name!r}")
    _refuse_unsupported(body)
    tools = _tools(body)
    choice, allowed = _tool_choice(body, tools)
    constraint = _format_constraint(body)
    if choice != "none":
        if constraint is not None:
            raise BadRequest("response_format together with tools is not supported (send tool_choice "
                             "\"none\" or leave response_format out)")
        constraint = _call_constraint(choice, allowed)
        if body.stream:
            raise BadRequest("stream with tools is not supported: tool calls are not streamed "
                             "(send stream false, or tool_choice \"none\")")
    top: int | None = None
    if body.top_logprobs is not None and not body.logprobs:
        raise BadRequest("top_logprobs needs logprobs: true")
    if body.logprobs:
        top = body.top_logprobs or 0
        if not 0 <= top <= 20:
            raise BadRequest(f"top_logprobs {top} is out of range: use 0 to 20")
        if body.stream:
            raise BadRequest("logprobs with stream is not supported (send stream false)")
        if not hasattr(svc.engine, "model") or not hasattr(svc.engine, "tokenizer"):
            raise BadRequest("logprobs are not available on this server's engine")
    messages = _render(body, tools, choice)
    if not any(m["content"].strip() for m in messages):
        raise BadRequest("messages are empty")
    max_tokens = body.max_completion_tokens or body.max_tokens or 256
    cap = svc.settings.max_tokens_cap
    if max_tokens > cap:
        raise BadRequest(f"max_tokens {max_tokens:,} exceeds this server's cap of {cap:,} "
                         "(max_tokens_cap, ELESIUM_MAX_TOKENS_CAP)")
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    try:
        params = SamplingParams(
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            max_tokens=max_tokens,
            seed=body.seed,
            stop=tuple(stops),
            deadline_s=body.deadline_s,
        )
        try:
            prompt_ids = svc.engine.encode_prompt(messages)
        except PromptTooLongError:
            # Over the whole context: counted again without the engine's own check, so the answer
            # is the same one as for a prompt just over the limit.
            prompt_ids = svc.engine.tokenizer.encode_chat(messages)  # type: ignore[attr-defined]
    except ValueError as exc:
        raise BadRequest(str(exc).splitlines()[0]) from None
    n_prompt = len(prompt_ids)
    limit, why = prompt_limit(svc, max_tokens)
    if n_prompt > limit:
        raise BadRequest(f"prompt is {n_prompt:,} tokens; this request allows at most {limit:,}: {why}")
    return ChatCompletion(
        svc=svc,
        messages=messages,
        params=params,
        mode=svc.decode_mode(body.mode) if body.mode is not None else None,
        prompt_tokens=n_prompt,
        prompt_ids=list(prompt_ids),
        constraint=constraint,
        tool_choice=choice,
        top_logprobs=top,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
    )
