"""Every Settings knob has one environment variable and one CLI flag, both reach Settings, and the
flag wins; the knobs that used to bypass Settings are read through it."""

from __future__ import annotations

import dataclasses
import importlib

import pytest

from elesium.cli import build_parser
from elesium.cli.commands.common import settings_from_args
from elesium.config import ENV_VARS, Settings, cli_flag
from elesium.errors import SettingsError, UserError

ENV_VALUES = {
    "model": "/env/model.gguf", "device": "cpu", "dtype": "float32", "data_dir": "/env/data",
    "cache_dir": "/env/cache", "redis_url": "redis://env:6379/0", "appendfsync": "always",
    "valkey_server": "/env/valkey-server", "tree_attention": "reference", "invariant_numerics": "on",
    "cpu_weights": "bfloat16", "cpu_compile": "on", "max_batch": "4", "prefix_cache_mb": "64",
    "audit_key": "env-secret",
    "audit_signing_key_file": "/env/audit.pem", "audit_chain": "off",
}
FLAG_VALUES = {
    "model": "/flag/model.gguf", "device": "cuda", "dtype": "bfloat16", "data_dir": "/flag/data",
    "cache_dir": "/flag/cache", "redis_url": "redis://flag:6379/0", "appendfsync": "no",
    "valkey_server": "/flag/valkey-server", "tree_attention": "triton", "invariant_numerics": "off",
    "cpu_weights": "float32", "cpu_compile": "off", "max_batch": "8", "prefix_cache_mb": "32",
    "audit_key": "flag-secret",
    "audit_signing_key_file": "/flag/audit.pem", "audit_chain": "on",
}


def subparser(name: str):
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return sub.choices[name]


def flags_argv(values: dict[str, str]) -> list[str]:
    return [x for name, value in values.items() for x in (cli_flag(name), value)]


def test_every_field_has_one_env_var_and_one_flag():
    assert set(ENV_VARS) == {f.name for f in dataclasses.fields(Settings)}
    assert len(set(ENV_VARS.values())) == len(ENV_VARS)
    # The model's knobs on every command that loads a model; the store's on one that uses the store.
    for command in ("generate", "demo"):
        options = {o for a in subparser(command)._actions for o in a.option_strings}
        model_side = {"model", "device", "dtype", "cache_dir", "tree_attention", "invariant_numerics",
                      "cpu_weights", "cpu_compile", "max_batch", "prefix_cache_mb"}
        wanted = model_side if command == "generate" else set(ENV_VARS)
        assert {cli_flag(name) for name in wanted} <= options, command


@pytest.fixture
def env(monkeypatch):
    for name, var in ENV_VARS.items():
        monkeypatch.setenv(var, ENV_VALUES[name])


def expected(values: dict[str, str]) -> Settings:
    paths = {"data_dir", "cache_dir", "audit_signing_key_file"}
    from pathlib import Path

    return Settings(**{k: (Path(v) if k in paths else v) for k, v in values.items()})


def test_env_vars_reach_settings(env):
    assert Settings.from_env() == expected(ENV_VALUES)
    args = subparser("demo").parse_args([])
    assert settings_from_args(args) == expected(ENV_VALUES)  # no flags: the environment's values


def test_flags_reach_settings_and_win_over_env(env):
    args = subparser("demo").parse_args(flags_argv(FLAG_VALUES))
    assert settings_from_args(args) == expected(FLAG_VALUES)
    partial = subparser("generate").parse_args(["hi", "--tree-attention", "reference", "--cache-dir", "/x"])
    settings = settings_from_args(partial)
    assert settings.tree_attention == "reference" and str(settings.cache_dir) == "/x"
    assert settings.appendfsync == "always" and settings.model == "/env/model.gguf"  # not flagged: env


@pytest.mark.parametrize("var, value", [("ELESIUM_APPENDFSYNC", "sometimes"),
                                        ("ELESIUM_TREE_ATTENTION", "cuda")])
def test_bad_values_are_user_errors_naming_the_variable(monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    with pytest.raises(SettingsError, match=var) as info:
        Settings.from_env()
    assert isinstance(info.value, UserError) and isinstance(info.value, ValueError)


def test_tree_attention_is_read_once_not_per_call(monkeypatch):
    module = importlib.import_module("elesium.kernels.tree_attention")
    monkeypatch.setattr(module, "_backend_choice", None)
    monkeypatch.setenv("ELESIUM_TREE_ATTENTION", "reference")
    assert module.backend() == "reference"
    monkeypatch.setenv("ELESIUM_TREE_ATTENTION", "triton")
    assert module.backend() == "reference"  # read once, through Settings
    module.set_backend("auto")  # what Engine.load does with Settings.tree_attention
    assert module.backend() == "auto"


def test_valkey_server_and_appendfsync_reach_the_embedded_server(tmp_path, monkeypatch):
    from elesium.state.connection import default_url
    from elesium.state.errors import EmbeddedServerError

    fake = tmp_path / "fake-server"
    fake.write_text("#!/bin/sh\necho 'FATAL: this is the configured binary' >&2\nexit 3\n")
    fake.chmod(0o755)
    monkeypatch.delenv("ELESIUM_VALKEY_SERVER", raising=False)
    settings = Settings(data_dir=tmp_path / "data", appendfsync="always", valkey_server=str(fake))
    with pytest.raises(EmbeddedServerError, match="this is the configured binary"):
        default_url(settings)
    # The configuration written for that binary carries the settings' fsync policy.
    conf = (tmp_path / "data" / "valkey" / "valkey.conf").read_text()
    assert "appendfsync always" in conf
