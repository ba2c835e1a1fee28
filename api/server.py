"""Running the app under uvicorn on a background thread (the demo and the tests; ``elesium serve`` runs it in
the foreground)."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class BackgroundServer:
    """uvicorn on a daemon thread; ``with BackgroundServer(app) as url:`` serves until the block ends."""

    def __init__(
        self, app: Any, host: str = "127.0.0.1", port: int | None = None, log_level: str = "warning"
    ) -> None:
        import uvicorn

        self.host, self.port = host, port or free_port(host)
        self.server = uvicorn.Server(uvicorn.Config(app, host=self.host, port=self.port, log_level=log_level))
        self.thread = threading.Thread(target=self.server.run, name="elesium-api", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 120.0) -> str:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError(f"the API server on {self.url} exited during start-up")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the API server on {self.url} did not start within {timeout:.0f} s")
            time.sleep(0.05)
        return self.url

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
