"""Recording every drafted tree (issue 43, item 6): the record's format, its opt-in, and exactness.

A step's tree is an optional field of the step record and of the acceptance entry that stores it:
absent, the stored bytes are those of an entry written before the field existed (acceptance entries
are hash-chained by their bytes, so an old run must verify unchanged); present, it round-trips node
for node. Recording is opt-in per generation (``TreePolicy.record_trees``), per run (``RunContext``)
and per workflow, and it changes no token: same seed, with and without, the same output.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

pytest_plugins = ["state_fixtures"]

# An entry as the stream stored it before trees were recorded (the bytes are what the chain digests).
OLD_RECORD = ('{"step":3,"mode":"speculative","tree_size":6,"tree_depth":2,"accepted_length":3,'
              '"accepted_nodes":[0,1,4],"tokens":[11,12,13],"accepted_by_depth":[true,true],'
              '"draft_temperature":1.0,"elapsed_s":0.25,"predicted":1.5,"calibration":0.9}')
OLD_FIELDS = {"v": "1", "run_id": "run-1", "node_id": "draft_reply", "step_id": "7", "record": OLD_RECORD,
              "call_index": "0"}


def _tree():
    from elesium.inference.records import DraftTree

    return DraftTree(tokens=(10, 11, 99, 98, 12, 97), parents=(-1, 0, 0, 0, 1, 1),
                     probs=(1.0, 0.91, 0.05, 0.02, 0.7, 0.1))


def test_an_entry_without_a_tree_is_stored_byte_for_byte_as_before():
    from elesium.inference.records import StepRecord
    from elesium.state.acceptance_log import AcceptanceEntry

    raw = {k.encode(): v.encode() for k, v in OLD_FIELDS.items()}
    entry = AcceptanceEntry.from_fields(b"1-0", raw)
    assert entry.record.tree is None
    assert entry.to_fields() == OLD_FIELDS  # read back and written again: the same bytes
    # The engine's record without a tree serialises to the same document, key for key.
    step = StepRecord.from_dict(json.loads(OLD_RECORD))
    assert step.tree is None and "tree" not in step.to_dict()
    fresh = AcceptanceEntry(run_id="run-1", node_id="draft_reply", step_id=7, record=step, call_index=0)
    assert fresh.to_fields() == OLD_FIELDS
    # The API's JSON of the entry has no "tree" key either (not null): old and new entries look alike.
    assert "tree" not in entry.model_dump(mode="json")["record"]


def test_a_recorded_tree_round_trips_through_the_stream_fields():
    from elesium.inference.records import StepRecord
    from elesium.state.acceptance_log import AcceptanceEntry, LoggedTree

    step = dataclasses.replace(StepRecord.from_dict(json.loads(OLD_RECORD)), tree=_tree())
    doc = step.to_dict()
    assert list(doc)[-1] == "tree" and doc["tree"]["parents"] == [-1, 0, 0, 0, 1, 1]
    assert StepRecord.from_dict(doc) == step
    entry = AcceptanceEntry(run_id="run-1", node_id="draft_reply", step_id=7, record=step, call_index=0)
    fields = entry.to_fields()
    assert fields["record"].startswith(OLD_RECORD[:-1] + ',"tree":{')  # the old document, then the tree
    back = AcceptanceEntry.from_fields(b"1-0", {k.encode(): v.encode() for k, v in fields.items()})
    assert back.record.tree == LoggedTree((10, 11, 99, 98, 12, 97), (-1, 0, 0, 0, 1, 1),
                                          (1.0, 0.91, 0.05, 0.02, 0.7, 0.1))
    assert back.record.to_dict() == doc and back.to_fields() == fields
    assert back.model_dump(mode="json")["record"]["tree"]["tokens"] == [10, 11, 99, 98, 12, 97]
    with pytest.raises(ValueError, match="one parent and one probability per node"):
        LoggedTree.from_dict({"tokens": [1, 2], "parents": [-1], "probs": [1.0, 0.5]})


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_recording_trees_changes_no_token(engine, temperature):
    """Same seed, with and without recording: identical tokens and step records (but for the tree);
    each recorded tree holds the step's accepted path and its committed drafts."""
    from elesium.inference.sampling import SamplingParams

    params = SamplingParams(max_tokens=12, temperature=temperature, seed=5)
    plain = engine.generate("Name three rivers.", params, mode="speculative")
    recording = dataclasses.replace(engine.policy, record_trees=True)
    recorded = engine.generate("Name three rivers.", params, mode="speculative", policy=recording)
    assert recorded.token_ids == plain.token_ids and recorded.text == plain.text
    assert all(s.tree is None for s in plain.steps) and plain.steps
    assert len(recorded.steps) == len(plain.steps)
    root = plain.token_ids[0]
    for a, b in zip(plain.steps, recorded.steps):
        assert dataclasses.replace(b, tree=None, elapsed_s=0.0) == dataclasses.replace(a, elapsed_s=0.0)
        tree = b.tree
        assert tree is not None and len(tree.tokens) == len(tree.parents) == len(tree.probs) == b.tree_size
        assert tree.tokens[0] == root and tree.parents[0] == -1 and tree.probs[0] == 1.0
        assert all(0 <= tree.parents[n] < n for n in range(1, b.tree_size))
        assert all(0.0 <= p <= 1.0 for p in tree.probs)
        path = b.accepted_nodes
        assert [tree.tokens[n] for n in path[1:]] == list(b.tokens[:-1])
        assert all(tree.parents[child] == parent for parent, child in zip(path, path[1:]))
        root = b.tokens[-1]


def test_recording_is_opt_in_per_run_and_per_workflow(engine, redis_url, key_prefix):
    """``WorkflowRunner(record_trees=True)`` and ``Workflow.define(record_trees=True)`` record trees; a
    plain run's entries have none. The workflow's version does not depend on the setting."""
    from api_workflows import TopicIn, _summary_factory
    from elesium.graphs.registry import Workflow
    from elesium.graphs.runner import WorkflowRunner

    wf = Workflow.define("summary", _summary_factory, TopicIn, description="one LLM call")
    recording_wf = Workflow.define("summary", _summary_factory, TopicIn, description="one LLM call",
                                   record_trees=True)
    assert recording_wf.record_trees and not wf.record_trees and recording_wf.version == wf.version

    def trees(runner, workflow):
        result = runner.start(workflow, {"topic": "rivers"}, seed=3)
        steps = [e.record for e in runner.log.iter_entries(result.run_id) if e.kind == "step"]
        assert steps
        return [s.tree for s in steps], result

    plain = WorkflowRunner(engine, redis_url, mode="speculative", prefix=key_prefix)
    off, r_off = trees(plain, wf)
    assert all(t is None for t in off)
    on, r_on = trees(WorkflowRunner(engine, redis_url, mode="speculative", prefix=key_prefix,
                                    record_trees=True), wf)
    assert all(t is not None for t in on)
    by_wf, r_wf = trees(plain, recording_wf)
    assert all(t is not None for t in by_wf)
    assert r_on.state == r_off.state == r_wf.state  # the same answer, recorded or not
