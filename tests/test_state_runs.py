"""RunRegistry: create / get / status lifecycle / indexes by tenant and status."""

from __future__ import annotations

import threading
from datetime import datetime, timedelta, timezone

import pytest

from elesium.state import (
    InvalidTransitionError,
    RunExistsError,
    RunNotFoundError,
    RunRecord,
    RunRegistry,
    RunStatus,
    hash_input,
)

pytest_plugins = ["state_fixtures"]

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


@pytest.fixture
def registry(redis_url: str, key_prefix: str) -> RunRegistry:
    return RunRegistry.from_url(redis_url, prefix=key_prefix)


def _run(run_id: str, tenant: str = "acme", minutes: int = 0) -> RunRecord:
    at = T0 + timedelta(minutes=minutes)
    return RunRecord(run_id=run_id, workflow="triage", workflow_version="3",
                     input_hash=hash_input({"q": run_id}),
                     seeds={"sampling": 7, "draft": 11}, tenant=tenant, created_at=at, updated_at=at)


def test_create_and_get_round_trip(registry: RunRegistry) -> None:
    record = _run("r/1:{x}")
    registry.create(record)
    assert registry.get("r/1:{x}") == record
    assert registry.get("missing") is None
    with pytest.raises(RunExistsError, match="already registered"):
        registry.create(record)


def test_lifecycle_moves_run_between_status_indexes(registry: RunRegistry) -> None:
    registry.create(_run("a"))
    running = registry.update_status("a", RunStatus.RUNNING)
    assert running.status is RunStatus.RUNNING and running.updated_at > T0
    assert [r.run_id for r in registry.list_by_status("pending")] == []
    assert [r.run_id for r in registry.list_by_status("running")] == ["a"]
    failed = registry.update_status("a", "failed", error="tool timeout")
    assert (failed.status, failed.error) == (RunStatus.FAILED, "tool timeout")
    assert registry.get("a") == failed
    assert [r.run_id for r in registry.list_by_status(RunStatus.FAILED)] == ["a"]
    assert registry.list_by_status(RunStatus.RUNNING) == []


@pytest.mark.parametrize(
    ("path", "bad"),
    [((), RunStatus.SUCCEEDED), ((RunStatus.RUNNING, RunStatus.SUCCEEDED), RunStatus.RUNNING),
     ((RunStatus.CANCELLED,), RunStatus.FAILED), ((), RunStatus.PENDING)],
)
def test_forbidden_transitions(registry: RunRegistry, path: tuple[RunStatus, ...], bad: RunStatus) -> None:
    registry.create(_run("a"))
    for status in path:
        registry.update_status("a", status)
    before = registry.get("a")
    with pytest.raises(InvalidTransitionError, match=f"cannot become {bad.value}"):
        registry.update_status("a", bad)
    assert registry.get("a") == before  # nothing half-applied


def test_unknown_run(registry: RunRegistry) -> None:
    with pytest.raises(RunNotFoundError, match="create"):
        registry.update_status("ghost", RunStatus.RUNNING)
    with pytest.raises(ValueError):
        registry.update_status("ghost", "exploded")


def test_lists_by_tenant_newest_first_with_paging(registry: RunRegistry) -> None:
    for i in range(5):
        registry.create(_run(f"acme-{i}", minutes=i))
    registry.create(_run("other-0", tenant="globex"))
    assert [r.run_id for r in registry.list_by_tenant("acme")] == [f"acme-{i}" for i in (4, 3, 2, 1, 0)]
    assert [r.run_id for r in registry.list_by_tenant("acme", limit=2, offset=1)] == ["acme-3", "acme-2"]
    assert [r.run_id for r in registry.list_by_tenant("globex")] == ["other-0"]
    assert registry.list_by_tenant("nobody") == [] and registry.list_by_tenant("acme", limit=0) == []


def test_concurrent_transitions_let_exactly_one_win(registry: RunRegistry) -> None:
    registry.create(_run("race"))
    registry.update_status("race", RunStatus.RUNNING)
    outcomes: list[str] = []
    barrier = threading.Barrier(8)

    def finish(status: RunStatus) -> None:
        barrier.wait()
        try:
            registry.update_status("race", status)
            outcomes.append(status.value)
        except InvalidTransitionError:
            outcomes.append("refused")

    threads = [threading.Thread(target=finish,
                                args=(s,)) for s in [RunStatus.SUCCEEDED, RunStatus.FAILED] * 4]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [o for o in outcomes if o != "refused"]
    assert len(winners) == 1
    final = registry.get("race")
    assert final is not None and final.status.value == winners[0]
    in_indexes = [s for s in RunStatus if any(r.run_id == "race" for r in registry.list_by_status(s))]
    assert [s.value for s in in_indexes] == winners


def test_hash_input_is_canonical() -> None:
    assert hash_input({"a": 1, "b": [1, 2]}) == hash_input({"b": [1, 2], "a": 1})
    assert hash_input({"a": 1}) != hash_input({"a": 2})
