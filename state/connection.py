"""Turning ``REDIS_URL`` into a client, or starting the embedded server when there is none.

Accepted URLs (checked here, so a typo fails at start-up with :class:`RedisURLError` rather than
as a confusing socket error on the first checkpoint):

* ``redis://[user:password@]host[:port][/db]`` plain TCP (port 6379 by default);
* ``rediss://...`` the same over TLS;
* ``unix:///absolute/path/to/redis.sock[?db=N]`` a local socket;
* ``redis+cluster://[user:password@]host:port`` (or ``rediss+cluster://`` for TLS) a Redis Cluster,
  reached through any one of its nodes. The ``+cluster`` scheme was chosen over a ``?cluster=true``
  query so that the topology is visible at a glance and cannot be lost when a query string is
  rewritten. A cluster only has database 0, so a ``/db`` path is rejected.

Query arguments that redis-py understands (``socket_connect_timeout``, ``ssl_cert_reqs``, ...) pass
through and override the defaults below. The defaults keep an unreachable server from hanging a
caller: a 1 s connect timeout, one retry, and a PING at connect time (answer within 2 s) so that
the error surfaces where the URL was given.

Without a URL, :func:`default_url` starts (or re-attaches to) the embedded Valkey server of
:mod:`elesium.state.embedded` in ``Settings.data_dir``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import parse_qs, urlsplit, urlunsplit

import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.cluster
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from elesium.config import Settings
from elesium.state.errors import RedisUnavailableError, RedisURLError, unavailable_message

TargetKind = Literal["tcp", "tls", "unix", "cluster"]

DEFAULT_CONNECT_TIMEOUT_S = 1.0
DEFAULT_SOCKET_TIMEOUT_S = 10.0

_SCHEMES: dict[str, tuple[TargetKind, str]] = {
    "redis": ("tcp", "redis"),
    "rediss": ("tls", "rediss"),
    "unix": ("unix", "unix"),
    "redis+cluster": ("cluster", "redis"),
    "rediss+cluster": ("cluster", "rediss"),
}


@dataclass(frozen=True)
class RedisTarget:
    """A validated server address.

    Attributes:
        kind: how to connect: plain TCP, TLS, unix socket or cluster.
        client_url: the URL in the form redis-py's ``from_url`` expects.
        display: the URL with any password masked, safe for logs and error messages.
    """

    kind: TargetKind
    client_url: str
    display: str


def _mask(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


def parse_redis_url(url: str) -> RedisTarget:
    """Validate ``url`` and say precisely what is wrong with it if it is not usable.

    Raises:
        RedisURLError: unknown scheme, missing host or socket path, bad port or database number,
            or a database number on a cluster URL.
    """
    if not isinstance(url, str) or not url.strip():
        raise RedisURLError("The Redis URL is empty. Set REDIS_URL to e.g. redis://localhost:6379/0, "
                            "or unset it to use the embedded Valkey server.")
    url = url.strip()
    shown = _mask(url)
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in _SCHEMES:
        raise RedisURLError(
            f"Unsupported Redis URL scheme {parts.scheme!r} in {shown!r}. Use one of "
            "redis://host:port/db, rediss://host:port/db (TLS), unix:///path/to.sock, "
            "redis+cluster://host:port or rediss+cluster://host:port."
        )
    kind, client_scheme = _SCHEMES[scheme]
    if kind == "unix":
        if not parts.path or not parts.path.startswith("/"):
            raise RedisURLError(
                f"The unix socket URL {shown!r} has no absolute socket path. Write it as "
                "unix:///absolute/path/to/redis.sock (three slashes)."
            )
        db = parse_qs(parts.query).get("db", ["0"])[0]
        if not db.isdigit():
            raise RedisURLError(f"The database in {shown!r} must be a non-negative integer, got {db!r}.")
        return RedisTarget(kind=kind, client_url=url, display=shown)
    try:
        port = parts.port
    except ValueError:
        raise RedisURLError(
            f"The port in {shown!r} is not a number between 1 and 65535; fix the host:port part."
        ) from None
    if not parts.hostname:
        raise RedisURLError(f"The Redis URL {shown!r} has no host. Write it as {scheme}://host:port.")
    if port == 0:
        raise RedisURLError(f"Port 0 in {shown!r} cannot be connected to; give the server's port.")
    db_path = parts.path.lstrip("/")
    if db_path and not db_path.isdigit():
        raise RedisURLError(
            f"The database in {shown!r} must be a non-negative integer (the /N after host:port), "
            f"got {db_path!r}."
        )
    if kind == "cluster" and db_path not in ("", "0"):
        raise RedisURLError(
            f"{shown!r} selects database {db_path}, but a Redis Cluster only has database 0; "
            "drop the /N path."
        )
    client_url = urlunsplit(parts._replace(scheme=client_scheme))
    return RedisTarget(kind=kind, client_url=client_url, display=shown)


def _client_kwargs(overrides: dict[str, Any]) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "socket_connect_timeout": DEFAULT_CONNECT_TIMEOUT_S,
        "socket_timeout": DEFAULT_SOCKET_TIMEOUT_S,
        "retry": Retry(ExponentialBackoff(cap=0.2, base=0.02), 1),
    }
    kwargs.update(overrides)
    return kwargs


def connect(url: str, *, ping: bool = True, **overrides: Any) -> redis.Redis | redis.cluster.RedisCluster:
    """A synchronous client for ``url``, checked with a PING unless ``ping`` is False.

    Replies are bytes (``decode_responses`` off): checkpoints are binary.

    Raises:
        RedisURLError: the URL is malformed.
        RedisUnavailableError: the server refused, timed out, or rejected the credentials.
    """
    target = parse_redis_url(url)
    kwargs = _client_kwargs(overrides)
    try:
        client: redis.Redis | redis.cluster.RedisCluster
        if target.kind == "cluster":
            # Discovering the slots already talks to the node, with the timeouts above.
            client = redis.cluster.RedisCluster.from_url(target.client_url, **kwargs)
        else:
            if ping:
                _probe(target.client_url, kwargs["socket_connect_timeout"])
            client = redis.Redis.from_url(target.client_url, **kwargs)
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError,
            redis.exceptions.RedisClusterException, OSError) as exc:
        raise RedisUnavailableError(unavailable_message(target.display, exc)) from exc
    except redis.exceptions.InvalidResponse as exc:
        raise RedisUnavailableError(
            f"Something answers at {target.display}, but not in the Redis protocol ({exc}); "
            "REDIS_URL probably names the wrong host or port."
        ) from exc
    return client


def _probe(client_url: str, connect_timeout: float) -> None:
    """PING once with short timeouts, so a server that accepts but never answers cannot stall us.

    The long-lived client keeps the longer ``socket_timeout`` that big scripts may need.
    """
    with redis.Redis.from_url(
        client_url, socket_connect_timeout=connect_timeout, socket_timeout=max(2 * connect_timeout, 1.0),
        retry=Retry(ExponentialBackoff(cap=0.1, base=0.01), 0),
    ) as probe:
        probe.ping()


def connect_async(
    url: str, **overrides: Any
) -> redis.asyncio.Redis | redis.asyncio.cluster.RedisCluster:
    """An asyncio client for ``url``. Nothing is sent until first use (construction is sync).

    Raises:
        RedisURLError: the URL is malformed.
    """
    target = parse_redis_url(url)
    kwargs = _client_kwargs(overrides)
    if target.kind == "cluster":
        return redis.asyncio.cluster.RedisCluster.from_url(target.client_url, **kwargs)
    return redis.asyncio.Redis.from_url(target.client_url, **kwargs)


def describe(url: str) -> str:
    """``url`` with its password masked, for messages."""
    return _mask(url)


def default_url(settings: Settings | None = None) -> str:
    """``REDIS_URL`` if set, otherwise the URL of the embedded server (started if needed).

    The embedded server started here is stopped cleanly when the process exits; one left running
    by a crashed process is re-used (see :mod:`elesium.state.embedded`).
    """
    settings = settings or Settings.from_env()
    if settings.redis_url:
        return settings.redis_url
    from elesium.state.embedded import shared_server

    return shared_server(settings.data_dir, appendfsync=settings.appendfsync,
                         binary=settings.valkey_server).url
