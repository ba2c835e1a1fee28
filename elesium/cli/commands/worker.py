"""``elesium worker``: execute background runs from the durable run queue until SIGTERM.

Any number of these (on any number of machines) share one queue through Redis: ``REDIS_URL``, a
``redis+cluster://`` URL for a Redis Cluster, or the embedded server on a single machine. On SIGTERM
or SIGINT the worker takes no new runs, lets in-flight ones finish for ``--grace`` seconds and hands
the rest back, so another worker resumes them from their last checkpoint within half a lease TTL.

``--executor module:factory`` picks what a run executes: ``factory(args, queue)`` returns the
callback ``execute(run_id, lease)``. The default runs the workflows through :mod:`elesium.graphs`
(:mod:`elesium.graphs.background`) and the runs created through the API: the graphs of ``--config
langgraph.json`` (or ``./langgraph.json``) as ``elesium serve`` sees them, else the built-in workflows. A
worker must see the same graphs as the servers that queue its runs, or it fails their runs as unknown.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

from elesium.cli.commands.common import add_model_args
from elesium.cli.projects import add_config_args, load_project_env, registry_from_args

DEFAULT_EXECUTOR = "elesium.cli.commands.worker:make_executor"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("worker", help="execute queued background runs (Redis Streams consumer group)",
                       description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, default=1, help="runs executed at once (default 1)")
    p.add_argument("--queue", default="default", help="queue name (default: default)")
    p.add_argument("--prefix", default="elesium:q", help="key prefix of the queue (default: elesium:q)")
    p.add_argument("--redis-url", default=None, help="default: $REDIS_URL, else the embedded Valkey server")
    p.add_argument("--lease-ttl", type=float, default=15.0,
                   help="seconds a claim lives without a heartbeat; a dead worker's runs resume after it")
    p.add_argument("--grace", type=float, default=30.0,
                   help="seconds in-flight runs get to finish on SIGTERM before they are handed back")
    p.add_argument("--max-attempts", type=int, default=5, help="claims per run before it is failed")
    p.add_argument("--executor", default=DEFAULT_EXECUTOR, help="module:factory building the run executor")
    p.add_argument("--worker-id", default=None, help="consumer name (default: host-pid-random)")
    p.add_argument("--self-tuning", action="store_true",
                   help="API runs use and learn per-node tree calibrations (also ELESIUM_SELF_TUNING=1); "
                   "give every server and worker of a deployment the same setting")
    add_model_args(p)
    add_config_args(p)
    p.set_defaults(handler=run)


def _factory(spec: str) -> Callable[[argparse.Namespace, Any], Any]:
    from elesium.cli.errors import CliError

    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise CliError(f"--executor must be module:factory, got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise CliError(f"--executor: cannot import {module_name!r} ({exc})") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise CliError(f"--executor: {module_name!r} has no callable {attr!r}")
    return factory


def make_executor(args: argparse.Namespace, queue: Any) -> Callable[[str, Any], str]:
    """The default executor: runs created through the API and runs submitted with
    :func:`elesium.graphs.background.submit`, on this machine's engine and the project's graphs (``--config``,
    as ``elesium serve``), else the built-in workflows."""
    from elesium.api.app import build_services
    from elesium.api.run_executor import ApiRunExecutor, Dispatcher
    from elesium.api.settings import ApiSettings, env_flag
    from elesium.cli.commands.common import load_engine
    from elesium.cli.errors import CliError
    from elesium.graphs.background import WorkflowExecutor
    from elesium.graphs.runner import WorkflowRunner

    try:
        self_tuning = env_flag("ELESIUM_SELF_TUNING") or bool(getattr(args, "self_tuning", False))
    except ValueError as exc:
        raise CliError(str(exc)) from None
    registry = registry_from_args(args)  # the project's graphs, imported before the model loads
    runner = WorkflowRunner(load_engine(args), args.redis_url, registry=registry)
    # Spans of the runs it executes, as `elesium serve` (the variable was checked at startup: cli/tracing.py).
    otel = os.environ.get("ELESIUM_OTEL_EXPORTER", "").strip().lower() or "none"
    settings = ApiSettings(redis_url=args.redis_url, self_tuning=self_tuning, otel_exporter=otel)
    services = build_services(settings, runner.engine, runner.registry)
    return Dispatcher(ApiRunExecutor(services), WorkflowExecutor(runner))


def _log_claims() -> None:
    """A worker is a service: each claim and outcome goes to stderr at INFO, with a timestamp, so an
    operator (or a failing crash test) can tell which process ran what and when. The CLI's own
    handler is reused when present (``elesium -v`` already logs everything at INFO)."""
    root = logging.getLogger("elesium")
    if not root.handlers:
        logging.basicConfig(format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for handler in root.handlers:
        handler.setFormatter(logging.Formatter("%(asctime)s elesium worker %(levelname)s: %(message)s"))
    logging.getLogger("elesium.worker").setLevel(logging.INFO)


def run(args: argparse.Namespace) -> int:
    from elesium.cli.errors import CliError
    from elesium.cli.heap import freeze_startup_heap
    from elesium.state.queue import RunQueue
    from elesium.state.queue_worker import QueueWorker

    if args.concurrency < 1:
        raise CliError(f"--concurrency must be >= 1, got {args.concurrency}")
    if args.lease_ttl < 0.5:
        raise CliError(f"--lease-ttl must be >= 0.5 seconds, got {args.lease_ttl}")
    if args.grace < 0:
        raise CliError(f"--grace must be >= 0 seconds, got {args.grace}")
    _log_claims()
    load_project_env(args)  # as `elesium serve`: the project's env before anything reads the environment
    factory = _factory(args.executor)

    def before_start(signum: int, _frame: Any) -> None:
        # A stop while the engine still loads: nothing is claimed yet, so exit cleanly at once.
        print("elesium worker: stopped before it started (0 runs finished, 0 handed back)",
              file=sys.stderr, flush=True)
        os._exit(0)

    signal.signal(signal.SIGTERM, before_start)
    signal.signal(signal.SIGINT, before_start)
    queue = RunQueue.from_url(args.redis_url, prefix=args.prefix, name=args.queue,
                              lease_ttl_ms=int(args.lease_ttl * 1000), max_attempts=args.max_attempts)
    execute = factory(args, queue)
    freeze_startup_heap()
    worker = QueueWorker(queue, execute, concurrency=args.concurrency, worker_id=args.worker_id)

    def on_signal(signum: int, _frame: Any) -> None:
        signal.signal(signum, signal.SIG_IGN)  # a second signal must not interrupt the hand-back
        handed = worker.stop(args.grace)
        print(f"elesium worker: stopped ({worker.completed} runs finished, {len(handed)} handed back)",
              file=sys.stderr, flush=True)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print(f"elesium worker {worker.worker_id}: queue {args.queue!r}, concurrency {args.concurrency}",
          file=sys.stderr, flush=True)
    worker.run_forever()
    if not worker.join(10.0):
        # An executor that ignores its lease (a long call that never checks) must not keep the process
        # alive past the deadline: its run was handed back and its writes are fenced off anyway.
        print("elesium worker: in-flight runs did not stop; exiting anyway", file=sys.stderr, flush=True)
        os._exit(0)
    return 0
