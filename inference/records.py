"""Typed records the engine emits, one per decoding step.

These are the audit trail's unit: the state layer appends them to a Redis Stream, and audit replay
compares a re-execution against them token for token. Plain frozen dataclasses keep the engine free
of serialisation concerns; ``to_dict`` / ``from_dict`` are the only wire format.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

DecodeMode = Literal["vanilla", "speculative", "typical"]
"""How a generation decodes: one token per forward, exact tree verification, or relaxed (typical)."""

_MODE_NAMES: dict[str, DecodeMode] = {"vanilla": "vanilla", "speculative": "speculative",
                                      "typical": "typical",
                                      "medusa": "speculative"}
"""Canonical modes plus legacy aliases: "medusa" named the exact tree mode before it also ran Hydra
heads and the attention drafter; old CLI flags, bench files and stored records still say it."""


def normalize_mode(name: str) -> DecodeMode:
    """The canonical ``DecodeMode`` for ``name`` or a legacy alias (old CLI flags, stored records).

    Raises ValueError with one line naming the accepted values for anything else.
    """
    if name in _MODE_NAMES:
        return _MODE_NAMES[name]
    raise ValueError(f"unknown decoding mode {name!r}; use vanilla, speculative (alias medusa) or typical")


@dataclass(frozen=True)
class DraftTree:
    """Every node of the tree one step drafted and verified (recorded only when a run opts in).

    Node 0 is the root: the token chosen before the step (the last step's bonus, or the prefill's
    token), which is committed already; nodes 1.. are the heads' drafts in the verified order
    (``StepRecord.accepted_nodes`` index them).

    Attributes:
        tokens: each node's token id.
        parents: each node's parent node (-1 for the root).
        probs: each node's draft probability given its parent, as the heads proposed it (1.0 for
            the root), rounded to 4 decimals.
    """

    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    probs: tuple[float, ...]

    def to_dict(self) -> dict[str, list[Any]]:
        return {"tokens": list(self.tokens), "parents": list(self.parents), "probs": list(self.probs)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DraftTree":
        return cls(tuple(int(x) for x in d["tokens"]), tuple(int(x) for x in d["parents"]),
                   tuple(float(x) for x in d["probs"]))


@dataclass(frozen=True)
class StepRecord:
    """What one verification step proposed and what it kept.

    Attributes:
        step: 0-based index of the step within one generation (the prefill is not a step).
        mode: "vanilla" (one token per forward), "speculative" (exact tree verification; records
            written before the rename say "medusa", which ``from_dict`` reads as "speculative") or
            "typical" (Medusa's relaxed acceptance; NOT distribution-exact).
        tree_size: nodes in the verified tree, root included (1 for vanilla).
        tree_depth: deepest node's depth (root is depth 0).
        accepted_length: tokens this step committed: accepted draft nodes plus the one token
            sampled from the base model at the last accepted node. Always >= 1.
        accepted_nodes: tree node ids of the accepted path, root first.
        tokens: the token ids committed this step, in order.
        accepted_by_depth: for depth d = 1..tree_depth, whether a draft at that depth was accepted.
        draft_temperature: temperature of the draft proposal (never affects exactness).
        elapsed_s: wall time of the step, including verification and cache compaction.
        predicted: accepted drafts the tree policy expected of this tree (dynamic trees; 0 otherwise).
        calibration: the policy's calibration factor when it built the tree (dynamic trees; 0 otherwise).
            With ``predicted`` it lets the log re-estimate a node's calibration (predicted / calibration
            is the heads' own, uncalibrated, prediction).
        tree: every drafted node (token, parent, draft probability) when the generation records trees
            (``TreePolicy.record_trees``); None otherwise, and then ``to_dict`` leaves the key out, so
            a record without a tree serialises exactly as before the field existed.
    """

    step: int
    mode: DecodeMode
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
    tree: DraftTree | None = field(default=None, repr=False)  # printed steps stay one line

    @classmethod
    def plain(cls, step: int, token: int, elapsed_s: float) -> StepRecord:
        """The record of a vanilla step that committed ``token``: equal to the one ``__init__`` builds.

        Why not ``__init__``: a frozen dataclass sets each of its 13 fields through ``object.__setattr__``
        (~3 us a record here), and the step loop builds one for every token it hands out (~30,000 a level at
        32 concurrent on CUDA, in the host time between two chains); filling the instance's ``__dict__`` from
        a template costs a third of that."""
        record = object.__new__(cls)
        record.__dict__.update(_PLAIN, step=step, tokens=(token,), elapsed_s=elapsed_s)
        return record

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for key in ("accepted_nodes", "tokens", "accepted_by_depth"):
            d[key] = list(d[key])
        if self.tree is None:
            del d["tree"]
        else:
            d["tree"] = self.tree.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "StepRecord":
        return cls(
            step=int(d["step"]),
            mode=normalize_mode(d["mode"]),
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
            tree=DraftTree.from_dict(d["tree"]) if d.get("tree") is not None else None,
        )


# ``StepRecord.plain``'s template: every field's default, and a vanilla step's tree (its root, accepted).
_PLAIN: dict[str, Any] = {f.name: f.default for f in fields(StepRecord)} | {
    "mode": "vanilla", "tree_size": 1, "tree_depth": 0, "accepted_length": 1, "accepted_nodes": (0,),
    "accepted_by_depth": ()}


FinishReason = Literal["eos", "stop", "length", "deadline"]
"""Why a generation ended: its end token, a stop string, ``max_tokens`` (or the context), or its
``deadline_s`` passing (the tokens so far are its output; a run's record keeps how many, so a replay
cuts there too)."""


@dataclass(frozen=True)
class Chunk:
    """One streamed piece of output: the text that became final and the tokens behind it.

    ``text`` may lag ``token_ids`` by a few characters: an incomplete UTF-8 sequence or a possible
    beginning of a stop string is held back until it resolves.
    """

    text: str
    token_ids: tuple[int, ...]
    step: StepRecord | None = None


@dataclass(frozen=True)
class Generation:
    """The finished result of one generation, with everything needed to replay and audit it.

    The first new token comes from the prefill; ``steps`` cover the rest, so
    ``sum(s.accepted_length for s in steps) >= new_tokens - 1`` (a stop can cut the last step short).
    """

    text: str
    token_ids: tuple[int, ...]
    prompt_tokens: int
    finish_reason: FinishReason
    mode: DecodeMode
    seed: int
    elapsed_s: float
    steps: tuple[StepRecord, ...] = ()

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def mean_accepted(self) -> float:
        """tau: tokens committed per verification forward (1.0 for vanilla)."""
        if not self.steps:
            return 1.0
        return sum(s.accepted_length for s in self.steps) / len(self.steps)

    def to_dict(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "token_ids": list(self.token_ids),
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "finish_reason": self.finish_reason,
            "mode": self.mode,
            "seed": self.seed,
            "elapsed_s": self.elapsed_s,
            "tokens_per_s": self.tokens_per_s,
            "steps": len(self.steps),
            "mean_accepted": self.mean_accepted,
        }


@dataclass(eq=False)
class GenerationTiming:
    """When one generation reached each stage, on the ``time.perf_counter()`` clock (seconds).

    Why: serving latency (time to first token, queueing behind the engine's FIFO gate, inter-token
    latency) is measured where the generation runs, so every path that generates (chat completions,
    workflow runs, replays) is covered without each caller timing itself. The stream fills it in as
    it goes and hands it to the engine's observers once the generation ends (``Engine.add_observer``).
    Per decoding step it costs one float and one small int append, nothing else.

    ``token_at[i]`` is when a step that committed ``token_counts[i]`` (>= 1) tokens returned; steps
    that committed none (an end-of-sequence token) are not listed. Stages never reached stay None
    (a generation closed while it queued has no ``gate_at``).
    """

    created_at: float
    prompt_tokens: int
    mode: str
    gate_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    state: str = "new"  # the final state: "done", "closed" (stopped early) or "failed"
    output_tokens: int = 0  # tokens committed, the prefill's first one included
    token_at: list[float] = field(default_factory=list)
    token_counts: list[int] = field(default_factory=list)

    @property
    def queue_s(self) -> float | None:
        """Waiting for the engine: from creation to taking the gate."""
        return None if self.gate_at is None else self.gate_at - self.created_at

    @property
    def ttft_s(self) -> float | None:
        """Time to first token: from creation (arrival at the engine) to the end of the prefill."""
        return None if self.first_token_at is None else self.first_token_at - self.created_at

    @property
    def prefill_s(self) -> float | None:
        if self.first_token_at is None or self.gate_at is None:
            return None
        return self.first_token_at - self.gate_at

    @property
    def decode_s(self) -> float | None:
        """From the first token to the end (includes the consumer's time between chunks)."""
        if self.finished_at is None or self.first_token_at is None:
            return None
        return self.finished_at - self.first_token_at

    @property
    def e2e_s(self) -> float | None:
        return None if self.finished_at is None else self.finished_at - self.created_at

    def inter_token_latencies(self) -> list[float]:
        """One value per token after the first: a step committing k tokens after an interval t
        counts as k tokens of t/k each (as vLLM counts speculative steps)."""
        out: list[float] = []
        prev = self.first_token_at
        if prev is None:
            return out
        for at, k in zip(self.token_at, self.token_counts, strict=True):
            out.extend([(at - prev) / k] * k)
            prev = at
        return out
