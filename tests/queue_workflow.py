"""A small deterministic workflow for the queue's crash tests, and its worker executor factory.

Four nodes, two of them LLM calls on the real engine (seeded sampling, a few tokens each), so a
run is a handful of checkpoints and a dozen acceptance entries. The LLM nodes write each decode
step to the acceptance log as it happens (not at the end of the call), so a worker killed mid-call
leaves partial entries: the recovery path under test (``begin_call`` deletes them before the call is
re-run). ``ELESIUM_TEST_STEP_DELAY`` (seconds, in the worker's environment) slows each step down so that a
kill lands mid-call without changing anything the run records.

Used in-process by the tests and by worker subprocesses:
``elesium worker --executor queue_workflow:make_executor`` with ``tests/`` on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from typing import Any, TypedDict

from langchain_core.runnables import RunnableConfig
from langgraph.graph import END, START, StateGraph

from elesium.graphs.background import GraphExecutor
from elesium.inference.sampling import SamplingParams
from elesium.state.acceptance_log import AcceptanceEntry, Retention
from elesium.state.fenced import FencedSaver
from elesium.state.queue import Lease, RunQueue

TOPICS = ["a fruit", "a colour", "a planet", "an animal", "a river", "a city", "a tool", "a song"]
MAX_TOKENS = 8


class State(TypedDict, total=False):
    topic: str
    seed: int
    prompt: str
    draft: str
    draft_ids: list[int]
    refine: str
    refine_ids: list[int]
    steps: int
    summary: str


def call_seed(run_seed: int, node: str) -> int:
    """Per-call seed from (run seed, node): node-local, so a resumed run draws the same numbers."""
    return int.from_bytes(hashlib.sha256(f"{run_seed}:{node}".encode()).digest()[:7], "big")


def run_input(i: int) -> dict[str, Any]:
    return {"topic": TOPICS[i % len(TOPICS)], "seed": 1000 + i}


def _llm(name: str, prompt_of: Any, out: str, engine: Any) -> Any:
    def node(state: State, config: RunnableConfig) -> dict[str, Any]:
        lease: Lease = config["configurable"]["lease"]
        run_id = config["configurable"]["run_id"]
        log = lease.acceptance_log(prefix=config["configurable"]["acc_prefix"],
                                   retention=Retention(maxlen=None))
        log.begin_call(run_id, name, 0)  # drop what a crashed attempt wrote for this call
        seed = call_seed(state["seed"], name)
        base = state.get("steps", 0)
        count = [0]
        delay = float(os.environ.get("ELESIUM_TEST_STEP_DELAY", "0"))

        def on_step(record: Any) -> None:
            log.append(AcceptanceEntry(run_id=run_id, node_id=name, step_id=base + count[0], record=record,
                                       call_index=0, call_seed=seed))
            count[0] += 1
            if delay:
                time.sleep(delay)

        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=seed)
        stream = engine.stream(prompt_of(state), params, on_step=on_step)
        # A cancel, a timeout or a lost lease closes the stream from the worker's heartbeat thread:
        # the engine stops after its current step and is free at once.
        unregister = lease.on_abort(stream.close)
        try:
            for _chunk in stream:
                pass
        finally:
            unregister()
        lease.check()  # a closed stream's partial output must never reach the checkpoint
        gen = stream.result
        return {out: gen.text, f"{out}_ids": list(gen.token_ids), "steps": base + count[0]}

    return node


def build(saver: Any, engine: Any) -> Any:
    """The compiled graph: prepare -> draft (LLM) -> refine (LLM) -> finish."""
    g = StateGraph(State)
    g.add_node("prepare", lambda s: {"prompt": f"Name {s['topic']} in one word.", "steps": 0})
    g.add_node("draft", _llm("draft", lambda s: s["prompt"], "draft", engine))
    g.add_node("refine", _llm("refine", lambda s: f"Describe {s['draft'].strip() or s['topic']} briefly.",
                              "refine", engine))
    g.add_node("finish", lambda s: {"summary": f"{s['topic']}|{len(s['draft_ids'])}|{len(s['refine_ids'])}"})
    g.add_edge(START, "prepare")
    g.add_edge("prepare", "draft")
    g.add_edge("draft", "refine")
    g.add_edge("refine", "finish")
    g.add_edge("finish", END)
    return g.compile(checkpointer=saver)


class AckRecordingSaver(FencedSaver):
    """Appends "thread checkpoint-id step" to a file after each acknowledged checkpoint write, so a
    test can check that Redis still has every checkpoint it acknowledged after a crash."""

    def __init__(self, *args: Any, ack_log: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ack_log = ack_log

    def put(self, config: Any, checkpoint: Any, metadata: Any, new_versions: Any) -> Any:
        out = super().put(config, checkpoint, metadata, new_versions)
        with open(self.ack_log, "a") as f:
            f.write(f"{config['configurable']['thread_id']} {checkpoint['id']} {metadata.get('step')}\n")
        return out


def executor(engine: Any, root: str) -> GraphExecutor:
    """Checkpoints under ``<root>:cp``, acceptance streams under ``<root>:acc``."""
    ack_log = os.environ.get("ELESIUM_TEST_ACK_LOG")

    def make_graph(lease: Lease, saver: Any) -> Any:
        if ack_log:
            saver = AckRecordingSaver(lease.queue.client, fence_key=lease.keys.fence, token=lease.token,
                                      prefix=f"{root}:cp", ack_log=ack_log)
        return build(saver, engine)

    return GraphExecutor(
        make_graph,
        config=lambda lease: {"configurable": {"thread_id": lease.thread_id, "run_id": lease.run_id,
                                               "lease": lease, "acc_prefix": f"{root}:acc"}},
        saver_options={"prefix": f"{root}:cp"},
    )


def engine_key(root: str, worker_id: str) -> str:
    return f"{root}:engine:{worker_id}"


def make_executor(args: argparse.Namespace, queue: RunQueue) -> GraphExecutor:
    """``elesium worker --executor queue_workflow:make_executor``: the real engine, loaded as the
    tests' ``engine`` fixture loads it; state under the queue's prefix. The engine's fingerprint is
    published so a test can tell "another engine" apart from "recovery changed the run"."""
    from elesium.inference.engine import Engine

    engine = Engine.load(device="cpu", dtype="float32", max_len=2048)
    queue.client.set(engine_key(queue.prefix, args.worker_id or "?"), json.dumps(engine.fingerprint()))
    return executor(engine, queue.prefix)
