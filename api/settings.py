"""Server settings: API keys and tenants, limits, state and tracing, read from the environment.

Keys come from ``ELESIUM_API_KEYS="key1=tenantA,key2=tenantB:reader"`` or from the file named by
``ELESIUM_API_KEYS_FILE`` (one ``key=tenant[:role+role...]`` per line, ``#`` comments). A key given
roles (``reader``, ``operator``, ``approver``, ``auditor``, ``admin``; see :mod:`elesium.api.auth`)
may do only what they allow; a key without roles keeps full access, as before roles existed. Auth is
on unless the caller says ``auth=False`` (``elesium serve --no-auth``), so a server started without
keys refuses everything but health checks instead of silently serving everyone.

Deleted threads keep their audit records for ``audit_retention_days``
(``ELESIUM_AUDIT_RETENTION_DAYS``, default 30; 0 deletes them with the thread, as before retention).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

ROLES = ("reader", "operator", "approver", "auditor", "admin")
"""The roles a key may carry (what each allows: :mod:`elesium.api.auth`)."""


def _entries(text: str) -> list[tuple[str, str, frozenset[str] | None]]:
    """``key=tenant[:role+role]`` entries separated by commas or newlines -> (key, tenant, roles or None)."""
    out: list[tuple[str, str, frozenset[str] | None]] = []
    seen: set[str] = set()
    for raw in text.replace("\n", ",").split(","):
        entry = raw.split("#", 1)[0].strip()
        if not entry:
            continue
        key, sep, rest = entry.partition("=")
        tenant, colon, role_text = rest.partition(":")
        key, tenant = key.strip(), tenant.strip()
        if not sep or not key or not tenant:
            raise ValueError(f"API key entry {entry[:4]}... is not key=tenant")
        roles: frozenset[str] | None = None
        if colon:
            names = [r.strip().lower() for r in role_text.split("+")]
            unknown = [r for r in names if r not in ROLES]
            if unknown or not names:
                raise ValueError(
                    f"API key {key[:4]}...: role {unknown[0] if unknown else ''!r} is not one of "
                    f"{', '.join(ROLES)} (write key=tenant:role+role)"
                )
            roles = frozenset(names)
        if key in seen:
            raise ValueError(f"API key {key[:4]}... is listed twice")
        seen.add(key)
        out.append((key, tenant, roles))
    return out


def parse_api_keys(text: str) -> dict[str, str]:
    """``key=tenant[:roles]`` pairs separated by commas or newlines -> {key: tenant}.

    Raises ValueError (one line) on an entry without ``=``, an empty key or tenant, an unknown role, or
    a key given twice.
    """
    return {key: tenant for key, tenant, _ in _entries(text)}


def parse_api_key_roles(text: str) -> dict[str, frozenset[str]]:
    """The roles of the keys that name some (``key=tenant:reader+approver``): {key: roles}. A key
    without roles is absent: it keeps full access."""
    return {key: roles for key, _, roles in _entries(text) if roles is not None}


@dataclass
class ApiSettings:
    """What ``create_app`` needs besides the engine and the workflows.

    Attributes:
        api_keys: key -> tenant.
        api_key_roles: key -> its roles, for keys that name some; a key absent here has every role
            (full access, as before roles existed).
        audit_retention_days: how long a deleted thread's records (checkpoints, runs, LLM calls,
            acceptance log, replay reports, audit chain) are kept for audit before they are purged
            (0: deleted with the thread, as before retention). A legal hold keeps them past it.
        audit_sweep_interval_s: how often the server purges threads whose retention has expired
            (0: never by itself; ``Services.purge_expired`` / ``POST /elesium/audit/purge-expired``).
        auth: False only for local use (``--no-auth``); every request is then tenant ``default``.
        redis_url: state server (None: ``REDIS_URL``, else the embedded Valkey).
        max_body_bytes: larger request bodies answer 413 before they are parsed
            (``ELESIUM_MAX_BODY_BYTES``, ``serve --max-body-bytes``; default 256,000).
        max_prompt_tokens: a server limit on /v1/chat/completions prompts (``ELESIUM_MAX_PROMPT_TOKENS``,
            ``serve --max-prompt-tokens``). None (the default; 0 in the environment): no limit of its
            own, so a prompt may use the model's context less the request's ``max_tokens``, the room
            the reply needs, which applies in any case. The smaller of the two is the one enforced
            and the one a refusal names.
        max_tokens_cap: upper bound of ``max_tokens`` on /v1/chat/completions (``ELESIUM_MAX_TOKENS_CAP``,
            ``serve --max-tokens-cap``; default 1,024): bounds how long one request holds the engine,
            which serves every run and chat in FIFO order.
        otel_exporter: "none" (default), "console" or "otlp".
        model_name: the id /v1/models reports for the loaded model.
        queue_name: the durable run queue this server's runs go to (its workers and ``elesium worker
            --queue`` take them from there).
        workers: queue workers this server runs in-process (0: only ``elesium worker`` processes
            execute its runs).
        run_timeout_s: a run still executing after this long is stopped and recorded ``timeout``
            (0: no limit).
        lease_ttl_s: how long a run's claim lives without a heartbeat (a dead worker's runs resume
            on another after about this long).
        shutdown_grace_s: on shutdown, how long in-flight runs get to finish before they are handed
            back to the queue (resumed by another worker from their last checkpoint).
        self_tuning: LLM nodes of API runs start from their per-node tree calibration and succeeded
            runs feed it (graphs/calibration.py: new estimates are trialled before adoption). Off by
            default: then every API run decodes with the engine's global policy, and two runs with
            the same input and seed give the same tokens even at T > 0. On or off, each run records
            the version each node used, and replays use the recorded ones.
    """

    api_keys: dict[str, str] = field(default_factory=dict)
    api_key_roles: dict[str, frozenset[str]] = field(default_factory=dict)
    auth: bool = True
    redis_url: str | None = None
    max_body_bytes: int = 256_000
    max_prompt_tokens: int | None = None
    max_tokens_cap: int = 1024
    otel_exporter: str = "none"
    model_name: str = "elesium-smollm2-135m"
    queue_name: str = "default"
    workers: int = 1
    run_timeout_s: float = 0.0
    lease_ttl_s: float = 15.0
    shutdown_grace_s: float = 30.0
    self_tuning: bool = False
    audit_retention_days: float = 30.0
    audit_sweep_interval_s: float = 3600.0

    @classmethod
    def from_env(cls, *, auth: bool = True, redis_url: str | None = None) -> ApiSettings:
        keys: dict[str, str] = {}
        roles: dict[str, frozenset[str]] = {}
        texts = []
        path = os.environ.get("ELESIUM_API_KEYS_FILE")
        if path:
            texts.append(Path(path).read_text())
        if os.environ.get("ELESIUM_API_KEYS"):
            texts.append(os.environ["ELESIUM_API_KEYS"])
        for text in texts:  # the variable overrides the file, key by key (roles included)
            parsed = parse_api_keys(text)
            keys.update(parsed)
            for key in parsed:
                roles.pop(key, None)
            roles.update(parse_api_key_roles(text))
        retention = env_number("ELESIUM_AUDIT_RETENTION_DAYS", 30.0)
        exporter = os.environ.get("ELESIUM_OTEL_EXPORTER", "none").strip().lower() or "none"
        if exporter not in ("none", "console", "otlp"):
            raise ValueError(f"ELESIUM_OTEL_EXPORTER={exporter!r}: use console, otlp or none")
        return cls(
            api_keys=keys,
            api_key_roles=roles,
            auth=auth,
            redis_url=redis_url or os.environ.get("REDIS_URL"),
            otel_exporter=exporter,
            self_tuning=env_flag("ELESIUM_SELF_TUNING"),
            audit_retention_days=retention,
            max_body_bytes=env_int("ELESIUM_MAX_BODY_BYTES", cls.max_body_bytes),
            max_prompt_tokens=env_int("ELESIUM_MAX_PROMPT_TOKENS", 0) or None,
            max_tokens_cap=env_int("ELESIUM_MAX_TOKENS_CAP", cls.max_tokens_cap, minimum=1),
        )


def env_number(name: str, default: float) -> float:
    """A non-negative number from the environment (``default`` when unset); anything else is an error."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: use a number >= 0") from None
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"{name}={raw!r}: use a number >= 0")
    return value


def env_int(name: str, default: int, *, minimum: int = 0) -> int:
    """A whole number >= ``minimum`` from the environment (``default`` when unset); anything else is an
    error naming the variable."""
    raw = os.environ.get(name, "").strip().replace("_", "")
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: use a whole number >= {minimum}") from None
    if value < minimum:
        raise ValueError(f"{name}={raw!r}: use a whole number >= {minimum}")
    return value


def env_flag(name: str) -> bool:
    """An on/off environment variable; anything but the usual spellings is an error, not "off"."""
    raw = os.environ.get(name, "").strip().lower()
    if raw in ("", "0", "false", "off", "no"):
        return False
    if raw in ("1", "true", "on", "yes"):
        return True
    raise ValueError(f"{name}={raw!r}: use 1/true/on or 0/false/off")
