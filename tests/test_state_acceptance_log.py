"""AcceptanceLog: append / batch / range reads, retention, and the summary arithmetic."""

from __future__ import annotations

import time

import pytest

from elesium.inference.records import StepRecord
from elesium.state import AcceptanceEntry, AcceptanceLog, LoggedStep, Retention

pytest_plugins = ["state_fixtures"]


def _record(step: int, accepted: tuple[bool, ...], elapsed: float = 0.01) -> StepRecord:
    n = 1 + next((i for i, ok in enumerate(accepted) if not ok), len(accepted))
    return StepRecord(
        step=step, mode="speculative", tree_size=1 + 2 * len(accepted), tree_depth=len(accepted),
        accepted_length=n, accepted_nodes=tuple(range(n)), tokens=tuple(100 + i for i in range(n)),
        accepted_by_depth=accepted, elapsed_s=elapsed,
    )


def _entry(run: str, step_id: int, accepted: tuple[bool, ...], node: str = "draft",
           elapsed: float = 0.01) -> AcceptanceEntry:
    return AcceptanceEntry(run_id=run, node_id=node, step_id=step_id,
                           record=_record(step_id, accepted, elapsed))


@pytest.fixture
def log(redis_url: str, key_prefix: str) -> AcceptanceLog:
    return AcceptanceLog.from_url(redis_url, prefix=key_prefix, retention=Retention(maxlen=None))


def test_round_trip_single_and_batch(log: AcceptanceLog) -> None:
    first = _entry("run", 0, (True, False))
    entry_id = log.append(first)
    ids = log.append_many([_entry("run", 1, (False,)), _entry("other", 0, ()),
                           _entry("run", 2, (True, True))])
    assert len(ids) == 3 and ids[0] > entry_id and ids[2] > ids[0]
    got = log.read("run")
    assert [e.step_id for e in got] == [0, 1, 2]
    assert got[0].record == first.record and got[0].entry_id == entry_id
    assert got[0].model_copy(update={"entry_id": None}) == first
    assert [e.run_id for e in log.read("other")] == ["other"]


def test_range_reads(log: AcceptanceLog) -> None:
    ids = log.append_many([_entry("run", i, (True,)) for i in range(10)])
    assert [e.step_id for e in log.read("run", start=ids[3], end=ids[5])] == [3, 4, 5]
    assert [e.step_id for e in log.read("run", start=f"({ids[7]}")] == [8, 9]
    assert [e.step_id for e in log.read("run", count=2)] == [0, 1]
    assert [e.step_id for e in log.iter_entries("run", page=3)] == list(range(10))


def test_summary_arithmetic(log: AcceptanceLog) -> None:
    # accepted lengths: 3, 1, 2, 1(vanilla) -> tau 7/4; depth 1: 2 of 3 accepted; depth 2: 1 of 3.
    log.append_many([
        _entry("run", 0, (True, True), elapsed=0.5),
        _entry("run", 1, (False, False), elapsed=0.25),
        _entry("run", 2, (True, False), node="other", elapsed=0.125),
        _entry("run", 3, (), elapsed=0.125),
    ])
    s = log.summary("run")
    assert (s.steps, s.total_tokens, s.total_time_s) == (4, 7, 1.0)
    assert s.tau == pytest.approx(7 / 4)
    assert s.acceptance_by_depth == pytest.approx([2 / 3, 1 / 3])
    node = log.summary("run", node_id="other")
    assert (node.steps, node.tau, node.acceptance_by_depth) == (1, 2.0, [1.0, 0.0])
    empty = log.summary("never-ran")
    assert (empty.steps, empty.tau, empty.acceptance_by_depth) == (0, 0.0, [])


def test_maxlen_retention_keeps_the_newest(redis_url: str, key_prefix: str) -> None:
    log = AcceptanceLog.from_url(redis_url, prefix=key_prefix,
                                 retention=Retention(maxlen=5, approximate=False))
    for i in range(8):
        log.append(_entry("run", i, (True,)))
    log.append_many([_entry("run", 8 + i, (True,)) for i in range(4)])
    assert [e.step_id for e in log.read("run")] == [7, 8, 9, 10, 11]


def test_minid_retention_drops_old_entries(redis_url: str, key_prefix: str) -> None:
    """Deterministic: the old entries get explicit stream ids an hour in the past (ids are milliseconds
    since the epoch), instead of waiting out a short age limit against the wall clock."""
    keep_all = AcceptanceLog.from_url(redis_url, prefix=key_prefix, retention=Retention(maxlen=None))
    hour_ago_ms = int((time.time() - 3600) * 1000)
    for i in range(3):
        keep_all.client.xadd(keep_all.key("run"), _entry("run", i, (True,)).to_fields(),
                             id=f"{hour_ago_ms + i}-0")
    assert keep_all.length("run") == 3
    aging = AcceptanceLog.from_url(redis_url, prefix=key_prefix,
                                   retention=Retention(maxlen=None, max_age_s=600, approximate=False))
    # MINID = now - 10 min: the hour-old entries go, the new one stays
    aging.append(_entry("run", 3, (True,)))
    assert [e.step_id for e in aging.read("run")] == [3]
    assert aging.trim("run") == 0 and aging.length("run") == 1


def test_retention_is_validated() -> None:
    with pytest.raises(ValueError, match="not both"):
        Retention(maxlen=10, max_age_s=60)
    with pytest.raises(ValueError, match=">= 1"):
        Retention(maxlen=0)


def test_entry_validation() -> None:
    with pytest.raises(ValueError):
        AcceptanceEntry(run_id="", node_id="n", step_id=0, record=_record(0, ()))
    with pytest.raises(ValueError):
        AcceptanceEntry(run_id="r", node_id="n", step_id=-1, record=_record(0, ()))


def test_entries_store_their_own_step_type_and_read_the_engines_records_back_unchanged(
        log: AcceptanceLog) -> None:
    """The log holds :class:`LoggedStep` (state imports no engine type): the engine's record, a
    mapping and a LoggedStep store the same bytes, and what reads back has the record's fields."""
    rec = _record(0, (True, False), elapsed=0.5)
    as_engine = _entry("run", 0, (True, False), elapsed=0.5)
    as_mapping = AcceptanceEntry(run_id="run", node_id="draft", step_id=0, record=rec.to_dict())
    own = LoggedStep.from_dict(rec.to_dict())
    as_own = AcceptanceEntry(run_id="run", node_id="draft", step_id=0, record=own)
    assert as_engine.to_fields() == as_mapping.to_fields() == as_own.to_fields()
    log.append(as_engine)
    (got,) = log.read("run")
    assert isinstance(got.record, LoggedStep) and got.record.to_dict() == rec.to_dict()
    assert StepRecord.from_dict(got.record.to_dict()) == rec  # the graphs layer's conversion is lossless
    assert got.model_dump(mode="json")["record"] == rec.to_dict()  # the API's JSON is unchanged
    with pytest.raises(ValueError):
        AcceptanceEntry(run_id="run", node_id="draft", step_id=0, record=42)


def test_entries_written_under_the_old_mode_name_read_as_today(log: AcceptanceLog) -> None:
    """Records stored before "medusa" was renamed keep comparing equal with their re-execution."""
    fields = _entry("run", 0, (True,)).to_fields()
    fields["record"] = fields["record"].replace('"speculative"', '"medusa"')
    log.client.xadd(log.key("run"), fields)
    (got,) = log.read("run")
    assert got.record.mode == "speculative" and got.record == _entry("run", 0, (True,)).record
