"""Per-(workflow, node) tree calibrations learnt from the acceptance log (graphs/calibration.py).

Synthetic logs check the estimator's bounds, versioning and idempotent folding, and the
``tune --from-log`` table; the real model (speculative mode, sampled at T > 0) checks that runs
pick up the current version, record it, feed the online update, and that a re-executed run
reproduces its sampled tokens with its recorded version after a newer one was published.
"""

from __future__ import annotations

from typing import Any

import pytest
import redis
from langgraph.graph import END, START, StateGraph
from pydantic import BaseModel

from elesium.cli import main as cli_main
from elesium.graphs import Registry, Workflow, WorkflowRunner, llm_node
from elesium.graphs.audit import call_tokens
from elesium.graphs.calibration import CalibrationNotFoundError, NodeCalibrator, TrialRule, reexecute
from elesium.graphs.llm import WorkflowState
from elesium.inference.decoding.tree_policy import TreePolicy
from elesium.inference.records import StepRecord
from elesium.inference.tuning.node_calibration import (
    ArmSamples,
    CalibrationBounds,
    NodeCalibration,
    apply,
    difference,
    sample_counters,
)
from elesium.state.acceptance_log import AcceptanceEntry, AcceptanceLog, Retention
from elesium.state.calibrations import CalibrationStore
from elesium.state.runs import RunRecord, RunRegistry, RunStatus

pytest_plugins = ["state_fixtures"]


def steps(
    run_id: str,
    node: str,
    n: int,
    *,
    accepted: int,
    size: int,
    predicted: float,
    calibration: float = 1.0,
    tokens_per_call: int = 20,
) -> list[AcceptanceEntry]:
    """One call of ``node``: its call entry, then ``n`` tree steps that each accept ``accepted`` drafts."""
    depth = max(accepted, 3)
    head = AcceptanceEntry(
        run_id=run_id,
        node_id=node,
        step_id=0,
        kind="call",
        call_index=0,
        call_seed=1,
        tokens=tuple(range(tokens_per_call)),
        record=StepRecord(0, "speculative", 1, 0, 1, (0,), (0,)),
    )
    out = [head]
    for i in range(n):
        rec = StepRecord(
            step=i,
            mode="speculative",
            tree_size=size,
            tree_depth=depth,
            accepted_length=accepted + 1,
            accepted_nodes=tuple(range(accepted + 1)),
            tokens=tuple(range(accepted + 1)),
            accepted_by_depth=tuple(d <= accepted for d in range(1, depth + 1)),
            draft_temperature=1.0,
            elapsed_s=0.05,
            predicted=predicted,
            calibration=calibration,
        )
        out.append(
            AcceptanceEntry(run_id=run_id, node_id=node, step_id=1 + i, record=rec, call_index=0, call_seed=1)
        )
    return out


def synthetic_run(log: AcceptanceLog, run_id: str) -> None:
    """easy: heads under-confident (4 accepted, 0.5 predicted); hard: over-confident; thin: 3 steps."""
    entries = (
        steps(run_id, "easy", 20, accepted=4, size=8, predicted=0.5)
        + steps(run_id, "hard", 20, accepted=0, size=4, predicted=2.0)
        + steps(run_id, "thin", 3, accepted=1, size=4, predicted=1.0)
    )
    for i, e in enumerate(entries):  # run-wide step ids
        entries[i] = e.model_copy(update={"step_id": i})
    log.append_many(entries)


def stores(url: str, prefix: str) -> tuple[AcceptanceLog, CalibrationStore]:
    log = AcceptanceLog.from_url(url, prefix=f"{prefix}:acc", retention=Retention(maxlen=None))
    return log, CalibrationStore.from_url(url, prefix=f"{prefix}:calib")


def test_calibrations_from_a_synthetic_log_are_bounded_and_versioned(redis_url: str, key_prefix: str) -> None:
    log, store = stores(redis_url, key_prefix)
    bounds = CalibrationBounds(max_nodes=32)
    cal = NodeCalibrator(store, log, bounds=bounds, rule=None)  # no trials: estimates adopted directly
    synthetic_run(log, "r1")
    rows = {r.node: r for r in cal.fold_run("wf", "r1")}
    assert {n: (r.before, r.after) for n, r in rows.items()} == {
        "easy": ("global", "v1"),
        "hard": ("global", "v1"),
        "thin": ("global", "global"),
    }
    easy = NodeCalibration.from_dict(store.get("wf", "easy", "v1")["policy"])
    hard = NodeCalibration.from_dict(store.get("wf", "hard", "v1")["policy"])
    # The raw estimates (about 7.5 and 0.09) are clamped to the bounds, and so is what follows from them.
    # (the draft temperature is left to the engine's policy: derived versions do not set one)
    assert (easy.calibration, easy.draft_temperature, easy.max_nodes) == (4.0, None, 32)
    assert (hard.calibration, hard.draft_temperature) == (0.25, None)
    assert bounds.min_nodes <= hard.max_nodes <= 8
    assert store.current("wf", "thin") == "global"  # 3 steps: too little evidence to leave the global policy
    doc = store.get("wf", "easy", "v1")
    assert (
        doc["stats"]["steps"] == 20 and doc["stats"]["tau"] == 5.0 and doc["stats"]["tokens_per_call"] == 20
    )
    assert doc["stats"]["acceptance_by_depth"][:4] == [1.0, 1.0, 1.0, 1.0]

    # Folding is once per run; more of the same evidence moves nothing, so no new version.
    assert cal.fold_run("wf", "r1") == []
    assert NodeCalibrator(store, log).store.counters("wf", "easy")["steps"] == 20
    synthetic_run(log, "r2")
    rows = {r.node: r for r in cal.fold_run("wf", "r2")}
    assert rows["easy"].after == "v1" and store.counters("wf", "easy")["steps"] == 40
    assert store.current("wf", "thin") == "global"  # 6 steps: still under min_steps
    synthetic_run(log, "r3")
    assert {r.node: r.after for r in cal.fold_run("wf", "r3")}["thin"] == "v1"  # 9 steps

    # Versions are immutable: a newer one gets the next number and the old document stays as it was.
    v1 = store.get("wf", "easy", "v1")
    assert (
        store.publish(
            "wf", "easy", {"policy": {"max_nodes": 8, "calibration": 1.0, "draft_temperature": 1.0}}
        )
        == "v2"
    )
    assert store.current("wf", "easy") == "v2" and store.get("wf", "easy", "v1") == v1
    store.client.set(f"{key_prefix}:calib:{{wf:easy}}:seq", 1)  # even a reset counter cannot overwrite v2
    with pytest.raises(redis.ResponseError, match="version exists"):
        store.publish("wf", "easy", {"policy": {}})
    assert store.get("wf", "easy", "v2")["policy"]["max_nodes"] == 8
    with pytest.raises(CalibrationNotFoundError):
        cal.calibration("wf", "easy", "v9")


def arm_run(log: AcceptanceLog, run_id: str, node: str, *, accepted: int, size: int) -> None:
    """One run of ``node``: one call of 20 tree steps, each accepting ``accepted`` drafts."""
    entries = steps(run_id, node, 20, accepted=accepted, size=size, predicted=0.5)
    log.append_many([e.model_copy(update={"step_id": i}) for i, e in enumerate(entries)])


def test_a_new_estimate_is_adopted_only_after_it_wins_its_trial(redis_url: str, key_prefix: str) -> None:
    """Trials: a derived version runs against the current one; the better arm, on the modeled cost
    curve, decides; a rejected estimate is not proposed again; runs alternate arms while a trial runs."""
    log, store = stores(redis_url, key_prefix)
    cost = lambda n: 1.0 + 0.1 * n  # noqa: E731 - a forward of n nodes costs 1 + n/10
    rule = TrialRule(min_runs=2)
    cal = NodeCalibrator(store, log, rule=rule, cost=cost)
    base = TreePolicy(kind="dynamic", max_nodes=64)

    # Evidence that the heads are under-confident: the estimate moves, so v1 goes on trial.
    arm_run(log, "seed", "win", accepted=4, size=8)
    (row,) = cal.fold_run("wf", "seed", labels={"win": "global"})
    assert (row.before, row.after, row.trial, row.event) == ("global", "global", "v1", "trial")
    assert store.current("wf", "win") == "global" and store.trial("wf", "win") == "v1"
    # Successive runs alternate: trial, incumbent, trial, ...
    assert [cal.choose(base, "wf", "win", None)[0] for _ in range(4)] == ["v1", "global", "v1", "global"]
    assert cal.choose(base, "wf", "win", "global")[0] == "global"  # a pinned run keeps its version

    # The trial arm accepts more per modeled unit of time (5 tokens per 2.6 against 3 per 1.8).
    for i in range(2):
        arm_run(log, f"t{i}", "win", accepted=4, size=16)
        assert cal.fold_run("wf", f"t{i}", labels={"win": "v1"})[0].event == "trial"
        arm_run(log, f"g{i}", "win", accepted=2, size=8)
        last = cal.fold_run("wf", f"g{i}", labels={"win": "global"})[0]
    assert (last.event, last.after, last.trial) == ("promoted", "v1", None)
    assert store.current("wf", "win") == "v1" and store.trial("wf", "win") is None
    (verdict,) = store.decisions("wf", "win")
    assert set(verdict) == {"efficiency", "stdev", "runs", "difference", "stderr", "tau", "steps", "modeled",
                            "trial", "incumbent", "verdict", "decided"}  # the stored shape, as before
    assert (verdict["trial"], verdict["incumbent"], verdict["modeled"]) == ("v1", "global", True)
    assert verdict["verdict"] == "promoted" and verdict["steps"] == {"v1": 40, "global": 40}
    assert verdict["runs"] == {"v1": 2, "global": 2} and verdict["stderr"] == 0.0
    assert verdict["efficiency"]["v1"] == pytest.approx(5 / 2.6, rel=1e-5)
    assert verdict["efficiency"]["global"] == pytest.approx(3 / 1.8, rel=1e-5)
    assert store.counters("wf", "win", arm="v1") == {}  # the arms' counters went with the trial
    assert cal.choose(base, "wf", "win", None)[0] == "v1"

    # A trial version that accepts no more than the incumbent but builds bigger trees loses.
    arm_run(log, "seed2", "lose", accepted=4, size=8)
    assert cal.fold_run("wf", "seed2", labels={"lose": "global"})[0].trial == "v1"
    for i in range(2):
        arm_run(log, f"lt{i}", "lose", accepted=2, size=32)
        cal.fold_run("wf", f"lt{i}", labels={"lose": "v1"})
        arm_run(log, f"lg{i}", "lose", accepted=2, size=8)
        last = cal.fold_run("wf", f"lg{i}", labels={"lose": "global"})[0]
    assert (last.event, last.after) == ("rejected", "global")
    assert store.current("wf", "lose") == "global" and store.trial("wf", "lose") is None
    # The same evidence again proposes the same estimate: not tried a second time.
    arm_run(log, "more", "lose", accepted=2, size=8)
    assert cal.fold_run("wf", "more", labels={"lose": "global"})[0].event == "unchanged"
    assert store.versions("wf", "lose") == 1


def test_a_trial_within_its_noise_runs_on_then_is_rejected(redis_url: str, key_prefix: str) -> None:
    """Per-run efficiencies that overlap decide nothing; at ``max_runs`` the incumbent stays."""
    log, store = stores(redis_url, key_prefix)
    cost = lambda n: 1.0 + 0.1 * n  # noqa: E731
    cal = NodeCalibrator(store, log, rule=TrialRule(min_runs=2, max_runs=3), cost=cost)
    arm_run(log, "seed", "noisy", accepted=4, size=8)
    assert cal.fold_run("wf", "seed", labels={"noisy": "global"})[0].trial == "v1"
    events = []
    for i, size in enumerate((8, 16, 8)):  # trial: 4 tokens per 1.8 or per 2.6 (mean 1.88, wide)
        arm_run(log, f"t{i}", "noisy", accepted=3, size=size)
        events.append(cal.fold_run("wf", f"t{i}", labels={"noisy": "v1"})[0].event)
        arm_run(log, f"g{i}", "noisy", accepted=3, size=12)  # incumbent: 4 per 2.2 (1.82) every run
        events.append(cal.fold_run("wf", f"g{i}", labels={"noisy": "global"})[0].event)
    assert events == ["trial"] * 5 + ["rejected"]
    (verdict,) = store.decisions("wf", "noisy")
    assert verdict["runs"] == {"v1": 3, "global": 3} and verdict["difference"] > 0  # ahead, not enough
    assert verdict["stderr"] > 0 and store.current("wf", "noisy") == "global"


def test_the_store_ends_a_trial_as_told_once_and_decides_nothing(redis_url: str, key_prefix: str) -> None:
    """``end_trial`` is storage: it moves the pointer only when told, clears the arms and appends the
    caller's record in one script; a second end of the same trial (another worker's fold reaching the
    same verdict) writes nothing."""
    _, store = stores(redis_url, key_prefix)
    assert store.publish("wf", "n", {"policy": {}, "previous": "global"}, trial=True) == "v1"
    store.fold("wf", "n", "r1", {"steps": 1.0, "trial_n": 1.0}, arm="v1")
    store.fold("wf", "n", "r2", {"steps": 1.0, "trial_n": 1.0}, arm="global")
    record = {"verdict": "whatever the caller says", "figure": 1}
    assert store.end_trial("wf", "n", "v1", "global", make_current=False, record=record) is True
    assert store.current("wf", "n") == "global" and store.trial("wf", "n") is None
    assert store.counters("wf", "n", arm="v1") == {} and store.counters("wf", "n", arm="global") == {}
    assert store.counters("wf", "n")["steps"] == 2.0  # the node's own counters stay
    assert store.decisions("wf", "n") == [record]
    assert store.end_trial("wf", "n", "v1", "global", make_current=True, record={"x": 2}) is False
    assert store.current("wf", "n") == "global" and store.decisions("wf", "n") == [record]
    assert store.publish("wf", "n", {"policy": {}, "previous": "global"}, trial=True) == "v2"
    assert store.end_trial("wf", "n", "v2", "global", make_current=True, record={}) is True
    assert store.current("wf", "n") == "v2"


def test_the_trial_rule_is_a_pure_function_of_the_arms_samples() -> None:
    """What used to be computed inside the store's decide call: the same thresholds, now testable
    without a server."""
    def arm(*values: float) -> ArmSamples:
        counters: dict[str, float] = {}
        for v in values:
            for k, x in sample_counters(v).items():
                counters[k] = counters.get(k, 0.0) + x
        return ArmSamples.from_counters(counters)

    rule = TrialRule(min_runs=2, max_runs=3)
    assert rule.outcome(arm(2.0, 2.0), arm(1.0)) is None  # the incumbent has one run: too few
    assert rule.outcome(arm(2.0, 2.0), arm(1.0, 1.0)) is True  # ahead, no noise
    assert rule.outcome(arm(1.0, 1.0), arm(2.0, 2.0)) is False  # behind, no noise
    assert rule.outcome(arm(1.0, 3.0), arm(1.9, 2.1)) is None  # within the noise: keep running
    assert rule.outcome(arm(1.0, 3.0, 2.2), arm(1.9, 2.1, 2.0)) is False  # ... until max_runs
    assert TrialRule(min_runs=2, margin=2.0).outcome(arm(2.0, 2.0), arm(1.0, 1.0)) is None  # under margin
    a = arm(1.0, 3.0)
    assert (a.n, a.mean, a.variance) == (2, 2.0, 2.0)
    assert difference(a, arm(1.0, 1.0)) == pytest.approx((1.0, 1.0))


def test_applied_calibration_stays_within_the_engine_budget() -> None:
    base = TreePolicy(kind="dynamic", max_nodes=16)
    policy = apply(base, NodeCalibration(max_nodes=64, calibration=2.0, draft_temperature=0.7))
    assert (policy.max_nodes, policy.calibration, policy.draft_temperature) == (16, 2.0, 0.7)
    # A version without a temperature keeps the engine's; a pinned one is clamped to the bounds.
    assert apply(base, NodeCalibration(8, 2.0)).draft_temperature == base.draft_temperature
    assert apply(base, NodeCalibration(8, 2.0, 9.0)).draft_temperature == CalibrationBounds.max_temperature
    assert base.calibration == 1.0  # the engine's own policy is untouched
    assert apply(TreePolicy(kind="static", static_paths=((0,),)), NodeCalibration(8, 2.0, 0.7)) is None


def succeeded_run(runs: RunRegistry, run_id: str, workflow: str) -> None:
    runs.create(RunRecord(run_id=run_id, workflow=workflow, workflow_version="x", input_hash="h"))
    runs.update_status(run_id, RunStatus.RUNNING)
    runs.update_status(run_id, RunStatus.SUCCEEDED)


def test_tune_from_log_prints_the_before_after_table(redis_url: str, key_prefix: str, capsys) -> None:
    log, store = stores(redis_url, key_prefix)
    runs = RunRegistry.from_url(redis_url, prefix=f"{key_prefix}:runs")
    for run_id in ("t1", "t2"):
        synthetic_run(log, run_id)
        succeeded_run(runs, run_id, "ticket-triage")
    synthetic_run(log, "other")
    succeeded_run(runs, "other", "incident-summary")  # another workflow: not rebuilt with --workflow
    argv = [
        "tune",
        "--from-log",
        "--workflow",
        "ticket-triage",
        "--prefix",
        key_prefix,
        "--redis-url",
        redis_url,
    ]
    assert cli_main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == [
        "workflow",
        "node",
        "runs",
        "steps",
        "tau",
        "tok/call",
        "before",
        "budget",
        "calib",
        "temp",
        "after",
        "budget",
        "calib",
        "temp",
        "event",
    ]
    table = {line.split()[1]: line.split() for line in out[1:4]}
    assert table["easy"][2:6] == ["2", "40", "5.00", "20.0"]
    assert table["easy"][6:10] == ["global", "-", "-", "-"] and table["easy"][10:15] == [
        "v1(trial)",
        "64",
        "4.00",
        "-",
        "trial",
    ]
    assert table["thin"][10] == "global" and table["hard"][10:13] == ["v1(trial)", "8", "0.25"]
    assert out[4].startswith("2 of 3 node calibrations on trial")
    assert store.current("ticket-triage", "easy") == "global" and store.trial("ticket-triage", "easy") == "v1"
    assert store.current("incident-summary", "easy") == "global"
    # A rebuild recounts from scratch (no double counting) and leaves a running trial running.
    assert cli_main(argv) == 0
    again = {line.split()[1]: line.split() for line in capsys.readouterr().out.splitlines()[1:4]}
    assert again["easy"][3] == "40" and again["easy"][6] == "global" and again["easy"][10] == "v1(trial)"
    assert store.versions("ticket-triage", "easy") == 1
    # --adopt: the operator's override publishes at once and ends the trial.
    assert cli_main([*argv, "--adopt"]) == 0
    adopted = capsys.readouterr().out.splitlines()
    row = {line.split()[1]: line.split() for line in adopted[1:4]}["easy"]
    assert row[10] == "v2" and row[14] == "adopted"
    assert adopted[4].startswith("2 of 3 node calibrations changed")
    assert store.current("ticket-triage", "easy") == "v2" and store.trial("ticket-triage", "easy") is None
    assert cli_main(["tune", "--adopt", "--redis-url", redis_url]) == 1
    assert "--adopt goes with --from-log" in capsys.readouterr().err
    assert cli_main(["tune", "--from-log", "--workflow", "no-such-flow", "--redis-url", redis_url]) == 1
    assert "no-such-flow" in capsys.readouterr().err


# -- the real model -----------------------------------------------------------------------------------


class TinyIn(BaseModel):
    topic: str


class TinyState(WorkflowState, total=False):
    topic: str
    text: str


def tiny_registry() -> Registry:
    """One sampled free-text node: its tokens depend on the trees, hence on the calibration."""
    write = llm_node(
        "write",
        prompt="Write one sentence about {topic}.",
        output_key="text",
        params={"max_tokens": 32, "temperature": 0.9},
    )

    def build() -> StateGraph:
        b = StateGraph(TinyState)
        b.add_node(write)
        b.add_edge(START, "write")
        b.add_edge("write", END)
        return b

    registry = Registry()
    registry.register(Workflow.define("tiny-calibrated", build, TinyIn, description="calibration test"))
    return registry


@pytest.fixture
def runner(engine, redis_url: str, key_prefix: str) -> WorkflowRunner:
    return WorkflowRunner(engine, redis_url, registry=tiny_registry(), mode="speculative", prefix=key_prefix)


def tokens(runner: WorkflowRunner, run_id: str) -> list[tuple[Any, ...]]:
    return [t for *_, t in call_tokens(runner.log, run_id)]


def test_runs_use_record_and_update_the_node_calibration(runner: WorkflowRunner) -> None:
    store = runner.calibrator.store
    first = runner.start("tiny-calibrated", {"topic": "rivers"}, seed=11)
    assert first.status == "succeeded"
    assert runner.runs.get(first.run_id).calibrations == {"write": "global"}
    n_steps = sum(1 for e in runner.log.iter_entries(first.run_id) if e.kind == "step")
    assert n_steps >= CalibrationBounds().min_steps
    # Online update: the succeeded run was folded and the node's first version went on trial; new
    # runs alternate between it and the global policy, which stays current until the verdict.
    assert store.trial("tiny-calibrated", "write") == "v1"
    assert store.current("tiny-calibrated", "write") == "global"
    v1 = NodeCalibration.from_dict(store.get("tiny-calibrated", "write", "v1")["policy"])
    assert store.counters("tiny-calibrated", "write")["steps"] == n_steps

    second = runner.start("tiny-calibrated", {"topic": "mountains"}, seed=12)
    assert runner.runs.get(second.run_id).calibrations == {"write": "v1"}
    # The node really decoded with v1: its first tree was built from v1's calibration factor.
    first_step = next(e.record for e in runner.log.iter_entries(second.run_id) if e.kind == "step")
    assert first_step.calibration == pytest.approx(v1.calibration) and v1.calibration != 1.0
    assert first_step.draft_temperature == runner.engine.policy.draft_temperature
    counted = sum(1 for e in runner.log.iter_entries(second.run_id) if e.kind == "step")
    assert store.counters("tiny-calibrated", "write")["steps"] == n_steps + counted
    # Its steps count for the trial arm too; the next run takes the other arm.
    assert store.counters("tiny-calibrated", "write", arm="v1")["steps"] == counted
    third = runner.start("tiny-calibrated", {"topic": "deserts"}, seed=13)
    assert runner.runs.get(third.run_id).calibrations == {"write": "global"}
    third_steps = sum(1 for e in runner.log.iter_entries(third.run_id) if e.kind == "step")
    assert store.counters("tiny-calibrated", "write", arm="global")["steps"] == third_steps


def test_reexecution_with_the_recorded_version_reproduces_sampled_tokens(runner: WorkflowRunner) -> None:
    store = runner.calibrator.store
    store.publish(
        "tiny-calibrated",
        "write",
        {"policy": {"max_nodes": 16, "calibration": 0.8, "draft_temperature": 1.1}},
    )
    runner.calibrator.learn = False  # keep the versions below exactly as published here
    original = runner.start("tiny-calibrated", {"topic": "the sea"}, seed=21)
    assert runner.runs.get(original.run_id).calibrations == {"write": "v1"}
    # A newer, quite different calibration is published: new runs start from it.
    assert (
        store.publish(
            "tiny-calibrated",
            "write",
            {"policy": {"max_nodes": 64, "calibration": 4.0, "draft_temperature": 0.5}},
        )
        == "v2"
    )
    again = reexecute(runner, original.run_id)
    assert runner.runs.get(again.run_id).calibrations == {"write": "v1"}
    assert tokens(runner, again.run_id) == tokens(runner, original.run_id)
    assert again.state["text"] == original.state["text"]
    # Control: the same input and seed with the current version draws other trees, so other tokens;
    # without the recorded version the re-execution would not reproduce the run.
    current = reexecute(runner, original.run_id, calibrations={})
    assert runner.runs.get(current.run_id).calibrations == {"write": "v2"}
    assert tokens(runner, current.run_id) != tokens(runner, original.run_id)
