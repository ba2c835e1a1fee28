"""``elesium workflows``: the registered workflows, their versions and inputs."""

from __future__ import annotations

import argparse
import json

from elesium.cli.projects import add_config_args, registry_from_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("workflows", help="list the registered workflows (name, version, input fields)")
    p.add_argument("--json", action="store_true", help="one JSON document with each workflow's input schema")
    add_config_args(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    workflows = registry_from_args(args).list()
    if args.json:
        print(json.dumps([{**w.summary(), "schema": w.json_schema()["input"]} for w in workflows], indent=2))
        return 0
    for w in workflows:
        label = f" ({w.label})" if w.label else ""
        print(f"{w.name}  {w.version}{label}\n  {w.description}\n  input: {input_line(w.input_model)}")
    return 0


def input_line(model: type) -> str:
    """``subject: str, customer: str?`` -- the fields, their JSON types, optional ones marked."""
    schema = model.model_json_schema()
    required = set(schema.get("required", []))
    parts = []
    for name, prop in schema.get("properties", {}).items():
        kind = prop.get("type") or "|".join(
            p.get("type", "?") for p in prop.get("anyOf", []) if p.get("type") != "null"
        )
        parts.append(f"{name}: {kind}{'' if name in required else '?'}")
    return ", ".join(parts)
