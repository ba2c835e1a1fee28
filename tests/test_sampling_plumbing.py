"""Sampling settings reach the decoder through every entry point (issue 41, item 1).

"Same seed, same output" cannot tell a route that dropped temperature, top-p or top-k (or went greedy)
from one that passed them on. So each entry point here must produce the tokens (or, where it only
returns text, the text) of a direct ``generate(engine, GenerationRequest(prompt, params, mode=mode))``
with the same ``SamplingParams`` and the same decode mode, and the test also shows, on the real model,
that those tokens change when any one setting is dropped (greedy, another seed, top-p 1, top-k 0) and
that the generation ran to ``max_tokens``. A wrapper losing any setting would then fail
the equality.

Like is compared with like: exact speculative sampling has the target distribution but not vanilla's
tokens for a seed, so a speculative entry point is compared with a direct speculative generation.

Entry points: the OpenAI route ``POST /v1/chat/completions`` (plain and streamed), the runs API with a
workflow of two sampling ``llm_node``s (the recorded calls' token ids, at the seeds
``derive_seed(run_seed, node, call_index)``), ``WorkflowRunner``, ``ChatElesium`` (invoke, stream,
bound per-call options) and ``elesium generate`` (``--json`` and plain text).
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pytest
from langgraph.graph import END, START, StateGraph
from pydantic import BaseModel

from api_server import KEY_A, LiveServer, live_server, server_settings
from elesium.graphs.llm import WorkflowState, llm_node
from elesium.graphs.registry import Registry, Workflow
from elesium.graphs.seeds import derive_seed
from elesium.inference.records import Generation
from elesium.inference.sampling import SamplingParams
from elesium.inference.types import GenerationRequest, generate

pytest_plugins = ["state_fixtures", "api_server"]

MODES = ("vanilla", "speculative")

# One user message shared by ChatElesium and the CLI (both send a string through the chat template), so
# their direct references and the sensitivity checks are computed once.
STORY = "Write a long, vivid story about a lighthouse keeper and a storm."
STORY_PARAMS = SamplingParams(temperature=1.1, top_p=0.95, top_k=40, max_tokens=24, seed=2024)

# The OpenAI route has no top_k: temperature, top_p, seed and max_tokens only.
CHAT = [
    {"role": "system", "content": "You are a storyteller who writes long, detailed answers."},
    {"role": "user", "content": "Tell me a long story about a fox who finds a lost key in the forest."},
]
CHAT_PARAMS = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=24, seed=777)

_DIRECT: dict[Any, Generation] = {}


def _prompt_key(prompt: Any) -> Any:
    if isinstance(prompt, str):
        return prompt
    return tuple(tuple(sorted(m.items())) for m in prompt)


def direct(engine: Any, prompt: str | Sequence[Mapping[str, str]], params: SamplingParams,
           mode: str) -> Generation:
    """The reference: the engine itself, called with ``params`` and ``mode`` (memoised per session)."""
    key = (_prompt_key(prompt), params, mode)
    if key not in _DIRECT:
        _DIRECT[key] = generate(engine, GenerationRequest(prompt, params, mode=mode))
    return _DIRECT[key]


def assert_settings_matter(engine: Any, prompt: Any, params: SamplingParams, mode: str) -> Generation:
    """The reference ran to ``max_tokens`` in ``mode``, and dropping any one setting changes its tokens:
    an entry point that equals the reference cannot have dropped one.

    Vanilla checks every setting; speculative (several times slower per token on the CPU) checks greedy
    and another seed, since the entry points pass one ``SamplingParams`` whatever the mode."""
    ref = direct(engine, prompt, params, mode)
    assert ref.mode == mode and ref.seed == params.seed
    assert ref.finish_reason == "length" and len(ref.token_ids) == params.max_tokens, (
        f"the reference stopped early ({ref.finish_reason}, {len(ref.token_ids)} tokens): pick a prompt "
        "that runs to max_tokens, so max_tokens is checked too")
    variants = {"greedy": dataclasses.replace(params, temperature=0.0),
                "another seed": dataclasses.replace(params, seed=params.seed + 1)}
    if mode == "vanilla" and params.top_p < 1.0:
        variants["top_p dropped"] = dataclasses.replace(params, top_p=1.0)
    if mode == "vanilla" and params.top_k:
        variants["top_k dropped"] = dataclasses.replace(params, top_k=0)
    for name, variant in variants.items():
        other = direct(engine, prompt, variant, mode)
        assert other.token_ids != ref.token_ids, f"{mode}: {name} gives the same tokens; pick other settings"
        assert other.text != ref.text, f"{mode}: {name} gives the same text; pick other settings"
    return ref


# ------------------------------------------------------------------------------------------ API server
class TopicIn(BaseModel):
    topic: str


class PlumbState(WorkflowState, total=False):
    topic: str
    outline: str
    text: str


WORKFLOW = "sampling-plumbing"
# Two sampling nodes with different settings: each call must decode with its own node's params.
NODES = (
    ("outline", "Write a long story about {topic}.", "outline",
     SamplingParams(temperature=1.1, top_p=0.95, top_k=40, max_tokens=24)),
    ("expand", "Write a short poem inspired by this: {outline}", "text",
     SamplingParams(temperature=1.0, top_p=0.95, top_k=20, max_tokens=24)),
)


def _plumbing_graph() -> StateGraph:
    builder = StateGraph(PlumbState)
    for name, prompt, key, params in NODES:
        builder.add_node(llm_node(name, prompt=prompt, output_key=key, params=params))
    builder.add_edge(START, NODES[0][0])
    builder.add_edge(NODES[0][0], NODES[1][0])
    builder.add_edge(NODES[1][0], END)
    return builder


def plumbing_registry() -> Registry:
    registry = Registry()
    registry.register(Workflow.define(WORKFLOW, _plumbing_graph, TopicIn,
                                      description="two sampled LLM calls"))
    return registry


@pytest.fixture(scope="module")
def server(engine: Any, state_server: Any) -> Iterator[LiveServer]:
    """A live server on the session's engine with this module's workflow, on a queue of its own (the
    session's other servers must not take these runs)."""
    settings = server_settings(state_server.url, queue_name="sampling-plumbing")
    with live_server(settings, engine, plumbing_registry()) as live:
        yield live


@pytest.fixture(scope="module")
def oai(server: LiveServer) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=f"{server.url}/v1", api_key=KEY_A, max_retries=0)


# ------------------------------------------------------------------------------ 1. chat completions
@pytest.mark.parametrize("mode", MODES)
def test_chat_completions_route_samples_with_the_request_settings(engine: Any, oai: Any, mode: str) -> None:
    p = CHAT_PARAMS
    ref = assert_settings_matter(engine, CHAT, p, mode)
    kwargs = dict(model="elesium", messages=CHAT, temperature=p.temperature, top_p=p.top_p, seed=p.seed,
                  max_tokens=p.max_tokens, extra_body={"mode": mode})
    out = oai.chat.completions.create(**kwargs)
    assert out.choices[0].message.content == ref.text
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == len(ref.token_ids) == p.max_tokens
    assert out.usage.prompt_tokens == len(engine.encode_prompt(CHAT)) == ref.prompt_tokens
    assert out.system_fingerprint == f"seed-{p.seed}"
    if mode != "vanilla":
        return
    # The streamed form builds its request separately (engine.start on the engine thread).
    chunks = list(oai.chat.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text


def test_chat_completions_route_honours_or_refuses_top_k(engine: Any, server: LiveServer) -> None:
    """``top_k`` in the body (the usual extra-body field of OpenAI-compatible servers) must either
    reach the sampler or be refused; a 200 that samples without it is a silently dropped setting."""
    p = dataclasses.replace(CHAT_PARAMS, top_p=1.0, top_k=3)
    with_k = assert_settings_matter(engine, CHAT, p, "vanilla")
    body = {"model": "elesium", "messages": CHAT, "temperature": p.temperature, "top_p": p.top_p,
            "seed": p.seed, "max_tokens": p.max_tokens, "mode": "vanilla", "top_k": p.top_k}
    with server.http(KEY_A) as http:
        r = http.post("/v1/chat/completions", json=body)
    if r.status_code != 200:
        assert 400 <= r.status_code < 500 and "top_k" in r.text, r.text
        return
    text = r.json()["choices"][0]["message"]["content"]
    without_k = direct(engine, CHAT, dataclasses.replace(p, top_k=0), "vanilla")
    assert text == with_k.text, (
        "POST /v1/chat/completions accepted top_k but did not sample with it"
        + (" (its answer is the one without top_k: the field was dropped)" if text == without_k.text else ""))


# ------------------------------------------------------------------------------------- 2. runs API
def _check_run_calls(engine: Any, calls: Sequence[tuple[str, int, int, Sequence[int]]],
                     state: Mapping[str, Any], run_seed: int, mode: str, topic: str) -> None:
    """Each recorded call (node, index, seed, token ids) is the direct generation of its node's prompt
    with its node's params at the derived seed, in ``mode``."""
    assert [(node, index) for node, index, _, _ in calls] == [(name, 0) for name, *_ in NODES]
    values: dict[str, Any] = {"topic": topic}
    for (node, _, seed, token_ids), (name, template, key, params) in zip(calls, NODES, strict=True):
        derived = derive_seed(run_seed, name, 0)
        assert seed == derived, f"{name}: recorded seed {seed}, derived {derived}"
        messages = [{"role": "user", "content": template.format(**values)}]
        ref = assert_settings_matter(engine, messages, dataclasses.replace(params, seed=derived), mode)
        assert list(token_ids) == list(ref.token_ids), f"{name} ({mode}) did not sample with its params"
        assert state[key] == ref.text
        values[key] = ref.text


def _api_run(server: LiveServer, topic: str, run_seed: int, mode: str, *,
             seed_in_body: bool) -> tuple[str, dict[str, Any]]:
    configurable: dict[str, Any] = {"mode": mode}
    body: dict[str, Any] = {"assistant_id": WORKFLOW, "input": {"topic": topic},
                            "config": {"configurable": configurable}}
    if seed_in_body:
        body["seed"] = run_seed
    else:
        configurable["run_seed"] = run_seed
    with server.http(KEY_A) as http:
        tid = http.post("/threads", json={}).json()["thread_id"]
        r = http.post(f"/threads/{tid}/runs/wait", json=body)
        assert r.status_code == 200, r.text
        runs = http.get(f"/threads/{tid}/runs").json()
    assert len(runs) == 1 and runs[0]["status"] == "success", runs
    return runs[0]["run_id"], r.json()


# (mode, run seed, seed given as the body's "seed" or as configurable.run_seed)
RUNS = [("vanilla", 41, True), ("speculative", 42, False)]


@pytest.mark.parametrize("mode, run_seed, seed_in_body", RUNS)
def test_runs_api_llm_nodes_sample_with_their_params(engine: Any, server: LiveServer, mode: str,
                                                     run_seed: int, seed_in_body: bool) -> None:
    topic = "a lighthouse in a storm"
    run_id, state = _api_run(server, topic, run_seed, mode, seed_in_body=seed_in_body)
    from elesium.graphs.execution import prompt_digest

    recorded = server.services.store.calls(run_id)
    assert [c["mode"] for c in recorded] == [mode] * len(NODES)
    for call, (_, template, _, _) in zip(recorded, NODES, strict=True):
        # The node decoded exactly the ids of its rendered prompt as one user message.
        prompt = template.format(**{**state, "topic": topic})
        ids = engine.encode_prompt([{"role": "user", "content": prompt}])
        assert (call["prompt_sha256"], call["prompt_tokens"]) == (prompt_digest(ids), len(ids))
        assert call["finish_reason"] == "length"
    calls = [(c["node"], c["call"], c["seed"], c["token_ids"]) for c in recorded]
    _check_run_calls(engine, calls, state, run_seed, mode, topic)


@pytest.mark.parametrize("mode, run_seed", [RUNS[0][:2]])
def test_workflow_runner_llm_nodes_sample_with_their_params(engine: Any, state_server: Any, mode: str,
                                                            run_seed: int) -> None:
    from elesium.graphs.audit import call_tokens
    from elesium.graphs.runner import WorkflowRunner

    runner = WorkflowRunner(engine, state_server.url, registry=plumbing_registry(), mode=mode,
                            prefix=f"test:{uuid.uuid4().hex[:12]}")
    runner.calibrator.use = runner.calibrator.learn = False  # the engine's own tree policy, as direct calls
    topic = "a lighthouse in a storm"  # the API test's run: the direct references are shared
    result = runner.start(WORKFLOW, {"topic": topic}, seed=run_seed)
    assert result.status == "succeeded", result.error
    assert result.fingerprint["mode"] == mode
    _check_run_calls(engine, call_tokens(runner.log, result.run_id), result.state, run_seed, mode, topic)


# ------------------------------------------------------------------------------------ 3. ChatElesium
@pytest.mark.parametrize("mode", MODES)
def test_chat_elesium_samples_with_its_settings(engine: Any, mode: str) -> None:
    from elesium.graphs.chat_model import ChatElesium

    p = STORY_PARAMS
    ref = assert_settings_matter(engine, [{"role": "user", "content": STORY}], p, mode)
    llm = ChatElesium(engine=engine, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, seed=p.seed,
                      max_tokens=p.max_tokens, mode=mode)
    message = llm.invoke(STORY)
    assert message.content == ref.text
    assert message.usage_metadata["output_tokens"] == len(ref.token_ids)
    assert message.response_metadata["seed"] == p.seed and message.response_metadata["mode"] == mode
    if mode != "vanilla":
        return
    assert "".join(chunk.content for chunk in llm.stream(STORY)) == ref.text
    # The same settings as per-call options over a model built with the defaults (greedy, no top-k/p).
    bound = ChatElesium(engine=engine, max_tokens=p.max_tokens, mode=mode).bind(
        temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, seed=p.seed)
    assert bound.invoke(STORY).content == ref.text


# -------------------------------------------------------------------------------- 4. elesium generate
@pytest.mark.parametrize("mode, as_json", [("vanilla", True), ("speculative", True), ("vanilla", False)])
def test_cli_generate_samples_with_its_flags(engine: Any, capsys: Any, mode: str, as_json: bool) -> None:
    from elesium.cli import main

    p = STORY_PARAMS
    messages = [{"role": "user", "content": STORY}]
    assert engine.encode_prompt(STORY) == engine.encode_prompt(messages)  # the CLI sends the string
    ref = assert_settings_matter(engine, messages, p, mode)
    argv = ["generate", STORY, "--temperature", repr(p.temperature), "--top-p", repr(p.top_p),
            "--top-k", str(p.top_k), "--seed", str(p.seed), "--max-tokens", str(p.max_tokens),
            "--mode", mode, "--device", "cpu", "--dtype", "float32", *(["--json"] if as_json else [])]
    capsys.readouterr()
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, err
    if not as_json:
        assert out == ref.text + "\n"
        return
    data = json.loads(out)
    # The CLI loads its own engine: it must be the fixture's (same model, heads, profile, numerics).
    expected = {k: v for k, v in engine.fingerprint(mode).items() if k != "mode"}
    assert {k: data["engine"].get(k) for k in expected} == expected
    assert data["mode"] == mode and data["seed"] == p.seed
    assert data["token_ids"] == list(ref.token_ids)
    assert data["text"] == ref.text
