"""Runs' stream events read for many runs at once (``RunEvents.read_many``), on real servers: a plain
Redis/Valkey and a 3-master cluster whose runs' keys live on different nodes."""

from __future__ import annotations

import uuid
from typing import Any

from elesium.state.connection import connect
from elesium.state.run_events import END, RunEvents

pytest_plugins = ["state_fixtures", "cluster_fixtures"]


def _check_read_many(client: Any) -> None:
    events = RunEvents(client, prefix=f"test-ev:{uuid.uuid4().hex[:8]}")
    runs = [(f"thread-{i}", f"run-{i}") for i in range(12)]
    for i, (thread, run) in enumerate(runs):
        for k in range(i % 4):  # 0 to 3 events each; some runs have none yet
            events.publish(thread, run, "values", {"i": i, "k": k})
        if i % 3 == 0:
            events.end(thread, run)
    follows = [(thread, run, "0") for thread, run in runs]
    got = events.read_many(follows)
    assert got == [events.read(thread, run) for thread, run in runs]
    assert [len(rows) for rows in got] == [i % 4 + (i % 3 == 0) for i in range(len(runs))]
    assert got[3][-1][1] == END and got[3][0][2] == {"i": 3, "k": 0}

    # From each run's last id on: only what came after it, whatever its neighbours hold.
    lasts = [rows[-1][0] if rows else "0" for rows in got]
    events.publish(*runs[1], "values", {"late": True})
    again = events.read_many([(thread, run, last) for (thread, run), last in zip(runs, lasts, strict=True)])
    assert [[data for _, _, data in rows] for rows in again] == [
        [{"late": True}] if i == 1 else [] for i in range(len(runs))]
    assert events.read_many([]) == []


def test_read_many_equals_one_read_per_run(redis_url: str) -> None:
    _check_read_many(connect(redis_url))


def test_read_many_on_a_cluster(local_cluster: Any) -> None:
    client = connect(local_cluster.url)
    events = RunEvents(client)
    owners = {client.get_node_from_key(events.key(f"thread-{i}", f"run-{i}")).port for i in range(12)}
    assert len(owners) > 1, "the runs' keys should spread over several masters"
    _check_read_many(client)
