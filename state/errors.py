"""Exceptions of the state layer, one per thing an operator can fix.

redis-py reports every failure as ``ConnectionError`` or ``ResponseError`` with the server's text;
that tells a developer what happened but not an operator what to change. Each type here names the
cause (a malformed ``REDIS_URL``, a server that cannot be reached, a foreign value squatting on one
of our keys, an embedded server that would not start) and its message ends with what to do.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import redis.exceptions


class StateError(Exception):
    """Base class: anything the state layer raises on purpose."""


class RedisURLError(StateError, ValueError):
    """``REDIS_URL`` (or a URL passed in code) cannot be understood."""


class RedisUnavailableError(StateError, ConnectionError):
    """The server did not answer within the connect timeout, or refused the connection."""


class WrongTypeError(StateError, TypeError):
    """A key in Elesium's layout holds a value of another type (Redis ``WRONGTYPE``)."""


class EmbeddedServerError(StateError, RuntimeError):
    """The embedded Valkey server could not be started, reached or stopped."""


class RunNotFoundError(StateError, KeyError):
    """A run id that the registry has never seen (or that has expired)."""


class RunExistsError(StateError, ValueError):
    """``create`` was called for a run id that is already registered."""


class InvalidTransitionError(StateError, ValueError):
    """A status change the run lifecycle does not allow (e.g. out of a terminal state)."""


def wrongtype_message(where: str) -> str:
    """The message for a WRONGTYPE reply while touching the keys described by ``where``."""
    return (
        f"Redis returned WRONGTYPE while Elesium was using {where}: a key there holds a value of "
        "another type, so another application (or an older Elesium layout) shares this keyspace. "
        "Point Elesium at its own database (e.g. redis://host:6379/2), or pass a distinct key "
        "`prefix=`, or delete the conflicting keys if they are leftovers."
    )


def unavailable_message(target: str, exc: BaseException) -> str:
    """The message for a server that could not be reached at ``target``."""
    return (
        f"Cannot reach the Redis server at {target}: {exc}. Check that it is running and that "
        "REDIS_URL (host, port, socket path, TLS scheme, password) is right; unset REDIS_URL to use "
        "the embedded Valkey server instead."
    )


@contextlib.contextmanager
def translate_errors(where: str, target: str = "the configured server") -> Iterator[None]:
    """Re-raise redis-py's failures inside the block as this module's exception types.

    Works around both sync and awaited calls, since it only inspects the exception.

    Args:
        where: the keys the block touches, for the WRONGTYPE message.
        target: the server address, for the unreachable message.
    """
    try:
        yield
    except redis.exceptions.ResponseError as exc:
        if "WRONGTYPE" in str(exc):
            raise WrongTypeError(wrongtype_message(where)) from exc
        raise
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
        raise RedisUnavailableError(unavailable_message(target, exc)) from exc
    except redis.exceptions.InvalidResponse as exc:
        raise RedisUnavailableError(
            f"Something answers at {target}, but not in the Redis protocol ({exc}); "
            "REDIS_URL probably names the wrong host or port."
        ) from exc


class LeaseLostError(StateError):
    """Another worker claimed the run (a higher fencing token exists); this executor must stop.

    Here rather than in ``queue.py`` because the fenced writers (``fenced.py``) raise it too, and the
    queue builds those writers: neither module imports the other's errors."""
