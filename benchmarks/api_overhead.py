"""API overhead per run and time to first streamed token: the server against the same work in-process.

Usage: .venv/bin/python benchmarks/api_overhead.py [--runs N] [--out DIR]

One tiny workflow (one LLM node, 16 greedy tokens, vanilla decoding) runs N times in-process (the
compiled graph on the Redis checkpointer, as the server drives it) and N times through the server
(``runs.wait`` with langgraph-sdk over loopback HTTP): the difference of the medians is what the API
adds per run (HTTP, auth, validation, run records, the engine thread hand-off). Time to first token
is measured three ways: the engine's first chunk in-process, the first ``messages`` SSE event of a
``runs.stream``, and the first content chunk of a streamed ``/v1/chat/completions``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from langgraph.graph import END, START, StateGraph
from pydantic import BaseModel

from elesium.graphs.llm import WorkflowState, llm_node
from elesium.graphs.registry import Registry, Workflow

PROMPT = "Say one short sentence about {topic}."


class In(BaseModel):
    topic: str


class State(WorkflowState, total=False):
    topic: str
    out: str


def factory() -> StateGraph:
    b = StateGraph(State)
    b.add_node(llm_node("say", prompt=PROMPT, output_key="out", params={"max_tokens": 16}, mode="vanilla"))
    b.add_edge(START, "say")
    b.add_edge("say", END)
    return b


def rule_factory() -> StateGraph:
    """No LLM: what the API adds per run, without the engine's (noisy, shared-CPU) time in it."""
    b = StateGraph(State)
    b.add_node("echo", lambda state: {"out": state["topic"].upper()})
    b.add_edge(START, "echo")
    b.add_edge("echo", END)
    return b


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--out", default="benchmarks/cpu-2026-11-30-api")
    args = ap.parse_args()

    import httpx
    from langgraph_sdk import get_sync_client

    from elesium.api.app import create_app
    from elesium.api.server import BackgroundServer
    from elesium.api.settings import ApiSettings
    from elesium.api.worker import EngineWorker
    from elesium.graphs.execution import RunEngine, drive, run_config
    from elesium.inference.engine import Engine
    from elesium.inference.sampling import SamplingParams
    from elesium.state import RedisSaver
    from elesium.state.embedded import EmbeddedValkey

    wf = Workflow.define("bench-say", factory, In, description="one 16-token LLM call")
    rule = Workflow.define("bench-rule", rule_factory, In, description="one rule node, no LLM")
    registry = Registry()
    registry.register(wf)
    registry.register(rule)
    engine = Engine.load(device="cpu", dtype="float32", max_len=2048)
    data = tempfile.mkdtemp()
    valkey = EmbeddedValkey(Path(data)).start()
    try:
        saver = RedisSaver.from_url(valkey.url)
        graph = wf.build(saver)
        # In-process work runs on its own thread, as the server's does: under CPU oversubscription torch
        # on the main thread was 4x slower than on a secondary thread here (OpenMP team spin-waits), which
        # would flatter the server.
        worker = EngineWorker("bench-in-process")
        worker.submit(
            lambda: engine.generate("warm up", SamplingParams(max_tokens=4), mode="vanilla")
        ).result()

        def in_process_run(i: int) -> float:
            tid = f"bench-{i}-{time.time_ns()}"
            config = run_config(RunEngine(engine), run_id=tid, thread_id=tid, seed=1, tenant="bench",
                                workflow=wf.name)
            t0 = time.perf_counter()
            drive(graph, {"topic": "rivers"}, config)
            return time.perf_counter() - t0

        def engine_ttft() -> float:
            t0 = time.perf_counter()
            stream = engine.stream(
                PROMPT.format(topic="rivers"), SamplingParams(max_tokens=16), mode="vanilla"
            )
            next(iter(stream))
            elapsed = time.perf_counter() - t0
            stream.close()
            return elapsed

        key = "bench-key"
        app = create_app(
            ApiSettings(api_keys={key: "bench"}, redis_url=valkey.url), engine=engine, registry=registry
        )
        in_process, ttft_engine, over_http, ttft_run, ttft_chat = [], [], [], [], []
        rule_in_process, rule_over_http = [], []
        rule_graph = rule.build(saver)
        with BackgroundServer(app) as url:
            client = get_sync_client(url=url, api_key=key)
            http = httpx.Client(base_url=url, headers={"x-api-key": key}, timeout=120)
            for i in range(args.runs * 5):
                tid = f"rule-{i}-{time.time_ns()}"
                config = run_config(RunEngine(engine), run_id=tid, thread_id=tid, seed=1, tenant="bench",
                                    workflow=rule.name)
                t0 = time.perf_counter()
                worker.submit(
                    lambda config=config: drive(rule_graph, {"topic": "rivers"}, config)
                ).result()
                rule_in_process.append(time.perf_counter() - t0)
                tid = client.threads.create()["thread_id"]
                t0 = time.perf_counter()
                client.runs.wait(tid, "bench-rule", input={"topic": "rivers"})
                rule_over_http.append(time.perf_counter() - t0)
            for i in range(args.runs):  # alternating, so load changes hit both sides alike
                in_process.append(worker.submit(lambda i=i: in_process_run(i)).result())
                ttft_engine.append(worker.submit(engine_ttft).result())
                tid = client.threads.create()["thread_id"]
                t0 = time.perf_counter()
                client.runs.wait(
                    tid, "bench-say", input={"topic": "rivers"}, config={"configurable": {"run_seed": 1}}
                )
                over_http.append(time.perf_counter() - t0)
                tid = client.threads.create()["thread_id"]
                t0 = time.perf_counter()
                for part in client.runs.stream(
                    tid,
                    "bench-say",
                    input={"topic": "rivers"},
                    stream_mode="messages-tuple",
                    on_disconnect="continue",
                ):
                    if part.event == "messages":
                        ttft_run.append(time.perf_counter() - t0)
                        break
                client.runs.join(tid, client.runs.list(tid)[0]["run_id"])
                body = {
                    "model": "elesium",
                    "stream": True,
                    "max_tokens": 16,
                    "mode": "vanilla",
                    "messages": [{"role": "user", "content": PROMPT.format(topic="rivers")}],
                }
                t0 = time.perf_counter()
                with http.stream("POST", "/v1/chat/completions", json=body) as r:
                    for line in r.iter_lines():
                        if '"content": "' in line and '"content": ""' not in line:
                            ttft_chat.append(time.perf_counter() - t0)
                            break
                time.sleep(0.5)  # let the abandoned stream's cancel land before the next measurement
            http.close()
        worker.stop()
    finally:
        valkey.stop()

    def ms(xs: list[float]) -> float:
        return round(statistics.median(xs) * 1000, 1)

    result = {
        "runs": args.runs,
        "workflow": "1 LLM node, 16 greedy tokens, vanilla",
        "rule_runs": len(rule_in_process),
        "rule_in_process_ms": ms(rule_in_process),
        "rule_over_http_ms": ms(rule_over_http),
        "rule_api_overhead_ms": round(ms(rule_over_http) - ms(rule_in_process), 1),
        "run_in_process_ms": ms(in_process),
        "run_over_http_ms": ms(over_http),
        "api_overhead_ms": round(ms(over_http) - ms(in_process), 1),
        "ttft_engine_ms": ms(ttft_engine),
        "ttft_runs_stream_ms": ms(ttft_run),
        "ttft_chat_stream_ms": ms(ttft_chat),
        "raw_s": {
            "rule_in_process": rule_in_process,
            "rule_over_http": rule_over_http,
            "in_process": in_process,
            "over_http": over_http,
            "ttft_engine": ttft_engine,
            "ttft_run": ttft_run,
            "ttft_chat": ttft_chat,
        },
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "api_overhead.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "raw_s"}, indent=1))


if __name__ == "__main__":
    main()
