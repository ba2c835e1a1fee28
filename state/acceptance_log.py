"""The per-run audit trail of speculative decoding: one Redis Stream entry per decode step.

Audit replay re-executes a run and compares it with what the engine recorded, step by step, so
every decode step is appended here together with where it came from (run, graph node, run-wide
step number). A Stream fits: append-only, ordered by time-based ids, cheap range reads, and built-in
trimming.

The step itself is stored as :class:`LoggedStep`, this module's own copy of the record's fields,
not the engine's type: the state layer must not import the engine (the dependency goes the other
way round, through the graphs layer), and the stream's format is what this module promises to read
back for as long as runs may be replayed. An entry accepts the engine's record, or any object with a
``to_dict()`` of the same fields, or a plain mapping, and reads back as :class:`LoggedStep`, whose
attributes and ``to_dict()`` are the engine record's.

Retention is explicit because a stream otherwise grows forever: :class:`Retention` either caps
the length (``XADD MAXLEN``) or drops entries older than an age (``XADD MINID``, computed from
this host's clock, so keep hosts NTP-synced). ``approximate=True`` (``~``) lets the server trim
whole radix-tree nodes, which is much cheaper and may keep slightly more entries than asked.

Keys: ``<prefix>:{<run_id>}``, so a run's stream maps to one cluster slot and a batch append is
one MULTI/EXEC.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal
from urllib.parse import quote

from pydantic import BaseModel, ConfigDict, Field, field_serializer, field_validator

from elesium.state.audit_chain import ChainHooks, digest_json
from elesium.state.connection import connect, default_url, describe
from elesium.state.errors import translate_errors

DEFAULT_PREFIX = "elesium:acc"
_SCHEMA = "1"

# KEYS: stream (, marker set). ARGV: trim strategy ('' = untrimmed, MAXLEN or MINID), '~' or '=', its
# threshold, marker member ('' = none), then per entry: n, then n field/value args. All entries or none:
# a crash cannot leave half a batch. With a marker, the batch is written only if the member was not in
# the set yet, and the member is added in the same step: "recorded once" cannot be marked without its
# entries, nor the entries written twice.
APPEND_SCRIPT = r"""
if ARGV[4] ~= '' and redis.call('SADD', KEYS[2], ARGV[4]) == 0 then return {} end
local ids, i = {}, 5
while i <= #ARGV do
  local n = tonumber(ARGV[i])
  if ARGV[1] ~= '' then
    ids[#ids + 1] = redis.call('XADD', KEYS[1], ARGV[1], ARGV[2], ARGV[3], '*', unpack(ARGV, i + 1, i + n))
  else
    ids[#ids + 1] = redis.call('XADD', KEYS[1], '*', unpack(ARGV, i + 1, i + n))
  end
  i = i + n + 1
end
return ids
"""


_LEGACY_MODES = {"medusa": "speculative"}
"""Mode names stored before a rename. Entries written then say "medusa" for the exact tree mode;
reading them under today's name keeps an old run comparable, field for field, with its re-execution."""


@dataclass(frozen=True)
class LoggedTree:
    """Every node a step drafted (the engine's ``DraftTree``): stored only for runs that record trees.

    Node 0 is the root (the token chosen before the step); ``LoggedStep.accepted_nodes`` index the
    nodes. ``probs``: each node's draft probability given its parent (1.0 for the root).
    """

    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    probs: tuple[float, ...]

    def to_dict(self) -> dict[str, list[Any]]:
        return {"tokens": list(self.tokens), "parents": list(self.parents), "probs": list(self.probs)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LoggedTree:
        tokens = tuple(int(x) for x in d["tokens"])
        parents = tuple(int(x) for x in d["parents"])
        probs = tuple(float(x) for x in d["probs"])
        if not len(tokens) == len(parents) == len(probs):
            raise ValueError(f"a recorded tree needs one parent and one probability per node; got "
                             f"{len(tokens)} tokens, {len(parents)} parents, {len(probs)} probabilities")
        return cls(tokens, parents, probs)


@dataclass(frozen=True)
class LoggedStep:
    """One verification step as the stream stores it (the fields of the engine's step record).

    Attributes:
        step: 0-based index of the step within one generation.
        mode: the decoding mode's name ("vanilla", "speculative", "typical"); legacy names are read
            as today's (:data:`_LEGACY_MODES`), other values are stored and read as given.
        tree_size: nodes in the verified tree, root included.
        tree_depth: deepest node's depth (root is depth 0).
        accepted_length: tokens the step committed (accepted drafts plus one).
        accepted_nodes: tree node ids of the accepted path, root first.
        tokens: the token ids committed, in order.
        accepted_by_depth: for depth 1..tree_depth, whether a draft at that depth was accepted.
        draft_temperature: temperature of the draft proposal.
        elapsed_s: wall time of the step.
        predicted: accepted drafts the tree policy expected (dynamic trees; 0 otherwise).
        calibration: the policy's calibration factor when it built the tree (0 otherwise).
        tree: every drafted node, for runs that record trees; None (the key absent from the stored
            document, so an entry without a tree is stored byte for byte as before the field existed).
    """

    step: int
    mode: str
    tree_size: int
    tree_depth: int
    accepted_length: int
    accepted_nodes: tuple[int, ...]
    tokens: tuple[int, ...]
    accepted_by_depth: tuple[bool, ...] = field(default=())
    draft_temperature: float = 0.0
    elapsed_s: float = 0.0
    predicted: float = 0.0
    calibration: float = 0.0
    tree: LoggedTree | None = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON document stored in the entry's ``record`` field (same keys, same order, as the
        engine record's ``to_dict``, so the stored bytes do not depend on which type was appended)."""
        d = asdict(self)
        for key in ("accepted_nodes", "tokens", "accepted_by_depth"):
            d[key] = list(d[key])
        if self.tree is None:
            del d["tree"]  # absent, not null: entries without a tree keep their bytes (and chain digests)
        else:
            d["tree"] = self.tree.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LoggedStep:
        """Read a stored document; fields added after an entry was written take their defaults."""
        mode = str(d["mode"])
        return cls(
            step=int(d["step"]),
            mode=_LEGACY_MODES.get(mode, mode),
            tree_size=int(d["tree_size"]),
            tree_depth=int(d["tree_depth"]),
            accepted_length=int(d["accepted_length"]),
            accepted_nodes=tuple(int(x) for x in d["accepted_nodes"]),
            tokens=tuple(int(x) for x in d["tokens"]),
            accepted_by_depth=tuple(bool(x) for x in d.get("accepted_by_depth", ())),
            draft_temperature=float(d.get("draft_temperature", 0.0)),
            elapsed_s=float(d.get("elapsed_s", 0.0)),
            predicted=float(d.get("predicted", 0.0)),
            calibration=float(d.get("calibration", 0.0)),
            tree=LoggedTree.from_dict(d["tree"]) if d.get("tree") is not None else None,
        )


class AcceptanceEntry(BaseModel):
    """A decode step (:class:`LoggedStep`) and its place in a run.

    Attributes:
        run_id: the run (see :mod:`elesium.state.runs`).
        node_id: the LangGraph node whose generation produced the step.
        step_id: run-wide step number, increasing across the run's generations (``record.step``
            restarts at 0 for each generation).
        record: what the engine proposed and kept; given as the engine's record (anything with a
            ``to_dict()`` of :class:`LoggedStep`'s fields) or a mapping, held as :class:`LoggedStep`.
        entry_id: the stream id, set on entries read back; None on entries not yet appended.
        kind: "step" (a decode step) or "call" (one per LLM call of a workflow, written before its
            steps: ``record`` is then the prefill, which commits the call's first token, and
            ``tokens`` the call's whole output). Entries written before workflows existed are steps.
        call_index: the LLM call's index among its node's calls in the run (None outside workflows).
        call_seed: the call's sampling seed, derived from (run seed, node, call index).
        tokens: on "call" entries, every token id the call produced, in order.
        prompt: on "call" entries, the token ids the call was prompted with (chat template applied):
            with ``tokens``, the (context, answer) pair ``train-heads --from-log`` distils from. None on
            entries written before it was recorded.
        temperature: on "call" entries, the call's sampling temperature (0: greedy).
    """

    model_config = ConfigDict(frozen=True)

    run_id: str = Field(min_length=1)
    node_id: str
    step_id: int = Field(ge=0)
    record: LoggedStep
    entry_id: str | None = None
    kind: Literal["step", "call"] = "step"
    call_index: int | None = Field(default=None, ge=0)
    call_seed: int | None = None
    tokens: tuple[int, ...] | None = None
    prompt: tuple[int, ...] | None = None
    temperature: float | None = None

    @field_serializer("record", when_used="json")
    def _record_document(self, record: LoggedStep) -> dict[str, Any]:
        """The stored document: a step without a tree has no ``tree`` key (not ``null``), in JSON as in
        the stream, so API readers see old and new unrecorded entries alike."""
        return record.to_dict()

    @field_validator("record", mode="before")
    @classmethod
    def _as_logged_step(cls, value: Any) -> Any:
        """Take the engine's record without importing its type: the state layer sits below the engine,
        so it converts by the record's own ``to_dict()``; anything else is left to the type check."""
        if isinstance(value, LoggedStep):
            return value
        if isinstance(value, Mapping):
            return LoggedStep.from_dict(value)
        to_dict = getattr(value, "to_dict", None)
        if callable(to_dict):
            return LoggedStep.from_dict(to_dict())
        return value

    def to_fields(self) -> dict[str, str]:
        """The stream entry's fields: flat, readable in ``redis-cli XRANGE``."""
        fields = {
            "v": _SCHEMA,
            "run_id": self.run_id,
            "node_id": self.node_id,
            "step_id": str(self.step_id),
            "record": json.dumps(self.record.to_dict(), separators=(",", ":")),
        }
        if self.kind != "step":
            fields["kind"] = self.kind
        if self.call_index is not None:
            fields["call_index"] = str(self.call_index)
        if self.call_seed is not None:
            fields["call_seed"] = str(self.call_seed)
        if self.tokens is not None:
            fields["tokens"] = json.dumps(list(self.tokens), separators=(",", ":"))
        if self.prompt is not None:
            fields["prompt"] = json.dumps(list(self.prompt), separators=(",", ":"))
        if self.temperature is not None:
            fields["temperature"] = repr(self.temperature)
        return fields

    @classmethod
    def from_fields(cls, entry_id: bytes | str, fields: dict[bytes, bytes]) -> AcceptanceEntry:
        text = {k.decode(): v.decode() for k, v in fields.items()}
        return cls(
            run_id=text["run_id"],
            node_id=text["node_id"],
            step_id=int(text["step_id"]),
            record=LoggedStep.from_dict(json.loads(text["record"])),
            entry_id=entry_id.decode() if isinstance(entry_id, bytes) else entry_id,
            kind=text.get("kind", "step"),
            call_index=int(text["call_index"]) if "call_index" in text else None,
            call_seed=int(text["call_seed"]) if "call_seed" in text else None,
            tokens=tuple(json.loads(text["tokens"])) if "tokens" in text else None,
            prompt=tuple(json.loads(text["prompt"])) if "prompt" in text else None,
            temperature=float(text["temperature"]) if "temperature" in text else None,
        )


class AcceptanceSummary(BaseModel):
    """Aggregate acceptance figures of a run (or of one node in it).

    Attributes:
        tau: mean accepted length per step, the speed-up over one-token-per-forward decoding
            before overheads. 0.0 when there are no steps.
        acceptance_by_depth: entry ``d-1`` is the share of steps whose draft at depth ``d`` was
            accepted, among steps whose tree reached depth ``d``.
        total_tokens: tokens committed (sum of accepted lengths).
        total_time_s: summed step wall time.
        steps: number of decode steps.
    """

    run_id: str
    node_id: str | None = None
    steps: int
    total_tokens: int
    total_time_s: float
    tau: float
    acceptance_by_depth: list[float]


@dataclass(frozen=True)
class Retention:
    """How much of each run's stream to keep. Set ``maxlen`` or ``max_age_s`` (or neither)."""

    maxlen: int | None = 100_000
    max_age_s: float | None = None
    approximate: bool = True

    def __post_init__(self) -> None:
        if self.maxlen is not None and self.max_age_s is not None:
            raise ValueError("Retention takes maxlen (MAXLEN) or max_age_s (MINID), not both; pick one.")
        if self.maxlen is not None and self.maxlen <= 0:
            raise ValueError(f"Retention.maxlen must be >= 1, got {self.maxlen}.")
        if self.max_age_s is not None and self.max_age_s <= 0:
            raise ValueError(f"Retention.max_age_s must be > 0 seconds, got {self.max_age_s}.")

    def xadd_kwargs(self) -> dict[str, Any]:
        if self.maxlen is not None:
            return {"maxlen": self.maxlen, "approximate": self.approximate}
        if self.max_age_s is not None:
            return {"minid": self.min_id(), "approximate": self.approximate}
        return {}

    def min_id(self) -> str:
        return f"{int((time.time() - (self.max_age_s or 0.0)) * 1000)}-0"


class AcceptanceLog:
    """Append and read decode-step records, one stream per run.

    Args:
        client: a synchronous ``redis.Redis`` / ``RedisCluster`` (bytes replies).
        prefix: key root; one per application sharing a database.
        retention: trimming applied on every append (``Retention(maxlen=None)`` keeps all).
    """

    def __init__(
        self, client: Any, *, prefix: str = DEFAULT_PREFIX, retention: Retention | None = None,
        target: str = "the configured server",
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.retention = retention if retention is not None else Retention()
        self._target = target
        self.chains = ChainHooks()  # by run id: the run's audit cursor, which chains what is appended

    @classmethod
    def from_url(cls, url: str | None = None, **options: Any) -> AcceptanceLog:
        """Connect to ``url`` (default ``REDIS_URL``, else the embedded server)."""
        url = url or default_url()
        return cls(connect(url), target=describe(url), **options)

    def key(self, run_id: str) -> str:
        return f"{self.prefix}:{{{quote(run_id, safe='')}}}"

    def _guard(self, run_id: str) -> Any:
        return translate_errors(f"the acceptance stream {self.key(run_id)}", self._target)

    def append(self, entry: AcceptanceEntry) -> str:
        """Append one entry; returns its stream id."""
        with self._guard(entry.run_id):
            key, fields = self.key(entry.run_id), entry.to_fields()
            entry_id = self.client.xadd(key, fields, **self.retention.xadd_kwargs())
        eid = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
        self._chain(entry.run_id, [(eid, fields)])
        return eid

    def _chain(self, run_id: str, written: Sequence[tuple[str, Mapping[str, str]]]) -> None:
        """Chain entries just appended, when the run's cursor is attached: the stream is in the run's
        slot, not the thread's, so this is a call of its own, once per append (an LLM call's steps)."""
        cursor = self.chains.get(run_id)
        if cursor is not None and written:
            cursor.append([("acceptance", f"acc:{eid}", digest_json(dict(fields)))
                           for eid, fields in written])

    def append_many(
        self, entries: Sequence[AcceptanceEntry], *, once: tuple[str, str] | None = None
    ) -> list[str]:
        """Append a batch in one round trip per run, atomically per run; stream ids in input order.

        ``once=(set key, member)`` (one run's entries only; the set in the stream's slot): write the
        batch only if ``member`` is not in the set yet, adding it in the same script; returns [] when
        it was already there.
        """
        ids: dict[int, str] = {}
        by_run: dict[str, list[int]] = {}
        for i, entry in enumerate(entries):
            by_run.setdefault(entry.run_id, []).append(i)
        if once is not None and len(by_run) > 1:
            raise ValueError("append_many(once=...) takes the entries of one run")
        for run_id, positions in by_run.items():
            replies = self._append_run(run_id, [entries[i] for i in positions], once)
            if not replies:
                return []
            for i, reply in zip(positions, replies):
                ids[i] = reply.decode() if isinstance(reply, bytes) else str(reply)
            if self.chains.get(run_id) is not None:
                stored = [self._fields(entries[i]) for i in positions]
                self._chain(run_id, [(ids[i], dict(zip(f[::2], f[1::2]))) for i, f in zip(positions, stored)])
        return [ids[i] for i in range(len(entries))]

    def _fields(self, entry: AcceptanceEntry) -> list[str]:
        return [x for kv in entry.to_fields().items() for x in kv]

    def _script_args(self, entries: Sequence[AcceptanceEntry], once: tuple[str, str] | None) -> list[Any]:
        trim = self.retention.xadd_kwargs()
        op = "~" if trim.get("approximate") else "="
        if "maxlen" in trim:
            args: list[Any] = ["MAXLEN", op, str(trim["maxlen"])]
        elif "minid" in trim:
            args = ["MINID", op, str(trim["minid"])]
        else:
            args = ["", "", ""]
        args.append(once[1] if once else "")
        for entry in entries:
            flat = self._fields(entry)
            args += [len(flat), *flat]
        return args

    def _append_run(self, run_id: str, entries: Sequence[AcceptanceEntry],
                    once: tuple[str, str] | None = None) -> list[Any]:
        """One run's entries in one script; the raw stream ids. Subclasses change how (fencing)."""
        keys = [self.key(run_id), *([once[0]] if once else [])]
        with self._guard(run_id):
            return list(self.client.eval(APPEND_SCRIPT, len(keys), *keys, *self._script_args(entries, once)))

    def read(
        self, run_id: str, start: str = "-", end: str = "+", count: int | None = None
    ) -> list[AcceptanceEntry]:
        """Entries with ``start <= id <= end`` (stream ids; ``(id`` excludes), oldest first."""
        with self._guard(run_id):
            rows = self.client.xrange(self.key(run_id), min=start, max=end, count=count)
        return [AcceptanceEntry.from_fields(entry_id, fields) for entry_id, fields in rows]

    def iter_entries(self, run_id: str, page: int = 1000) -> Iterator[AcceptanceEntry]:
        """Every entry of the run, oldest first, fetched ``page`` at a time."""
        start = "-"
        while True:
            batch = self.read(run_id, start=start, count=page)
            yield from batch
            if len(batch) < page:
                return
            start = f"({batch[-1].entry_id}"

    def length(self, run_id: str) -> int:
        with self._guard(run_id):
            return int(self.client.xlen(self.key(run_id)))

    def trim(self, run_id: str) -> int:
        """Apply the retention now (e.g. after changing it); returns entries removed."""
        kwargs = self.retention.xadd_kwargs()
        if not kwargs:
            return 0
        with self._guard(run_id):
            return int(self.client.xtrim(self.key(run_id), **kwargs))

    def delete(self, run_id: str) -> None:
        with self._guard(run_id):
            self.client.delete(self.key(run_id))

    def summary(self, run_id: str, node_id: str | None = None) -> AcceptanceSummary:
        """tau, per-depth acceptance, tokens, time and steps over the run (or one node)."""
        steps = tokens = 0
        elapsed = 0.0
        accepted: list[int] = []
        reached: list[int] = []
        for entry in self.iter_entries(run_id):
            if entry.kind != "step" or (node_id is not None and entry.node_id != node_id):
                continue  # a call's prefill entry is not a verification step: it would skew tau
            rec = entry.record
            steps += 1
            tokens += rec.accepted_length
            elapsed += rec.elapsed_s
            for depth, ok in enumerate(rec.accepted_by_depth):
                if depth == len(reached):
                    reached.append(0)
                    accepted.append(0)
                reached[depth] += 1
                accepted[depth] += int(ok)
        return AcceptanceSummary(
            run_id=run_id,
            node_id=node_id,
            steps=steps,
            total_tokens=tokens,
            total_time_s=elapsed,
            tau=tokens / steps if steps else 0.0,
            acceptance_by_depth=[a / r for a, r in zip(accepted, reached)],
        )
