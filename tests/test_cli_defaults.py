"""The CLI, the library and the shipped profiles agree: ``generate``'s mode follows the profile, an
explicit speculative mode without heads is an error, ``train-heads``' defaults are ``TrainConfig``'s,
and user errors are one line while bugs keep their traceback."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from pathlib import Path

import pytest
import torch

from elesium.cli import build_parser, dispatch, main
from elesium.config import Settings


def run_cli(args: list[str], capsys) -> tuple[int, str, str]:
    code = main(args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def cache_with_profile(tmp_path: Path, engine, *, speculate: bool) -> Path:
    """A cache dir that shares the real weight cache and holds a profile "tuned" on this machine."""
    from elesium.inference.tuning.profile import SHIPPED, TuneProfile, device_kind, profile_path

    real = Settings.from_env().cache_dir
    cache = tmp_path / f"cache-{speculate}"
    cache.mkdir()
    for sub in ("weights", "hashes"):
        (real / sub).mkdir(parents=True, exist_ok=True)
        (cache / sub).symlink_to(real / sub)
    profile = TuneProfile.load(SHIPPED / "cpu-2t.json")
    profile = dataclasses.replace(profile, device_kind=device_kind(torch.device("cpu")), speculate=speculate,
                                  heads_sha256=engine.heads.source_sha256, host="test-host")
    profile.save(profile_path(cache, engine.weights_info.sha256, torch.device("cpu"), torch.float32))
    return cache


@pytest.mark.parametrize("speculate, expected", [(False, "vanilla"), (True, "speculative")])
def test_generate_default_mode_follows_the_profile(engine, tmp_path, capsys, caplog, speculate, expected):
    cache = cache_with_profile(tmp_path, engine, speculate=speculate)
    with caplog.at_level(logging.INFO, logger="elesium"):
        code, out, err = run_cli(["-v", "generate", "Name a colour.", "--json", "--max-tokens", "4",
                                  "--device", "cpu", "--dtype", "float32", "--cache-dir", str(cache)], capsys)
    assert code == 0, err
    data = json.loads(out)
    chosen = data["engine"]
    assert data["mode"] == chosen["mode"] == chosen["default_mode"] == expected  # data["mode"]: the run's
    assert chosen["profile_reason"] == "tuned on test-host" and chosen["profile_id"].startswith("cpu-")
    assert chosen["heads_sha256"] == engine.heads.source_sha256 and chosen["heads_dir"]
    assert ("speculate: false" in chosen["mode_reason"]) == (not speculate)
    # The same choice, with its reason, is logged at load.
    assert f"default mode {expected} (" in caplog.text and "profile cpu-" in caplog.text


@pytest.mark.parametrize("mode", ["speculative", "medusa", "typical"])
def test_speculative_mode_without_heads_is_an_error(engine, capsys, mode):
    if mode != "speculative":  # the same check, through the library: no model load per alias
        heads, engine.heads = engine.heads, None
        try:
            from elesium.inference.engine import ModeUnavailableError

            with pytest.raises(ModeUnavailableError, match="needs draft heads"):
                engine.stream("hi", mode=mode)
        finally:
            engine.heads = heads
        return
    code, out, err = run_cli(["generate", "hi", "--mode", mode, "--heads", "none", "--device", "cpu"], capsys)
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and err.startswith("elesium: error: ") and "needs draft heads" in err


def test_engine_default_mode_is_the_profile_s(engine):
    speculate = engine.speculate
    try:
        engine.speculate = False
        assert engine.default_mode == "vanilla" and engine.fingerprint()["mode"] == "vanilla"
        engine.speculate = True
        assert engine.default_mode == "speculative" and engine.fingerprint()["mode"] == "speculative"
    finally:
        engine.speculate = speculate
    fp = engine.fingerprint("medusa")
    assert fp["mode"] == "speculative" and fp["heads_sha256"] == engine.heads.source_sha256
    assert set(fp) == {"model_sha256", "heads_sha256", "profile_id", "profile_version", "dtype", "device",
                       "mode", "attention", "weights", "numerics", "forward"}
    # The session engine: the CPU float32 reference, eager (the compiled step is for the fast formats).
    assert fp["weights"] == "float32" and fp["numerics"] == "standard" and fp["forward"] == "eager"


def test_eval_heads_with_heads_none_is_an_error(capsys, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    code, out, err = run_cli(["eval-heads", "--prompts", str(prompts), "--heads", "none"], capsys)
    assert code == 1 and err.count("\n") == 1 and "--heads none leaves nothing to score" in err


def test_train_heads_defaults_are_train_config_s():
    from elesium.inference.training.train_config import TrainConfig

    parser = build_parser()
    args = parser.parse_args(["train-heads"])
    defaults = TrainConfig()
    renamed = {"time_budget": "time_budget_s", "command": "-"}  # argparse's own "command" is the subcommand
    compared = 0
    for name, value in vars(args).items():
        field = renamed.get(name, name)
        if hasattr(defaults, field):
            expected = getattr(defaults, field)
            assert (tuple(value) if isinstance(value, list) else value) == expected, name
            compared += 1
    assert compared >= 28  # every training flag, not just a few


@pytest.mark.parametrize("exc_factory", [
    lambda: ValueError("an internal bug that happens to be a ValueError"),
    lambda: OSError("an internal I/O bug"),
    lambda: KeyError("missing"),
])
def test_internal_errors_keep_their_traceback(exc_factory):
    def handler(_args):
        raise exc_factory()

    with pytest.raises(type(exc_factory())):
        dispatch(argparse.Namespace(handler=handler))


def test_user_errors_are_one_line(capsys):
    from elesium.cli import CliError
    from elesium.inference.drafters.files import HeadsMismatchError
    from elesium.inference.engine import PromptTooLongError

    for exc in (CliError("bad flag\nmore"), PromptTooLongError("prompt is 9,000 tokens"),
                HeadsMismatchError("heads were trained for another model"),
                FileNotFoundError("no such file: x")):
        def handler(_args, exc=exc):
            raise exc

        assert dispatch(argparse.Namespace(handler=handler)) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("elesium: error: ") and str(exc).splitlines()[0] in err


@pytest.mark.parametrize("value, message", [("0", "must be from 1 to 16, got 0"),
                                            ("17", "must be from 1 to 16, got 17"),
                                            ("deep", "must be an integer")])
def test_draft_depth_out_of_range_is_a_usage_error_before_loading(capsys, tmp_path, value, message):
    """``--draft-depth`` is checked when the flags are parsed: exit 2 with argparse's one error line, no
    engine loaded."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--prompts", str(prompts), "--draft-depth", value])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"argument --draft-depth: {message}" in err.splitlines()[-1]


def test_bench_writes_json_with_the_engine_it_measured_and_plots(tmp_path, capsys):
    """``elesium bench`` end to end on the bundled model (one prompt, a few tokens): bench.json holds both
    modes, the identical-output count and the engine it measured (heads sha256, so a --draft-depth run is
    told apart; the tree policy), beside the PNG plots."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Name two colours."}\n')
    out = tmp_path / "bench"
    code = main(["bench", "--prompts", str(prompts), "--max-tokens", "6", "--mode", "speculative", "--out",
                 str(out), "--device", "cpu", "--dtype", "float32"])
    capsys.readouterr()
    doc = json.loads((out / "bench.json").read_text())
    # float32 and greedy: speculative decoding's output is vanilla's, so the one prompt counts as identical.
    assert code == 0 and doc["prompts"] == 1 and doc["identical_outputs"] == 1
    assert doc["vanilla"]["tokens"] > 0 and doc["speculative"]["tokens"] > 0
    engine = doc["engine"]
    assert len(engine["heads_sha256"]) == 64 and engine["device"] == "cpu"
    assert engine["policy"]["max_nodes"] >= 2
    assert (out / "speedup.png").stat().st_size > 0 and (out / "acceptance.png").stat().st_size > 0
