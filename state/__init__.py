"""Durable state: LangGraph checkpoints, the decode-step audit log and the run registry, in Redis.

``REDIS_URL`` selects the server (see :mod:`elesium.state.connection` for the accepted forms);
without it an embedded Valkey server runs in ``ELESIUM_DATA_DIR`` (:mod:`elesium.state.embedded`).
"""

from elesium.state.acceptance_log import (
    AcceptanceEntry,
    AcceptanceLog,
    AcceptanceSummary,
    LoggedStep,
    Retention,
)
from elesium.state.checkpointer import AsyncRedisSaver, RedisSaver
from elesium.state.connection import connect, connect_async, default_url, parse_redis_url
from elesium.state.embedded import EmbeddedValkey, shared_server
from elesium.state.errors import (
    EmbeddedServerError,
    InvalidTransitionError,
    RedisUnavailableError,
    RedisURLError,
    RunExistsError,
    RunNotFoundError,
    StateError,
    WrongTypeError,
)
from elesium.state.runs import RunRecord, RunRegistry, RunStatus, hash_input

__all__ = [
    "AcceptanceEntry",
    "AcceptanceLog",
    "AcceptanceSummary",
    "AsyncRedisSaver",
    "EmbeddedServerError",
    "EmbeddedValkey",
    "InvalidTransitionError",
    "LoggedStep",
    "RedisSaver",
    "RedisURLError",
    "RedisUnavailableError",
    "Retention",
    "RunExistsError",
    "RunNotFoundError",
    "RunRecord",
    "RunRegistry",
    "RunStatus",
    "StateError",
    "WrongTypeError",
    "connect",
    "connect_async",
    "default_url",
    "hash_input",
    "parse_redis_url",
    "shared_server",
]
