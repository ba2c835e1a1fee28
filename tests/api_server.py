"""The API tests' server: a real uvicorn on a free loopback port, the real model, embedded Valkey.

One server per test session (loaded by the API test modules with ``pytest_plugins``), with two
tenants' keys and the small workflows of :mod:`api_workflows`. Tests talk to it over HTTP only,
through langgraph-sdk, the openai client or httpx; they reach Redis directly only to tamper with
records (replay tests) or to prove that a refused request wrote nothing.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import redis

from api_workflows import build_registry
from state_fixtures import free_port

KEY_A, KEY_B = "key-alpha-0123456789", "key-beta-0123456789"


@dataclass
class LiveServer:
    url: str
    redis_url: str
    app: Any
    registry: Any

    def http(self, key: str | None = KEY_A, **kwargs: Any) -> httpx.Client:
        headers = {"x-api-key": key} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=120, **kwargs)

    def redis(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis_url)

    @property
    def services(self) -> Any:
        return self.app.state.services


@contextlib.contextmanager
def live_server(settings: Any, engine: Any, registry: Any) -> Iterator[LiveServer]:
    """``create_app(settings)`` under a real uvicorn on a free port, for the duration of the block."""
    import uvicorn

    from elesium.api.app import create_app

    app = create_app(settings, engine=engine, registry=registry)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="api-test-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the API test server did not start")
        time.sleep(0.05)
    try:
        yield LiveServer(url=f"http://127.0.0.1:{port}", redis_url=settings.redis_url, app=app,
                         registry=registry)
    finally:
        server.should_exit = True
        thread.join(30)


def server_settings(redis_url: str, **overrides: Any) -> Any:
    from elesium.api.settings import ApiSettings

    return ApiSettings(api_keys={KEY_A: "tenant-a", KEY_B: "tenant-b"}, redis_url=redis_url,
                       max_body_bytes=64_000, shutdown_grace_s=2.0, **overrides)


@pytest.fixture(scope="session")
def api_server(engine: Any, state_server: Any) -> Iterator[LiveServer]:
    with live_server(server_settings(state_server.url), engine, build_registry()) as server:
        yield server
