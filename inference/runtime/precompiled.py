"""Compiled step graphs saved to disk on first use, so a later process loads them instead of tracing.

Why: ``torch.compile`` keeps inductor's generated code in a persistent cache, but every new process
still runs dynamo's Python-level trace of the step (about 10 s a graph on 2 cores, design doc §7.1),
so a one-shot ``elesium generate`` or a new worker decoded its first tokens at a fraction of its
speed. torch's precompile API (``torch.compile(fn).aot_compile``, saved with
``save_compiled_function`` and read back with ``torch.compiler.load_compiled_function``) serialises
the traced and compiled function itself: loading it takes about as long as importing inductor, and
its first call is a steady-speed call.

What is saved is the graph, not the weights: the step functions take the model as their first
argument, so the parameters are inputs read from the live model at each call (the saved file is a
few MB beside ~60 MB of 4-bit weights). A saved graph computes bit for bit what the same graph
compiled in this process computes (``tests/test_precompiled.py``), so replay and exactness are not
affected by where a graph came from.

The file's name is a hash of everything the graph depends on: the function, the model's sha256 and
weight format, torch and Python versions, the CPU's vector ISA, the thread count, and the source of
this runtime package (a changed step function is a new graph). Loading skips dynamo's guards, which
on a reloaded function compare autograd dispatch keys that inference mode changes; this module
checks instead what the graph was specialised on (each tensor's dtype, static sizes, and the strides
that come from its storage: inductor compiles strides in as constants).
Anything that goes wrong (an unreadable file, a function the precompile API cannot save, a full
disk) falls back to the plain ``torch.compile`` path with a warning: a cache never breaks decoding.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

Dims = tuple[int | None, ...]
Signature = tuple[tuple[torch.dtype, Dims, Dims] | None, ...]


def _source_hash() -> str:
    """The source of every module of this package: a changed step function must not load an old graph."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).resolve().parent.glob("*.py")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _vector_isa() -> str:
    try:
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        return str(pick_vec_isa())
    except Exception:  # an inductor without this helper: the machine name still separates hosts
        return platform.machine()


@dataclass(frozen=True)
class PrecompileStore:
    """A directory of saved graphs for one model: ``identity`` names the weights they were traced on."""

    directory: Path
    identity: str

    def path(self, name: str) -> Path:
        parts = (name, self.identity, torch.__version__, sys.version, _vector_isa(),
                 str(torch.get_num_threads()), _source_hash())
        key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]
        return self.directory / f"{self.stem(name)}-{key}.bin"

    def stem(self, name: str) -> str:
        """What every saved version of ``name`` for this model starts with (older ones are pruned)."""
        return f"{name}-{hashlib.sha256(self.identity.encode()).hexdigest()[:12]}"


def signature(args: tuple[Any, ...]) -> Signature:
    """What a graph was specialised on: each tensor's dtype, its sizes (None where dynamic), and the
    strides that come from its storage rather than its shape (a window's, which follow the whole
    cache's length; None for the rest, which inductor derives from the sizes)."""
    out: list[tuple[torch.dtype, Dims, Dims] | None] = []
    for arg in args:
        if not isinstance(arg, torch.Tensor):
            out.append(None)
            continue
        dynamic: set[int] = getattr(arg, "_dynamo_dynamic_indices", set())
        sizes = tuple(None if d in dynamic else s for d, s in enumerate(arg.shape))
        strides = []
        for d, stride in enumerate(arg.stride()):
            packed = math.prod(arg.shape[d + 1:])
            strides.append(None if arg.shape[d] == 1 or stride == packed else stride)
        out.append((arg.dtype, sizes, tuple(strides)))
    return tuple(out)


def _fits(sig: Signature, args: tuple[Any, ...]) -> bool:
    if len(sig) != len(args):
        return False
    for want, arg in zip(sig, args, strict=True):
        if want is None:
            continue
        dtype, sizes, strides = want
        if not isinstance(arg, torch.Tensor) or arg.dtype != dtype or arg.dim() != len(sizes):
            return False
        if any(s is not None and s != got for s, got in zip(sizes, arg.shape, strict=True)):
            return False
        if any(s is not None and s != got for s, got in zip(strides, arg.stride(), strict=True)):
            return False
    return True


class PrecompiledFunction:
    """``torch.compile(fn, fullgraph=True, dynamic=False)``, saved in ``store`` after its first call.

    ``fn`` is a module-level function whose first argument is the model. The first call's arguments
    (with their ``mark_dynamic`` dimensions) are the example the graph is traced on, as with
    ``torch.compile``; later calls must match its specialisation, or they raise ``ValueError``. With no
    store this is plain ``torch.compile``. ``loaded`` says whether the graph came from disk.
    """

    def __init__(self, fn: Callable[..., Any], name: str, store: PrecompileStore | None) -> None:
        self.fn = fn
        self.name = name
        self.store = store
        self.loaded = False
        self._compiled: Callable[..., Any] | None = None
        self._signature: Signature | None = None
        self._lock = threading.Lock()

    def preload(self) -> bool:
        """Load the saved graph now, if there is one (True when loaded), so no call waits for it.

        Why: reading a saved graph back still costs seconds (inductor's imports and its compiled
        kernels); an engine does it while loading rather than inside the first request's decoding.
        """
        with self._lock:
            if self._compiled is None and self.store is not None:
                self._compiled = self._load(self.store.path(self.name))
            return self.loaded

    def __call__(self, *args: Any) -> Any:
        compiled = self._compiled
        if compiled is None:
            with self._lock:
                if self._compiled is None:
                    self._compiled = self._build(args)
                compiled = self._compiled
        sig = self._signature
        if sig is not None and not _fits(sig, args):
            raise ValueError(f"{self.name}: arguments {signature(args)} do not fit the graph's {sig}")
        return compiled(*args)

    def _build(self, args: tuple[Any, ...]) -> Callable[..., Any]:
        plain = torch.compile(self.fn, fullgraph=True, dynamic=False)
        if self.store is None:
            return plain
        path = self.store.path(self.name)
        loaded = self._load(path)
        if loaded is not None:
            return loaded
        try:
            compiled = plain.aot_compile((args, {}))  # type: ignore[attr-defined]
            compiled.disable_guard_check()
        except Exception as exc:
            log.warning("%s: the graph cannot be precompiled (%s); compiling it for this process only",
                        self.name, exc)
            return plain
        self._signature = signature(args)
        _save(compiled, self._signature, path, self.name)
        for old in path.parent.glob(self.store.stem(self.name) + "-*"):
            if old.stem != path.stem:  # this model's graph from an older torch or elesium: never loaded again
                old.unlink(missing_ok=True)
        return compiled  # type: ignore[no-any-return]

    def _load(self, path: Path) -> Callable[..., Any] | None:
        if not path.exists():
            return None
        try:
            sig = _read_signature(path.with_suffix(".json"))
            with path.open("rb") as fh:
                loaded: Any = torch.compiler.load_compiled_function(fh, f_globals=self.fn.__globals__)
            loaded.disable_guard_check()
        except Exception as exc:  # unreadable or from an incompatible build: compile a new one
            log.warning("%s: could not load %s (%s); compiling again", self.name, path, exc)
            path.unlink(missing_ok=True)
            return None
        self._signature, self.loaded = sig, True
        log.info("%s: loaded the compiled graph from %s", self.name, path)
        return loaded  # type: ignore[no-any-return]


def _read_signature(path: Path) -> Signature:
    rows = json.loads(path.read_text())
    return tuple(None if row is None else (getattr(torch, row[0]), tuple(row[1]), tuple(row[2]))
                 for row in rows)


def _save(compiled: Any, sig: Signature, path: Path, name: str) -> None:
    """Write atomically (temporary files, then renames; the graph last): a reader that finds the graph
    finds its signature beside it, whole."""
    tmps: list[str] = []
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        rows = [None if row is None else [str(row[0]).removeprefix("torch."), list(row[1]), list(row[2])]
                for row in sig]
        for target, write in ((path.with_suffix(".json"), lambda tmp: Path(tmp).write_text(json.dumps(rows))),
                              (path, compiled.save_compiled_function)):
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
            os.close(fd)
            tmps.append(tmp)
            write(tmp)
            os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the entry from other users of a shared cache
            os.replace(tmp, target)
        log.info("%s: saved the compiled graph to %s", name, path)
    except Exception as exc:  # a cache that cannot be written costs the next process a trace, nothing more
        log.warning("%s: could not save the compiled graph to %s (%s)", name, path, exc)
        for tmp in tmps:
            Path(tmp).unlink(missing_ok=True)
