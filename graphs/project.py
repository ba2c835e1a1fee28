"""A project's graphs from its ``langgraph.json``: what ``elesium serve|dev|run|replay|workflows --config``
serve.

The file is LangGraph's own project file::

    {"dependencies": ["."], "graphs": {"agent": "./agent.py:graph"}, "env": ".env"}

``env`` (a ``.env`` file's path, or a dict) is loaded into ``os.environ`` first (variables already set
win), then each ``dependencies`` entry that is a local directory goes on ``sys.path`` (packages named
there are not installed: install them into the environment yourself), then every graph is imported.
A graph entry is ``./path/to/file.py:attr`` (relative to the file) or ``package.module:attr``; the
attribute may be:

- an Elesium :class:`~elesium.graphs.registry.Workflow` (served as registered: its input model,
  resume model and version), named by its ``langgraph.json`` key;
- a ``StateGraph`` builder (compiled on the server's checkpointer);
- a compiled graph (its checkpointer replaced by the server's, its other compile options kept);
- a function returning any of these, called once at load, with no argument or with a
  ``RunnableConfig`` (LangGraph's graph factories take one; here it is empty, and the graph the
  factory returns serves every run).

A plain graph becomes a ``Workflow`` whose input model accepts the keys of the graph's input schema
(any JSON value, all optional) and whose version hashes its nodes, edges and state, like a
registered workflow's. Every problem is a :class:`ProjectError`: one line naming the file and entry.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import json
import logging
import os
import re
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from langgraph.graph import StateGraph
from pydantic import BaseModel, ConfigDict, create_model

from elesium.errors import UserError
from elesium.graphs.registry import Registry, Workflow
from elesium.graphs.versioning import graph_version

log = logging.getLogger("elesium.graphs")

CONFIG_NAME = "langgraph.json"
SUPPORTED_KEYS = ("dependencies", "graphs", "env")
# The rest of LangGraph's schema: build and platform settings that do not apply to an Elesium server.
IGNORED_KEYS = ("$schema", "python_version", "node_version", "pip_config_file", "pip_installer", "base_image",
                "image_distro", "dockerfile_lines", "store", "checkpointer", "auth", "encryption", "http",
                "ui", "ui_config", "keep_pkg_tools", "api_version", "webhooks", "middleware_order")


class ProjectError(UserError, ValueError):
    """The project file, or one of the graphs it names, cannot be served (one line, says which)."""


@dataclass(frozen=True)
class GraphSpec:
    """One ``graphs`` entry: its name, the spec as written, and where it points."""

    name: str
    spec: str
    target: str  # a file path (resolved) or a dotted module
    attr: str
    description: str | None = None

    @property
    def is_file(self) -> bool:
        return self.target.endswith(".py") or os.sep in self.target


@dataclass(frozen=True)
class ProjectConfig:
    """A parsed ``langgraph.json`` (nothing imported yet)."""

    path: Path
    graphs: list[GraphSpec]
    dependencies: list[Path]  # the local directories among ``dependencies``
    packages: list[str]  # the other entries (named, not installed)
    env: Path | dict[str, str] | None
    ignored: list[str] = field(default_factory=list)

    @property
    def root(self) -> Path:
        return self.path.parent

    def watched_files(self) -> list[Path]:
        """What ``elesium dev`` watches: this file, its env file, and the Python files under the
        project's directory and its local dependencies (not in hidden folders, venvs or caches)."""
        files = {self.path}
        if isinstance(self.env, Path):
            files.add(self.env)
        for spec in self.graphs:
            if spec.is_file:
                files.add(Path(spec.target))
        for folder in {self.root, *self.dependencies}:
            for path in folder.rglob("*.py"):
                parts = path.relative_to(folder).parts[:-1]
                skip = ("venv", "node_modules", "site-packages")
                if not any(p.startswith((".", "__pycache__")) or p in skip for p in parts):
                    files.add(path)
        return sorted(files)


@dataclass
class Project:
    """A loaded project: its config and a registry of its graphs."""

    config: ProjectConfig
    registry: Registry

    @property
    def names(self) -> list[str]:
        return [w.name for w in self.registry.list()]


def find_config(explicit: str | os.PathLike[str] | None, cwd: Path | None = None) -> Path | None:
    """The project file to use: ``explicit`` when given (a directory means its ``langgraph.json``),
    else ``./langgraph.json`` when present, else None (the built-in workflows)."""
    if explicit is not None:
        path = Path(explicit)
        return path / CONFIG_NAME if path.is_dir() else path
    default = (cwd or Path.cwd()) / CONFIG_NAME
    return default if default.is_file() else None


def read_config(path: str | os.PathLike[str]) -> ProjectConfig:
    """Parse and check ``path`` (a ``langgraph.json``) without importing anything."""
    path = Path(path).expanduser().resolve()
    where = str(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ProjectError(f"{where}: no such file") from None
    except OSError as exc:
        raise ProjectError(f"{where}: cannot read it: {exc.strerror}") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ProjectError(
            f"{where}: not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    if not isinstance(doc, dict):
        raise ProjectError(f"{where}: must be a JSON object, got {type(doc).__name__}")
    unknown = sorted(k for k in doc if k not in SUPPORTED_KEYS and k not in IGNORED_KEYS)
    if unknown:
        raise ProjectError(f"{where}: unknown key {unknown[0]!r} (supported: {', '.join(SUPPORTED_KEYS)})")
    graphs = doc.get("graphs")
    if not isinstance(graphs, dict) or not graphs:
        raise ProjectError(f"{where}: 'graphs' must be a non-empty object of name -> \"./file.py:attr\"")
    specs = [_graph_spec(where, path.parent, name, value) for name, value in graphs.items()]
    deps = doc.get("dependencies", [])
    if not isinstance(deps, list) or not all(isinstance(d, str) for d in deps):
        raise ProjectError(f"{where}: 'dependencies' must be a list of strings")
    local, packages = [], []
    for dep in deps:
        if dep.startswith((".", "/")):
            folder = (path.parent / dep).resolve()
            if not folder.is_dir():
                raise ProjectError(f"{where}: dependency {dep!r} is not a directory")
            local.append(folder)
        else:
            packages.append(dep)
    env = doc.get("env")
    env_value: Path | dict[str, str] | None
    if env is None:
        env_value = None
    elif isinstance(env, str):
        env_value = (path.parent / env).resolve()
        if not env_value.is_file():
            raise ProjectError(f"{where}: env file {env!r} not found")
    elif isinstance(env, dict) and all(isinstance(k, str) for k in env):
        env_value = {k: "" if v is None else str(v) for k, v in env.items()}
    else:
        raise ProjectError(f"{where}: 'env' must be a file path or an object of variables, "
                           f"got {type(env).__name__}")
    ignored = sorted(k for k in doc if k in IGNORED_KEYS and k != "$schema")
    return ProjectConfig(path=path, graphs=specs, dependencies=local, packages=packages, env=env_value,
                         ignored=ignored)


def _graph_spec(where: str, root: Path, name: Any, value: Any) -> GraphSpec:
    description = None
    if isinstance(value, dict):
        description = value.get("description")
        value = value.get("path")
    if not isinstance(value, str) or ":" not in value:
        raise ProjectError(f"{where}: graph {name!r}: expected \"./file.py:attr\" or \"module:attr\", "
                           f"got {json.dumps(value)}")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
        raise ProjectError(f"{where}: graph name {name!r} must be letters, digits, '-', '_' or '.'")
    target, _, attr = value.rpartition(":")
    if not target or not attr:
        raise ProjectError(f"{where}: graph {name!r}: expected \"./file.py:attr\", got {value!r}")
    if target.endswith(".py") or "/" in target or "\\" in target:
        target = str((root / target).resolve())
    return GraphSpec(name=name, spec=value, target=target, attr=attr,
                     description=description if isinstance(description, str) else None)


def load_project(path: str | os.PathLike[str]) -> Project:
    """Read ``path``, load its env and dependencies, import every graph and register it."""
    config = read_config(path)
    apply_env(config)
    for folder in reversed(config.dependencies):
        if str(folder) not in sys.path:
            sys.path.insert(0, str(folder))
    if config.ignored:
        log.info("%s: ignoring LangGraph platform settings %s", config.path, ", ".join(config.ignored))
    registry = Registry()
    for spec in config.graphs:
        registry.register(load_graph(config, spec))
    return Project(config=config, registry=registry)


def apply_env(config: ProjectConfig) -> None:
    """Set the project's variables; those already in the environment win (as python-dotenv's default)."""
    if config.env is None:
        return
    values = config.env if isinstance(config.env, dict) else parse_env_file(config.env)
    for key, value in values.items():
        os.environ.setdefault(key, value)


def parse_env_file(path: Path) -> dict[str, str]:
    """``KEY=value`` lines (``export`` prefix, quotes, ``#`` comments); what ``.env`` files hold."""
    values: dict[str, str] = {}
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        line = line.removeprefix("export ").strip()
        key, sep, value = line.partition("=")
        key = key.strip()
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise ProjectError(f"{path}: line {number} is not KEY=value")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        else:
            value = value.split(" #", 1)[0].rstrip()
        values[key] = value
    return values


def load_graph(config: ProjectConfig, spec: GraphSpec) -> Workflow:
    """Import one entry and make it a registered workflow named ``spec.name``."""
    what = f"{config.path}: graph {spec.name!r} ({spec.spec})"
    module = _import(what, spec)
    try:
        value = getattr(module, spec.attr)
    except AttributeError:
        raise ProjectError(f"{what}: {module.__name__} has no attribute {spec.attr!r}") from None
    except Exception as exc:  # noqa: BLE001 - a module __getattr__ of the user's: its error, named
        raise ProjectError(f"{what}: {_first_line(exc)}") from exc
    description = spec.description or _first_doc_line(module) or f"{spec.spec}"
    try:
        return as_workflow(spec.name, value, description=description)
    except ProjectError as exc:
        raise ProjectError(f"{what}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - the user's factory or graph failed: name the entry
        raise ProjectError(f"{what}: {_first_line(exc)}") from exc


def _import(what: str, spec: GraphSpec) -> ModuleType:
    try:
        if not spec.is_file:
            return importlib.import_module(spec.target)
        path = Path(spec.target)
        if not path.is_file():
            raise ProjectError(f"{what}: no file {path}")
        name = _module_name(path)
        existing = sys.modules.get(name)
        if existing is not None and Path(getattr(existing, "__file__", "") or "").resolve() == path:
            return existing
        module_spec = importlib.util.spec_from_file_location(name, path)
        if module_spec is None or module_spec.loader is None:
            raise ProjectError(f"{what}: cannot import {path}")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module  # typing.get_type_hints and pickling look the module up by name
        try:
            module_spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(name, None)
            raise
        return module
    except ProjectError:
        raise
    except Exception as exc:  # noqa: BLE001 - the user's module failed to import: name the entry
        raise ProjectError(f"{what}: import failed: {_first_line(exc)}") from exc


def _module_name(path: Path) -> str:
    """The dotted name a file has on ``sys.path`` (so ``import`` elsewhere finds the same module), else a
    private name unique to the file."""
    for entry in sys.path:
        try:
            rel = path.relative_to(Path(entry or ".").resolve())
        except (ValueError, OSError):
            continue
        parts = [*rel.parts[:-1], rel.stem]
        if all(p.isidentifier() for p in parts):
            return ".".join(parts)
    digest = abs(hash(str(path))) % 10**8
    return f"_elesium_project_{re.sub(r'[^0-9A-Za-z_]', '_', path.stem)}_{digest}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    line = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {line}" if line else type(exc).__name__


def _first_doc_line(module: ModuleType) -> str | None:
    doc = (module.__doc__ or "").strip()
    return doc.splitlines()[0] if doc else None


def as_workflow(name: str, value: Any, *, description: str) -> Workflow:
    """``value`` (a Workflow, a StateGraph, a compiled graph, or a factory of one) as a workflow ``name``."""
    if isinstance(value, Workflow):
        return value if value.name == name else dataclasses.replace(value, name=name, graph_id=name)
    if isinstance(value, StateGraph):
        return _plain(name, value, None, description)
    builder = getattr(value, "builder", None)
    if isinstance(builder, StateGraph) and hasattr(value, "copy") and hasattr(value, "invoke"):
        return _plain(name, builder, value, description)
    if hasattr(value, "invoke") and hasattr(value, "stream"):
        raise ProjectError(f"{type(value).__name__} is not a StateGraph (functional-API entrypoints and "
                           "other runnables are not supported: serve a StateGraph)")
    if inspect.isclass(value) or not callable(value):
        raise ProjectError(f"not a graph: got {type(value).__name__} (expected a StateGraph, a compiled "
                           "graph, an elesium Workflow, or a function returning one)")
    if inspect.iscoroutinefunction(value) or inspect.isasyncgenfunction(value):
        raise ProjectError("async graph factories are not supported: return the graph from a plain function")
    made = value(*_factory_args(value))
    if inspect.isawaitable(made) or hasattr(made, "__aenter__") or hasattr(made, "__enter__"):
        if inspect.iscoroutine(made):
            made.close()
        raise ProjectError("the factory returned an awaitable or context manager; return the graph itself")
    if callable(made) and not isinstance(made, (Workflow, StateGraph)) and not hasattr(made, "invoke"):
        raise ProjectError(f"the factory returned {type(made).__name__}, not a graph")
    return as_workflow(name, made, description=description)


def _factory_args(factory: Any) -> tuple[Any, ...]:
    """No argument, or an empty RunnableConfig when the factory requires one (LangGraph's signature)."""
    try:
        params = [p for p in inspect.signature(factory).parameters.values()
                  if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return ()
    if not params:
        return ()
    if len(params) > 1:
        raise ProjectError(f"a graph factory takes no argument or one config, not {len(params)}")
    return ({"configurable": {}},)


@dataclass(frozen=True)
class GraphWorkflow(Workflow):
    """A plain LangGraph graph served as a workflow. ``compiled``: the graph as the project compiled it
    (its compile options kept, its checkpointer replaced by the server's); None: compile the builder."""

    compiled: Any = field(default=None, repr=False, compare=False)

    def build(self, checkpointer: Any = None) -> Any:
        if self.compiled is None:
            return super().build(checkpointer)
        return self.compiled.copy(update={"checkpointer": checkpointer, "name": self.name})


class GraphInput(BaseModel):
    """A plain graph's input: its input schema's keys, any JSON, all optional; only the keys sent are
    passed on (a key left out is not reset to None in the state)."""

    model_config = ConfigDict(extra="forbid")

    def model_dump(self, **kwargs: Any) -> dict[str, Any]:
        kwargs.setdefault("exclude_unset", True)
        return super().model_dump(**kwargs)


def input_model_of(builder: StateGraph) -> type[BaseModel]:
    schema = getattr(builder, "input_schema", None) or builder.state_schema
    keys = _schema_keys(schema)
    # Named after the schema, not the graph: renaming an entry in langgraph.json keeps its version.
    title = f"{getattr(schema, '__name__', 'Graph')}Input"
    fields: dict[str, Any] = {key: (Any, None) for key in keys}
    return create_model(title, __base__=GraphInput, **fields)


def _schema_keys(schema: Any) -> list[str]:
    if hasattr(schema, "model_fields"):
        return list(schema.model_fields)
    try:
        return list(typing.get_type_hints(schema, include_extras=True))
    except Exception:  # noqa: BLE001 - unresolvable forward refs: the raw annotations
        return list(getattr(schema, "__annotations__", {}))


def _plain(name: str, builder: StateGraph, compiled: Any, description: str) -> Workflow:
    input_model = input_model_of(builder)
    if compiled is None:
        builder.compile()  # structural errors surface at load, not at the first run
    return GraphWorkflow(
        name=name,
        version=graph_version(builder, input_model),
        label=None,
        description=description,
        input_model=input_model,
        state_schema=builder.state_schema,
        graph_id=name,
        factory=lambda: builder,
        compiled=compiled,
    )


def project_registry(config: str | os.PathLike[str] | None) -> Registry:
    """The registry to serve: the project's graphs when ``config`` names a file, else the built-ins."""
    if config is None:
        from elesium.graphs.workflows import default_registry

        return default_registry()
    return load_project(config).registry


__all__ = ["CONFIG_NAME", "GraphSpec", "GraphWorkflow", "Project", "ProjectConfig", "ProjectError",
           "apply_env", "as_workflow", "find_config", "load_project", "project_registry", "read_config"]
