"""Server settings: API keys and tenants, limits, state and tracing, read from the environment.

Keys come from ``ELESIUM_API_KEYS="key1=tenantA,key2=tenantB"`` or from the file named by
``ELESIUM_API_KEYS_FILE`` (one ``key=tenant`` per line, ``#`` comments). Auth is on unless the
caller says ``auth=False`` (``elesium serve --no-auth``), so a server started without keys refuses
everything but health checks instead of silently serving everyone.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path


def parse_api_keys(text: str) -> dict[str, str]:
    """``key=tenant`` pairs separated by commas or newlines -> {key: tenant}.

    Raises ValueError (one line) on an entry without ``=``, an empty key or tenant, or a key given twice.
    """
    keys: dict[str, str] = {}
    for raw in text.replace("\n", ",").split(","):
        entry = raw.split("#", 1)[0].strip()
        if not entry:
            continue
        key, sep, tenant = entry.partition("=")
        key, tenant = key.strip(), tenant.strip()
        if not sep or not key or not tenant:
            raise ValueError(f"API key entry {entry[:4]}... is not key=tenant")
        if key in keys:
            raise ValueError(f"API key {key[:4]}... is listed twice")
        keys[key] = tenant
    return keys


@dataclass
class ApiSettings:
    """What ``create_app`` needs besides the engine and the workflows.

    Attributes:
        api_keys: key -> tenant.
        auth: False only for local use (``--no-auth``); every request is then tenant ``default``.
        redis_url: state server (None: ``REDIS_URL``, else the embedded Valkey).
        max_body_bytes: larger request bodies answer 413 before they are parsed.
        max_prompt_tokens: larger chat prompts answer 400 (the context must also hold the reply).
        max_tokens_cap: upper bound of ``max_tokens`` on /v1/chat/completions.
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
    auth: bool = True
    redis_url: str | None = None
    max_body_bytes: int = 256_000
    max_prompt_tokens: int = 1536
    max_tokens_cap: int = 1024
    otel_exporter: str = "none"
    model_name: str = "elesium-smollm2-135m"
    queue_name: str = "default"
    workers: int = 1
    run_timeout_s: float = 0.0
    lease_ttl_s: float = 15.0
    shutdown_grace_s: float = 30.0
    self_tuning: bool = False

    @classmethod
    def from_env(cls, *, auth: bool = True, redis_url: str | None = None) -> ApiSettings:
        keys: dict[str, str] = {}
        path = os.environ.get("ELESIUM_API_KEYS_FILE")
        if path:
            keys.update(parse_api_keys(Path(path).read_text()))
        if os.environ.get("ELESIUM_API_KEYS"):
            keys.update(parse_api_keys(os.environ["ELESIUM_API_KEYS"]))
        exporter = os.environ.get("ELESIUM_OTEL_EXPORTER", "none").strip().lower() or "none"
        if exporter not in ("none", "console", "otlp"):
            raise ValueError(f"ELESIUM_OTEL_EXPORTER={exporter!r}: use console, otlp or none")
        return cls(
            api_keys=keys,
            auth=auth,
            redis_url=redis_url or os.environ.get("REDIS_URL"),
            otel_exporter=exporter,
            self_tuning=env_flag("ELESIUM_SELF_TUNING"),
        )


def env_flag(name: str) -> bool:
    """An on/off environment variable; anything but the usual spellings is an error, not "off"."""
    raw = os.environ.get(name, "").strip().lower()
    if raw in ("", "0", "false", "off", "no"):
        return False
    if raw in ("1", "true", "on", "yes"):
        return True
    raise ValueError(f"{name}={raw!r}: use 1/true/on or 0/false/off")
