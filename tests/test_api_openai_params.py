"""OpenAI parameters on /v1/chat/completions, through the ``openai`` package against the live server:
structured output (json_schema, json_object), tool calls, logprobs, 400s naming every unsupported
parameter, and the limits as settings with one message for an over-long prompt."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from pydantic import BaseModel

from api_server import KEY_A

pytest_plugins = ["state_fixtures", "api_server"]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the current time in a timezone.",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}},
                   "required": ["timezone"]}}}


@pytest.fixture(scope="module")
def oai(api_server):
    from openai import OpenAI

    return OpenAI(base_url=f"{api_server.url}/v1", api_key=KEY_A, max_retries=0)


def post(api_server, body: dict) -> httpx.Response:
    with api_server.http(KEY_A) as h:
        return h.post("/v1/chat/completions", json={"model": "elesium", **body})


class City(BaseModel):
    name: str
    country: str


@pytest.mark.parametrize("mode", ["vanilla", "speculative"])
def test_json_schema_parses_into_the_model(oai, mode):
    out = oai.chat.completions.parse(
        model="elesium", response_format=City, max_tokens=40, seed=1, extra_body={"mode": mode},
        messages=[{"role": "user", "content": "Name a big city and its country."}])
    parsed = out.choices[0].message.parsed
    assert isinstance(parsed, City) and parsed.name and parsed.country
    assert out.choices[0].finish_reason == "stop"


def test_json_object_parses(oai):
    out = oai.chat.completions.create(
        model="elesium", response_format={"type": "json_object"}, max_tokens=64, seed=1,
        messages=[{"role": "user", "content": "Reply with the JSON object {\"answer\": 4}."}])
    assert isinstance(json.loads(out.choices[0].message.content), dict)
    assert out.choices[0].finish_reason == "stop"


def test_required_tool_call_round_trip(oai):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    out = oai.chat.completions.create(model="elesium", messages=messages, tools=[WEATHER, TIME],
                                      tool_choice="required", max_tokens=40, seed=1)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id and call.function.name in ("get_weather", "get_time")
    args = json.loads(call.function.arguments)
    key = "city" if call.function.name == "get_weather" else "timezone"
    assert set(args) == {key} and isinstance(args[key], str)
    # The call and its result go back; "auto" lets the model answer in text.
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 degrees Celsius."}]
    final = oai.chat.completions.create(model="elesium", messages=messages, tools=[WEATHER, TIME],
                                        max_tokens=24, seed=1)
    assert final.choices[0].message.tool_calls is None and final.choices[0].message.content
    assert final.choices[0].finish_reason in ("stop", "length")


def test_named_tool_choice_and_unknown_tool_call_id(oai, api_server):
    out = oai.chat.completions.create(
        model="elesium", messages=[{"role": "user", "content": "What time is it in Tokyo?"}],
        tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=40, seed=1)
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    assert isinstance(json.loads(call.function.arguments)["timezone"], str)
    r = post(api_server, {"max_tokens": 2, "messages": [
        {"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "call_nope", "content": "x"}]})
    assert r.status_code == 400 and "tool_call_id" in r.json()["detail"]


def test_logprobs_are_the_models_own_log_softmax(oai, engine):
    messages = [{"role": "user", "content": "Say hello."}]
    out = oai.chat.completions.create(model="elesium", messages=messages, max_tokens=6,
                                      logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    text = b"".join(bytes(c.bytes) for c in content).decode("utf-8", "replace")
    assert text == out.choices[0].message.content
    for c in content:
        assert len(c.top_logprobs) == 3 and c.token == bytes(c.bytes).decode("utf-8", "backslashreplace")
        # Greedy: the chosen token is the model's most likely one.
        assert c.top_logprobs[0].token == c.token and abs(c.top_logprobs[0].logprob - c.logprob) < 1e-6
    # The engine's own log-softmax over prompt + output, one teacher-forced forward.
    from elesium.inference.sampling import SamplingParams

    gen = engine.generate(messages, SamplingParams(max_tokens=6))
    ids = engine.encode_prompt(messages) + list(gen.token_ids)
    with torch.inference_mode():
        model = engine.model
        hidden = model(torch.tensor([ids[:-1]]), torch.arange(len(ids) - 1), model.new_cache(len(ids)), 0)
        logp = torch.log_softmax(model.logits(hidden[0]).float(), -1)
    n_prompt = len(ids) - len(gen.token_ids)
    for pos, c in enumerate(content):
        token = gen.token_ids[pos]
        assert abs(float(logp[n_prompt - 1 + pos, token]) - c.logprob) < 1e-4
    plain = oai.chat.completions.create(model="elesium", messages=messages, max_tokens=6)
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize("extra, name", [
    ({"logit_bias": {"42": 5}}, "logit_bias"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"frequency_penalty": -1}, "frequency_penalty"),
    ({"n": 2}, "n"),
    ({"functions": [WEATHER["function"]]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ({"parallel_tool_calls": True, "tools": [WEATHER]}, "parallel_tool_calls"),
    ({"reasoning_effort": "low"}, "reasoning_effort"),
    ({"store": True}, "store"),
    ({"best_of": 3}, "best_of"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": True, "stream": True}, "stream"),
    ({"tools": [WEATHER], "stream": True}, "stream"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "xml"}}, "response_format"),
])
def test_unsupported_parameters_answer_400_naming_them(api_server, extra, name):
    r = post(api_server, {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], **extra})
    assert r.status_code == 400, r.text
    assert name in r.json()["detail"]


def test_the_openai_client_sees_the_400(oai):
    from openai import BadRequestError

    with pytest.raises(BadRequestError, match="logit_bias") as info:
        oai.chat.completions.create(model="elesium", messages=[{"role": "user", "content": "hi"}],
                                    max_tokens=2, logit_bias={"42": 5})
    assert info.value.param == "logit_bias"


def test_harmless_parameters_are_accepted(api_server):
    r = post(api_server, {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], "user": "u1",
                          "metadata": {"k": "v"}, "n": 1, "presence_penalty": 0, "frequency_penalty": 0,
                          "logit_bias": {}, "store": False, "parallel_tool_calls": False,
                          "response_format": {"type": "text"}, "tool_choice": "none", "stop": ["\n\n"]})
    assert r.status_code == 200, r.text


def test_one_message_for_an_over_long_prompt(api_server, monkeypatch):
    settings = api_server.services.settings
    context = api_server.services.engine.context_length

    def detail(words: int, max_tokens: int = 16) -> str:
        r = post(api_server, {"max_tokens": max_tokens,
                              "messages": [{"role": "user", "content": "word " * words}]})
        assert r.status_code == 400, r.text
        return r.json()["detail"]

    monkeypatch.setattr(settings, "max_prompt_tokens", 40)
    for words in (60, 5_000):  # just over, and past the model's whole context: the same message
        assert "this request allows at most 40: this server's max_prompt_tokens setting" in detail(words)
    monkeypatch.setattr(settings, "max_prompt_tokens", None)
    want = f"allows at most {context - 16:,}: the model's context of {context:,} tokens less max_tokens 16"
    for words in (context - 10, 3 * context):
        assert want in detail(words)
    monkeypatch.setattr(settings, "max_tokens_cap", 8)
    r = post(api_server, {"max_tokens": 9, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "cap of 8" in r.json()["detail"]


def limits(settings) -> tuple:
    return settings.max_prompt_tokens, settings.max_tokens_cap, settings.max_body_bytes


def test_limits_come_from_the_environment_and_serve_flags(monkeypatch):
    from elesium.api.settings import ApiSettings
    from elesium.cli.commands.serve import apply_limit_flags
    from test_settings import subparser

    defaults = ApiSettings.from_env()
    assert limits(defaults) == (None, 1024, 256_000)
    monkeypatch.setenv("ELESIUM_MAX_PROMPT_TOKENS", "3000")
    monkeypatch.setenv("ELESIUM_MAX_TOKENS_CAP", "512")
    monkeypatch.setenv("ELESIUM_MAX_BODY_BYTES", "1000000")
    settings = ApiSettings.from_env()
    assert limits(settings) == (3000, 512, 1_000_000)
    args = subparser("serve").parse_args(["--max-prompt-tokens", "100", "--max-tokens-cap", "64"])
    apply_limit_flags(settings, args)
    assert limits(settings) == (100, 64, 1_000_000)
    monkeypatch.setenv("ELESIUM_MAX_TOKENS_CAP", "0")
    with pytest.raises(ValueError, match="ELESIUM_MAX_TOKENS_CAP"):
        ApiSettings.from_env()
