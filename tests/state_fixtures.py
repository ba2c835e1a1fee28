"""Fixtures of the state-layer tests: real servers, never fakes.

A session-wide embedded Valkey (the production default) backs every test. When
``ELESIUM_TEST_REDIS_URL`` is set (CI points it at Debian's redis-server), the checkpointer, log
and registry tests run against that server too, through the ``redis_url`` parameter. Each test
gets its own key prefix, so tests never see each other's data and no FLUSHDB is needed on a
server that might be shared.

Loaded by the state test modules with ``pytest_plugins = ["state_fixtures"]``.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator

import pytest
import redis

from elesium.state.embedded import EmbeddedValkey, server_binary

BACKENDS = ["embedded", "external"]


@pytest.fixture(scope="session")
def state_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedValkey]:
    """One embedded Valkey for the whole session, in a temporary data dir."""
    server = EmbeddedValkey(tmp_path_factory.mktemp("state-valkey")).start()
    yield server
    server.stop()


@pytest.fixture(scope="session", params=BACKENDS)
def redis_url(request: pytest.FixtureRequest, state_server: EmbeddedValkey) -> str:
    """The embedded server's URL, then ``ELESIUM_TEST_REDIS_URL``'s: without it the second Redis
    implementation is skipped with its reason printed (``-ra``), not left out silently."""
    if request.param == "embedded":
        return state_server.url
    url = os.environ.get("ELESIUM_TEST_REDIS_URL")
    if not url:
        pytest.skip("ELESIUM_TEST_REDIS_URL is not set: the second Redis implementation (.ci/run installs "
                    "Debian's redis-server for it) is not tested in this run")
    return url


@pytest.fixture
def key_prefix() -> str:
    """A key root no other test uses."""
    return f"test:{uuid.uuid4().hex[:12]}"


@pytest.fixture
def raw_client(redis_url: str) -> Iterator[redis.Redis]:
    """A plain client on the same server, to inspect or sabotage keys directly."""
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture(scope="session")
def cluster_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A one-node Redis Cluster (all 16384 slots on one valkey-server).

    One node suffices to prove cluster safety: the server still rejects any command or script
    whose keys span two slots (CROSSSLOT), which is the property the key layout must respect.
    """
    data = tmp_path_factory.mktemp("state-cluster")
    port = free_port()
    conf = data / "valkey.conf"
    conf.write_text(
        # The bus port defaults to port + 10000, which overflows for ports above 55535.
        f"port {port}\ncluster-port {free_port()}\nbind 127.0.0.1\ncluster-enabled yes\n"
        "cluster-config-file nodes.conf\n"
        f'dir "{data}"\nsave ""\nappendonly no\n'
    )
    with open(data / "valkey.log", "ab") as log:
        proc = subprocess.Popen([str(server_binary()), str(conf)], cwd=data, stdout=log,
                                stderr=subprocess.STDOUT)
        try:
            client = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.5)
            deadline = time.monotonic() + 10
            while True:
                try:
                    client.ping()
                    break
                except redis.exceptions.ConnectionError:
                    if proc.poll() is not None:
                        raise RuntimeError(f"the cluster node exited: {(data / 'valkey.log').read_text()}")
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.02)
            client.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
            while b"cluster_state:ok" not in client.execute_command("CLUSTER", "INFO"):
                if time.monotonic() > deadline:
                    raise RuntimeError("the one-node cluster did not reach cluster_state:ok")
                time.sleep(0.05)
            client.close()
            yield f"redis+cluster://127.0.0.1:{port}"
        finally:
            proc.terminate()
            proc.wait(timeout=10)


def free_port() -> int:
    """A free loopback TCP port (released before use; good enough for tests)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for_exit(pid: int, timeout_s: float = 5.0) -> bool:
    """Whether process ``pid`` is gone within ``timeout_s`` (reaping it if it is our child)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done == pid:
                return True
        except ChildProcessError:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
        time.sleep(0.02)
    return False
