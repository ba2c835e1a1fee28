"""``train-heads --from-log``: distillation data from the shipped workflows' own runs, on the real model.

Two incident-summary runs and one expense-approval run on the session's engine and Redis leave their
LLM calls (one each: the runbook step chosen under a choice grammar, the claim's purpose copied under a
span grammar) in the acceptance log; the records built from them must be those calls exactly (the prompt
is what the model was fed: greedy decoding from it gives the recorded answer again), keep prompts
out when asked, skip other models' runs, and train heads through the CLI.
"""

from __future__ import annotations

import gzip
import json
from typing import Any

import pytest

from elesium.cli import main
from elesium.graphs import WorkflowRunner
from elesium.graphs.audit import call_heads
from elesium.graphs.traffic import records_from_log
from elesium.graphs.workflows import incident_summary
from elesium.inference.constraints import Constraint
from elesium.inference.sampling import SamplingParams

pytest_plugins = ["state_fixtures"]

LOGS = ("2026-11-30T09:10:02Z ERROR db connection refused (pool exhausted)\n"
        "2026-11-30T09:10:05Z FATAL payment worker crashed")
CLAIM = {"employee": "Dana Kim", "amount": 42.5, "currency": "USD", "category": "meals",
         "description": "Team lunch with a customer"}


@pytest.fixture(scope="module")
def traffic(engine, redis_url: str) -> dict[str, Any]:
    prefix = "test-traffic"
    runner = WorkflowRunner(engine, redis_url, prefix=prefix)
    for key in runner.runs.client.scan_iter(match=f"{prefix}:*", count=1000):  # a rerun on a kept server
        runner.runs.client.delete(key)
    results = [runner.start("incident-summary", {"service": "checkout-api", "logs": LOGS}, seed=s)
               for s in (1, 2)]
    results.append(runner.start("expense-approval", CLAIM, seed=3))
    assert all(r.status == "succeeded" for r in results)
    calls = {r.run_id: call_heads(runner.log, r.run_id) for r in results}
    return {"runner": runner, "prefix": prefix, "results": results, "calls": calls}


def test_one_record_per_call_with_the_prompt_the_model_was_fed(engine, traffic) -> None:
    runner = traffic["runner"]
    data = records_from_log(runner.runs, runner.log, model_sha256=engine.weights_info.sha256)
    calls = [c for rid in sorted(traffic["calls"]) for c in traffic["calls"][rid]]
    assert data.runs == 3 and not data.skipped
    assert len(data.records) == len(calls) == 1 + 1 + 1  # choose_action twice, the claim's purpose once
    for rec, call in zip(data.records, calls, strict=True):
        assert rec["id"] == call.run_id and rec["task"].endswith("/" + call.node_id)
        assert rec["response_ids"] == list(call.tokens) and rec["prompt_ids"] == list(call.prompt)
        assert rec["model_sha256"] == engine.weights_info.sha256
    prompts = [engine.tokenizer.decode(r["prompt_ids"]) for r in data.records]
    assert sum("checkout-api" in p for p in prompts) == 2 and any("Team lunch" in p for p in prompts)
    # The prompt ids are exactly the model's context: greedy decoding from them, under the node's grammar
    # (the runbook choice), repeats the answer.
    chosen = [r for r in data.records if r["task"].split("/")[1] == "choose_action"]
    assert len(chosen) == 2 and all(r["sampling"]["temperature"] == 0.0 for r in chosen)
    for rec in chosen:
        n = len(rec["response_ids"])
        params = SamplingParams(max_tokens=n, temperature=0.0)
        again = engine.generate(rec["prompt_ids"], params, mode="vanilla",
                                constraint=Constraint.choice(incident_summary.RUNBOOK))
        assert list(again.token_ids[:n]) == rec["response_ids"]


def test_prompts_can_be_kept_out(engine, traffic) -> None:
    runner = traffic["runner"]
    data = records_from_log(runner.runs, runner.log, model_sha256=engine.weights_info.sha256,
                            include_prompts=False, workflow="incident-summary")
    assert data.runs == 2 and len(data.records) == 2
    by_run = {rid: [list(c.tokens) for c in calls] for rid, calls in traffic["calls"].items()}
    for rec in data.records:
        # The answer alone: its first token is the context, and no prompt token is left.
        assert rec["prompt_ids"] + rec["response_ids"] in by_run[rec["id"]]
        assert len(rec["prompt_ids"]) == 1 and rec["source"]["prompts"] is False


def test_runs_of_another_model_are_skipped(traffic) -> None:
    runner = traffic["runner"]
    data = records_from_log(runner.runs, runner.log, model_sha256="0" * 64)
    assert data.records == [] and data.skipped == {"runs of another model": 3}


def test_cli_trains_heads_from_the_log(traffic, redis_url: str, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("REDIS_URL", redis_url)
    out = tmp_path / "heads"
    argv = ["train-heads", "--from-log", "--prefix", traffic["prefix"], "--out", str(out), "--device", "cpu",
            "--dtype", "float32", "--steps", "3", "--batch-size", "64", "--num-heads", "2", "--drafter",
            "none", "--eval-every", "3", "--ckpt-every", "3", "--warmup", "1", "--storage", "float"]
    assert main(argv) == 0
    lines = gzip.open(out / "from-log.jsonl.gz", "rt").read().splitlines()
    assert len(lines) == 3 and all(json.loads(line)["prompt_ids"] for line in lines)
    manifest = json.loads((out / "manifest.json").read_text())
    data = manifest["training"]["data"]
    assert data["prompts"] == 3 and data["sequences"] == 3 and manifest["training"]["steps"] == 3
    assert data["prompt_source"].startswith("the acceptance log: 3 succeeded runs of expense-approval, "
                                            "incident-summary")
    assert (out / "heads.safetensors").exists()


@pytest.mark.parametrize(("extra", "message"), [
    (["--exclude-prompts"], "--exclude-prompts goes with --from-log"),
    (["--from-log", "--data", "x.jsonl"], "goes with neither --data nor --distill-only"),
    (["--from-log", "--prefix", "test-traffic-empty"], "needs LLM calls from at least 2 succeeded runs"),
    (["--from-log", "--workflow", "nope"], "unknown workflow 'nope'"),
])
def test_bad_from_log_requests_are_one_line(extra, message, redis_url, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("REDIS_URL", redis_url)
    argv = ["train-heads", "--out", str(tmp_path / "h"), "--device", "cpu", "--dtype", "float32", *extra]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_cli_trains_an_eagle_drafter_tree_from_the_log(traffic, redis_url: str, tmp_path,
                                                       monkeypatch) -> None:
    """``--kind eagle`` from the service's own traffic, starting from the shipped drafter: a drafter tree
    that loads, scored by depth."""
    from elesium.inference.drafters.drafter_tree import DrafterTree
    from elesium.inference.drafters.files import default_heads_dir, load_heads

    monkeypatch.setenv("REDIS_URL", redis_url)
    out = tmp_path / "eagle"
    argv = ["train-heads", "--from-log", "--prefix", traffic["prefix"], "--out", str(out), "--device", "cpu",
            "--dtype", "float32", "--kind", "eagle", "--num-heads", "3", "--init-drafter",
            str(default_heads_dir()), "--drafter-steps", "1", "--drafter-batch", "2", "--eval-every", "1",
            "--warmup", "1", "--storage", "float"]
    assert main(argv) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["heads"]["kind"] == "eagle" and manifest["training"]["depth"] == 3
    assert [d["depth"] for d in manifest["eval"]["held_out_by_depth"]["as_stored"]] == [1, 2, 3]
    assert not (out / "heads.safetensors").exists()
    heads = load_heads(out, base_sha256=manifest["base_model"]["sha256"])
    assert isinstance(heads, DrafterTree) and heads.num_heads == 3


@pytest.mark.parametrize(("extra", "message"), [
    (["--init-drafter", "x"], "--init-drafter goes with --kind eagle"),
    (["--kind", "eagle", "--drafter", "none"], "cannot go with --drafter none"),
    (["--kind", "eagle", "--init-drafter", "no-such-dir"], "--init-drafter directory not found"),
])
def test_bad_eagle_requests_are_one_line(extra, message, tmp_path, capsys) -> None:
    argv = ["train-heads", "--out", str(tmp_path / "h"), "--device", "cpu", "--dtype", "float32", *extra]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
