"""REDIS_URL handling and the three operator-facing failures: bad URL, no server, WRONGTYPE."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest
import redis
from langgraph.checkpoint.conformance.test_utils import (
    generate_checkpoint,
    generate_config,
    generate_metadata,
)

from elesium.config import Settings
from elesium.inference.records import StepRecord
from elesium.state import (
    AcceptanceEntry,
    AcceptanceLog,
    AsyncRedisSaver,
    RedisSaver,
    RedisUnavailableError,
    RedisURLError,
    RunRecord,
    RunRegistry,
    WrongTypeError,
    default_url,
    parse_redis_url,
)

pytest_plugins = ["state_fixtures"]


@pytest.mark.parametrize(
    ("url", "kind", "client_url"),
    [
        ("redis://localhost:6379/2", "tcp", "redis://localhost:6379/2"),
        ("rediss://user:pw@cache.example:6380", "tls", "rediss://user:pw@cache.example:6380"),
        ("unix:///run/redis/redis.sock?db=1", "unix", "unix:///run/redis/redis.sock?db=1"),
        ("redis+cluster://10.0.0.1:7000", "cluster", "redis://10.0.0.1:7000"),
        ("rediss+cluster://u:p@node:7000/0", "cluster", "rediss://u:p@node:7000/0"),
    ],
)
def test_accepted_urls(url: str, kind: str, client_url: str) -> None:
    target = parse_redis_url(url)
    assert (target.kind, target.client_url) == (kind, client_url)
    assert "pw" not in target.display and (":p@" not in target.display)


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("", "empty"),
        ("http://localhost:6379", "Unsupported Redis URL scheme 'http'"),
        ("redis://:6379", "no host"),
        ("redis://localhost:notaport", "port"),
        ("redis://localhost:6379/abc", "database"),
        ("unix://relative.sock", "absolute socket path"),
        ("redis+cluster://node:7000/3", "only has database 0"),
    ],
)
def test_bad_urls_say_what_is_wrong(url: str, says: str) -> None:
    with pytest.raises(RedisURLError, match=says):
        RedisSaver.from_url(url) if url else parse_redis_url(url)


def test_bad_url_masks_the_password() -> None:
    with pytest.raises(RedisURLError) as info:
        parse_redis_url("redis://user:s3cret@host:99999")
    assert "s3cret" not in str(info.value) and "***" in str(info.value)


def _closed_port() -> int:
    from state_fixtures import free_port

    return free_port()


@pytest.mark.parametrize("kind", ["tcp", "unix"])
def test_unreachable_server_fails_fast_and_clearly(kind: str, tmp_path: Path) -> None:
    url = f"redis://127.0.0.1:{_closed_port()}" if kind == "tcp" else f"unix://{tmp_path}/nothing.sock"
    start = time.monotonic()
    with pytest.raises(RedisUnavailableError, match="Cannot reach the Redis server") as info:
        RedisSaver.from_url(url)
    assert time.monotonic() - start < 3.0
    assert "REDIS_URL" in str(info.value)


@pytest.mark.parametrize(("reply", "says"),
                         [(None, "Cannot reach"),
                          (b"HTTP/1.1 400 Bad Request\r\n\r\n", "not in the Redis protocol")])
def test_silent_or_foreign_server_fails_fast(reply: bytes | None, says: str) -> None:
    """A port that accepts but never answers (or answers HTTP) must not stall start-up."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]

    def serve() -> None:
        conn, _ = listener.accept()
        conn.recv(1024)
        if reply:
            conn.sendall(reply)
        time.sleep(5)
        conn.close()

    threading.Thread(target=serve, daemon=True).start()
    start = time.monotonic()
    try:
        with pytest.raises(RedisUnavailableError, match=says):
            RedisSaver.from_url(f"redis://127.0.0.1:{port}")
        assert time.monotonic() - start < 3.5
    finally:
        listener.close()


async def test_async_unreachable_server_fails_on_first_call() -> None:
    saver = AsyncRedisSaver.from_url(f"redis://127.0.0.1:{_closed_port()}")
    start = time.monotonic()
    with pytest.raises(RedisUnavailableError, match="Cannot reach"):
        await saver.aget_tuple(generate_config("t"))
    assert time.monotonic() - start < 3.0


def test_wrongtype_in_checkpoint_keys(redis_url: str, key_prefix: str, raw_client: redis.Redis) -> None:
    raw_client.set(f"{key_prefix}:{{t}}:nss", "someone else's string")
    saver = RedisSaver.from_url(redis_url, prefix=key_prefix)
    start = time.monotonic()
    with pytest.raises(WrongTypeError, match="WRONGTYPE") as info:
        saver.put(generate_config("t"), generate_checkpoint(), generate_metadata(), {})
    assert time.monotonic() - start < 1.0
    message = str(info.value)
    assert f"{key_prefix}:{{t}}:" in message and "prefix" in message
    # Reads of the same thread are refused the same way rather than returning garbage.
    raw_client.delete(f"{key_prefix}:{{t}}:nss")
    raw_client.set(f"{key_prefix}:{{t}}:i:", "x")
    with pytest.raises(WrongTypeError):
        saver.get_tuple(generate_config("t"))


async def test_wrongtype_async(redis_url: str, key_prefix: str, raw_client: redis.Redis) -> None:
    raw_client.set(f"{key_prefix}:{{t}}:i:", "x")
    saver = AsyncRedisSaver.from_url(redis_url, prefix=key_prefix)
    with pytest.raises(WrongTypeError):
        _ = [t async for t in saver.alist(generate_config("t"))]
    await saver.aclose()


def test_wrongtype_in_log_and_registry(redis_url: str, key_prefix: str, raw_client: redis.Redis) -> None:
    log = AcceptanceLog.from_url(redis_url, prefix=f"{key_prefix}:acc")
    raw_client.hset(log.key("run-1"), "not", "a stream")
    record = StepRecord(step=0, mode="vanilla", tree_size=1, tree_depth=0, accepted_length=1,
                        accepted_nodes=(0,), tokens=(7,))
    with pytest.raises(WrongTypeError, match="acceptance stream"):
        log.append(AcceptanceEntry(run_id="run-1", node_id="n", step_id=0, record=record))
    registry = RunRegistry.from_url(redis_url, prefix=f"{key_prefix}:runs")
    raw_client.set(f"{key_prefix}:runs:{{registry}}:tenant:acme", "x")
    with pytest.raises(WrongTypeError, match="run registry"):
        registry.create(RunRecord(run_id="r", workflow="w", workflow_version="1", input_hash="h",
                                  tenant="acme"))


def test_default_url_prefers_redis_url_and_otherwise_starts_embedded(tmp_path: Path) -> None:
    assert default_url(Settings(redis_url="redis://example:6379/0")) == "redis://example:6379/0"
    url = default_url(Settings(data_dir=tmp_path))
    try:
        assert url == f"unix://{tmp_path.resolve()}/valkey/valkey.sock"
        assert redis.Redis.from_url(url).ping()
        assert default_url(Settings(data_dir=tmp_path)) == url  # same process: same server
    finally:
        from elesium.state.embedded import shared_server

        shared_server(tmp_path).stop()
