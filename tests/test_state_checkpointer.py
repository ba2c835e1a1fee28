"""RedisSaver / AsyncRedisSaver: LangGraph conformance, graphs, retention, TTL, cluster safety."""

from __future__ import annotations

import asyncio
import operator
import threading
from collections.abc import AsyncIterator
from typing import Annotated, Any, TypedDict

import pytest
import redis
from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.checkpoint.conformance import checkpointer_test, validate
from langgraph.checkpoint.conformance.report import CapabilityReport
from langgraph.checkpoint.conformance.test_utils import (
    generate_checkpoint,
    generate_config,
    generate_metadata,
)
from langgraph.graph import END, START, StateGraph
from redis.crc import key_slot

from elesium.state import AsyncRedisSaver, RedisSaver, StateError

pytest_plugins = ["state_fixtures"]


def _assert_full(report: CapabilityReport) -> None:
    failures = {cap: res.failures for cap, res in report.results.items() if res.passed is not True}
    assert report.passed_all_base(), failures
    # Every extended capability is implemented, so every one must be detected and pass.
    assert report.passed_all() and all(res.detected for res in report.results.values()), failures


async def test_conformance_sync(redis_url: str, key_prefix: str) -> None:
    """The sync methods, driven through the a* wrappers that run them in a thread."""
    n = 0

    @checkpointer_test(name="RedisSaver")
    async def factory() -> AsyncIterator[BaseCheckpointSaver]:
        nonlocal n
        n += 1
        yield RedisSaver.from_url(redis_url, prefix=f"{key_prefix}:{n}")

    _assert_full(await validate(factory))


async def test_conformance_async(redis_url: str, key_prefix: str) -> None:
    n = 0

    @checkpointer_test(name="AsyncRedisSaver")
    async def factory() -> AsyncIterator[BaseCheckpointSaver]:
        nonlocal n
        n += 1
        saver = AsyncRedisSaver.from_url(redis_url, prefix=f"{key_prefix}:{n}")
        yield saver
        await saver.aclose()

    _assert_full(await validate(factory))


async def test_conformance_on_a_cluster(cluster_url: str, key_prefix: str) -> None:
    """A cluster rejects cross-slot scripts and transactions, so passing here proves the layout."""
    n = 0

    @checkpointer_test(name="AsyncRedisSaver@cluster")
    async def factory() -> AsyncIterator[BaseCheckpointSaver]:
        nonlocal n
        n += 1
        saver = AsyncRedisSaver.from_url(cluster_url, prefix=f"{key_prefix}:{n}")
        yield saver
        await saver.aclose()

    _assert_full(await validate(factory))
    sync = RedisSaver.from_url(cluster_url, prefix=key_prefix)
    stored = sync.put(generate_config("t/{odd}:id"), generate_checkpoint(), generate_metadata(), {})
    assert sync.get_tuple(stored) is not None


class _State(TypedDict):
    count: int
    trail: Annotated[list[str], operator.add]


def _graph(saver: BaseCheckpointSaver) -> Any:
    builder = StateGraph(_State)
    builder.add_node("a", lambda s: {"count": s["count"] + 1, "trail": ["a"]})
    builder.add_node("b", lambda s: {"count": s["count"] * 10, "trail": ["b"]})
    builder.add_edge(START, "a")
    builder.add_edge("a", "b")
    builder.add_edge("b", END)
    return builder.compile(checkpointer=saver)


def test_graph_state_survives_a_new_process_view(redis_url: str, key_prefix: str) -> None:
    """State written by one saver is read back by a fresh one (as after a restart)."""
    config = {"configurable": {"thread_id": "conv-1"}}
    first = _graph(RedisSaver.from_url(redis_url, prefix=key_prefix))
    assert first.invoke({"count": 1, "trail": []}, config) == {"count": 20, "trail": ["a", "b"]}
    second = _graph(RedisSaver.from_url(redis_url, prefix=key_prefix))
    assert second.get_state(config).values == {"count": 20, "trail": ["a", "b"]}
    # Continuing the thread appends to the persisted list rather than starting over.
    assert second.invoke({"count": 2, "trail": []}, config)["trail"] == ["a", "b", "a", "b"]
    history = list(second.get_state_history(config))
    assert [h.metadata["step"] for h in history] == [6, 5, 4, 3, 2, 1, 0, -1]


async def test_async_graph(redis_url: str, key_prefix: str) -> None:
    saver = AsyncRedisSaver.from_url(redis_url, prefix=key_prefix)
    config = {"configurable": {"thread_id": "t"}}
    out = await _graph(saver).ainvoke({"count": 3, "trail": []}, config)
    assert out == {"count": 40, "trail": ["a", "b"]}
    latest = await saver.aget_tuple(config)
    assert latest is not None and latest.checkpoint["channel_values"]["count"] == 40
    await saver.aclose()


def _put_chain(saver: RedisSaver, thread: str, n: int, ns: str = "") -> list[dict]:
    configs, parent = [], generate_config(thread, checkpoint_ns=ns)
    for i in range(n):
        cp = generate_checkpoint(channel_values={"x": f"v{i}", "y": "same"},
                                 channel_versions={"x": str(i + 1), "y": "1"})
        parent = saver.put(parent, cp, generate_metadata(step=i),
                           {"x": str(i + 1), "y": "1"} if i == 0 else {"x": str(i + 1)})
        configs.append(parent)
    return configs


def test_keep_last_trims_checkpoints_writes_and_orphan_blobs(redis_url: str, key_prefix: str,
                                                             raw_client: redis.Redis) -> None:
    saver = RedisSaver.from_url(redis_url, prefix=key_prefix, keep_last=3)
    first = _put_chain(saver, "t", 1)[0]
    saver.put_writes(first, [("x", "old")], "task")  # writes of a checkpoint that retention drops
    assert raw_client.exists(f"{key_prefix}:{{t}}:w::{first['configurable']['checkpoint_id']}") == 1
    chain = _put_chain(saver, "t", 6)
    extra = _put_chain(saver, "t", 1)[0]  # a second root: retention counts it all the same
    kept = [t.config["configurable"]["checkpoint_id"] for t in saver.list(generate_config("t"))]
    assert kept == [c["configurable"]["checkpoint_id"] for c in (extra, chain[5], chain[4])]
    # Blobs still referenced: x@5, x@6, and x@1 / y@1 (the extra root) - nothing older survives.
    blob_fields = {f.decode() for f in raw_client.hkeys(f"{key_prefix}:{{t}}:b:")}
    assert blob_fields == {"x\x005", "x\x006", "x\x001", "y\x001"}
    assert raw_client.exists(f"{key_prefix}:{{t}}:w::{first['configurable']['checkpoint_id']}") == 0
    # The survivors still load their full state, including the y blob written by chain[0].
    assert saver.get_tuple(chain[5]).checkpoint["channel_values"] == {"x": "v5", "y": "same"}


def test_ttl_applies_to_every_key_of_the_thread(redis_url: str, key_prefix: str,
                                                raw_client: redis.Redis) -> None:
    saver = RedisSaver.from_url(redis_url, prefix=key_prefix, ttl_s=120)
    configs = _put_chain(saver, "t", 2)
    saver.put_writes(configs[-1], [("x", 1)], "task")
    keys = list(raw_client.scan_iter(match=f"{key_prefix}:*"))
    assert len(keys) == 6  # nss, idx, blobs, 2 checkpoints, 1 writes hash
    ttls = [raw_client.ttl(k) for k in keys]
    assert all(0 < ttl <= 120 for ttl in ttls), ttls


def test_all_keys_of_a_thread_share_one_slot(redis_url: str, key_prefix: str,
                                             raw_client: redis.Redis) -> None:
    saver = RedisSaver.from_url(redis_url, prefix=key_prefix)
    for thread in ("plain", "with}brace{and:colon", ""):
        for ns in ("", "child:1|grand:2"):
            config = {"configurable": {"thread_id": thread, "checkpoint_ns": ns}}
            stored = saver.put(config, generate_checkpoint(channel_values={"x": 1}), generate_metadata(),
                               {"x": "1"})
            saver.put_writes(stored, [("x", 1)], "task")
    slots: dict[str, set[int]] = {}
    for key in raw_client.scan_iter(match=f"{key_prefix}:*"):
        tag = key.decode().split("{", 1)[1].split("}", 1)[0]
        slots.setdefault(tag, set()).add(key_slot(key))
    assert len(slots) == 3 and all(len(s) == 1 for s in slots.values()), slots
    threads = {t.config["configurable"]["thread_id"] for t in saver.list(None)}
    assert threads == {"plain", "with}brace{and:colon", ""}


def test_list_everything_and_namespace_default(redis_url: str, key_prefix: str) -> None:
    saver = RedisSaver.from_url(redis_url, prefix=key_prefix)
    _put_chain(saver, "t1", 2)
    _put_chain(saver, "t1", 1, ns="child:1")
    _put_chain(saver, "t2", 3)
    assert len(list(saver.list(None))) == 6
    assert len(list(saver.list(None, limit=4))) == 4
    assert len(list(saver.list({"configurable": {"thread_id": "t1"}}))) == 3  # every namespace
    assert [t.metadata["step"] for t in saver.list(None, filter={"step": 2})] == [2]


async def test_async_saver_sync_methods_need_another_thread(redis_url: str, key_prefix: str) -> None:
    saver = AsyncRedisSaver.from_url(redis_url, prefix=key_prefix)
    stored = await saver.aput(generate_config("t"), generate_checkpoint(), generate_metadata(), {})
    with pytest.raises(StateError, match="own event loop"):
        saver.get_tuple(stored)
    result: list[Any] = []
    worker = threading.Thread(target=lambda: result.append(saver.get_tuple(stored)))
    worker.start()
    while worker.is_alive():
        await asyncio.sleep(0.01)
    assert result[0].checkpoint["id"] == stored["configurable"]["checkpoint_id"]
    await saver.aclose()

