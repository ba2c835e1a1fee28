"""Python SDK of the Elesium API, sync and async.

The LangGraph-protocol parts (assistants, threads, runs, streaming, interrupts) are langgraph-sdk's
own clients, exposed as ``.assistants``, ``.threads`` and ``.runs`` unchanged, so LangGraph code and
docs apply as they are. This module adds only what the protocol lacks: the acceptance log, audit
replay, and the caller's tenant.

Example:
    >>> from elesium.api.client import ElesiumClient
    >>> with ElesiumClient("http://127.0.0.1:8123", api_key="key1") as client:  # doctest: +SKIP
    ...     thread = client.threads.create()
    ...     for part in client.runs.stream(thread["thread_id"], "ticket-triage", input={...},
    ...                                    stream_mode=["updates", "messages-tuple"]):
    ...         print(part.event)
    ...     run = client.runs.list(thread["thread_id"])[0]
    ...     print(client.acceptance(thread["thread_id"], run["run_id"])["summary"]["tau"])
    ...     print(client.replay(thread["thread_id"], run["run_id"])["verdict"])
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any, Literal

import httpx
from langgraph_sdk import get_client, get_sync_client

ReplayMode = Literal["reexecute", "recorded"]


class ElesiumAPIError(Exception):
    """An Elesium route answered 4xx/5xx; ``status`` and the server's ``detail`` are kept."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(f"HTTP {status}: {detail}")
        self.status = status
        self.detail = detail


def _check(response: httpx.Response) -> Any:
    if response.status_code >= 400:
        try:
            detail = response.json().get("detail", response.text)
        except ValueError:
            detail = response.text
        raise ElesiumAPIError(response.status_code, str(detail))
    return response.json() if response.content else None


def _headers(api_key: str | None) -> dict[str, str]:
    return {"x-api-key": api_key} if api_key else {}


class ElesiumClient:
    """Synchronous client: langgraph-sdk's sync client plus Elesium's routes.

    Args:
        url: the server, e.g. ``http://127.0.0.1:8123``.
        api_key: sent as ``x-api-key`` (None: langgraph-sdk reads its environment variables; Elesium
            routes then go without a key).
        timeout: seconds for Elesium routes (a replay re-runs the whole thread on the engine).
    """

    def __init__(self, url: str, api_key: str | None = None, *, timeout: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self.langgraph = get_sync_client(url=self.url, api_key=api_key)
        self.assistants = self.langgraph.assistants
        self.threads = self.langgraph.threads
        self.runs = self.langgraph.runs
        self._http = httpx.Client(base_url=self.url, headers=_headers(api_key), timeout=timeout)

    def __enter__(self) -> ElesiumClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()
        self.langgraph.close()

    def whoami(self) -> dict[str, Any]:
        """The tenant (and key id) the server maps this client's key to."""
        return _check(self._http.get("/elesium/whoami"))

    def health(self) -> bool:
        return self._http.get("/healthz").status_code == 200

    def ready(self) -> dict[str, Any]:
        r = self._http.get("/readyz")
        return {"ready": r.status_code == 200, **r.json()}

    def acceptance(
        self, thread_id: str, run_id: str, *, limit: int = 100, cursor: str | None = None
    ) -> dict[str, Any]:
        """One page of the run's acceptance log, with its summary (tau, per depth, per node)."""
        params: dict[str, Any] = {"limit": limit}
        if cursor:
            params["cursor"] = cursor
        return _check(self._http.get(f"/threads/{thread_id}/runs/{run_id}/acceptance", params=params))

    def acceptance_entries(self, thread_id: str, run_id: str, *, page: int = 500) -> Iterator[dict[str, Any]]:
        """Every entry of the run's acceptance log, page by page."""
        cursor: str | None = None
        while True:
            body = self.acceptance(thread_id, run_id, limit=page, cursor=cursor)
            yield from body["entries"]
            cursor = body["next_cursor"]
            if not cursor:
                return

    def replay(self, thread_id: str, run_id: str, mode: ReplayMode = "reexecute") -> dict[str, Any]:
        """Replay the run (see :mod:`elesium.graphs.replay`); returns the stored report with its verdict."""
        return _check(self._http.post(f"/threads/{thread_id}/runs/{run_id}/replay", json={"mode": mode}))

    def replays(self, thread_id: str, run_id: str) -> list[dict[str, Any]]:
        return _check(self._http.get(f"/threads/{thread_id}/runs/{run_id}/replays"))


class AsyncElesiumClient:
    """Asynchronous twin of :class:`ElesiumClient` (langgraph-sdk's async client plus Elesium's routes)."""

    def __init__(self, url: str, api_key: str | None = None, *, timeout: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self.langgraph = get_client(url=self.url, api_key=api_key)
        self.assistants = self.langgraph.assistants
        self.threads = self.langgraph.threads
        self.runs = self.langgraph.runs
        self._http = httpx.AsyncClient(base_url=self.url, headers=_headers(api_key), timeout=timeout)

    async def __aenter__(self) -> AsyncElesiumClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()
        await self.langgraph.aclose()

    async def whoami(self) -> dict[str, Any]:
        return _check(await self._http.get("/elesium/whoami"))

    async def acceptance(
        self, thread_id: str, run_id: str, *, limit: int = 100, cursor: str | None = None
    ) -> dict[str, Any]:
        params: dict[str, Any] = {"limit": limit}
        if cursor:
            params["cursor"] = cursor
        return _check(await self._http.get(f"/threads/{thread_id}/runs/{run_id}/acceptance", params=params))

    async def acceptance_entries(
        self, thread_id: str, run_id: str, *, page: int = 500
    ) -> AsyncIterator[dict[str, Any]]:
        cursor: str | None = None
        while True:
            body = await self.acceptance(thread_id, run_id, limit=page, cursor=cursor)
            for entry in body["entries"]:
                yield entry
            cursor = body["next_cursor"]
            if not cursor:
                return

    async def replay(self, thread_id: str, run_id: str, mode: ReplayMode = "reexecute") -> dict[str, Any]:
        return _check(
            await self._http.post(f"/threads/{thread_id}/runs/{run_id}/replay", json={"mode": mode})
        )

    async def replays(self, thread_id: str, run_id: str) -> list[dict[str, Any]]:
        return _check(await self._http.get(f"/threads/{thread_id}/runs/{run_id}/replays"))
