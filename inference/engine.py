"""The engine: one loaded model, one KV cache, and the decoders that share them.

This is the clean Python API the workflow layer calls::

    engine = Engine.load()                       # bundled model, best device
    result = engine.generate("Summarise ...", SamplingParams(max_tokens=128, seed=7))
    for chunk in (stream := engine.stream("Hi", SamplingParams(temperature=0.7, seed=1))):
        print(chunk.text, end="")
    stream.result.steps                            # typed per-step acceptance records

On the compiled CPU step many generations run at once: each holds a slot of one KV pool from its
first chunk until it finishes, is closed, is left by its ``for`` loop, or is garbage-collected, and
the engine's step loop decodes them together (:mod:`elesium.inference.batcher`); past
``ELESIUM_MAX_BATCH`` they wait, and a freed slot goes to the tenant holding the fewest (arrival
order within a tenant). Elsewhere (CUDA, the eager CPU path) one generation
owns the engine at a time in the same way (see :mod:`elesium.inference.generation_stream`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import logging
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import torch

from elesium.config import Settings
from elesium.errors import UserError
from elesium.inference.batcher import Batcher
from elesium.inference.constraints import Constraint
from elesium.inference.decoding.speculative import TreeDecoder
from elesium.inference.decoding.tree_policy import TreePolicy
from elesium.inference.decoding.vanilla import VanillaDecoder
from elesium.inference.drafters.drafter_tree import apply_draft_depth
from elesium.inference.drafters.files import HeadsMismatchError, default_heads_dir, load_heads
from elesium.inference.drafters.protocol import DraftHeads
from elesium.inference.fifo_gate import FifoGate
from elesium.inference.generation_stream import GenerationStream
from elesium.inference.records import DecodeMode, Generation, GenerationTiming, StepRecord, normalize_mode
from elesium.inference.runtime.config import DTYPES
from elesium.inference.runtime.cpu_step import CompiledCpuRunner, use_inductor_cache
from elesium.inference.runtime.cpu_weights import (
    apply_weight_format,
    resolve_cpu_compile,
    resolve_cpu_weights,
)
from elesium.inference.runtime.forward import PREFILL_CHUNK, TREE_BUCKETS, CudaGraphRunner, ForwardRunner
from elesium.inference.runtime.invariant import apply_invariant_numerics, is_invariant
from elesium.inference.runtime.invariant import resolve as resolve_invariant
from elesium.inference.runtime.model import Transformer, build_model
from elesium.inference.runtime.precompiled import PrecompileStore
from elesium.inference.runtime.prefix_cache import PrefixCache
from elesium.inference.sampling import Sampler, SamplingParams
from elesium.inference.tuning.profile import (
    TuneProfile,
    find_profile,
    profile_path,
    profile_weights,
    weights_of,
)
from elesium.inference.types import GenerationRequest, StepHook
from elesium.inference.weights.loading import LoadedWeights, load_weights
from elesium.inference.weights.tokenizer import Message, Tokenizer
from elesium.kernels.tree_attention import backend as tree_attention_backend
from elesium.kernels.tree_attention import set_backend as set_tree_attention

Prompt = str | Sequence[Message]
TimingObserver = Callable[[GenerationTiming], None]
log = logging.getLogger("elesium")


class PromptError(UserError, ValueError):
    """The prompt cannot be generated from (empty, or not a str, messages or token ids)."""


class PromptTooLongError(PromptError):
    """The prompt leaves no room to generate within the model's context."""


class ModeUnavailableError(UserError, ValueError):
    """A speculative mode was asked for, but this engine has no draft heads to run it."""


class DeviceError(UserError, ValueError):
    """The device or dtype asked for is unknown or not available here."""


class Decoder(Protocol):
    mode: str
    offset: int  # tokens in the KV cache

    def prefill(self, prompt_ids: list[int]) -> int: ...

    def step(self, room: int) -> tuple[list[int], StepRecord]:
        """One forward; ``room`` (>= 1) is how many cache slots it may write."""
        ...


HIDDEN_MEMO_BYTES = 64 << 20
"""Most bytes of residual streams ``Engine.hidden_states`` keeps for repeated questions (~300 prompts)."""
DEFAULT_PREFIX_CACHE_MB = 256
"""Prompt-prefix keys and values kept for reuse (``runtime/prefix_cache.py``): ~5,600 tokens of the
bundled model in float32, enough for a few dozen shared system prompts and live conversations."""
DEFAULT_CPU_BATCH = 16
"""Generations per step on the compiled CPU step: past about 16 rows a step's cost grows in proportion
to its rows on 2 cores, so a larger batch only adds latency (docs/design/batched-serving.md §6.1)."""


def resolve_max_batch(setting: int | str, runner: ForwardRunner) -> int:
    """How many generations share a step: ``max_batch`` where the runner can batch, else 1.

    Two runners have a batched twin that is bit for bit their one-sequence step: the compiled CPU step
    (on by default) and, under invariant numerics, the CUDA graphs (``runtime/batched_cuda_step.py``).
    CUDA batches only when asked: a speculative generation there runs its tree steps host-driven on its
    pool slot, without the self-feeding tree chains (BENCHMARKS §6j), which costs one-stream speed, so a
    single-user engine keeps them. The eager CPU path (SDPA) runs one generation at a time.
    """
    if isinstance(runner, CudaGraphRunner):
        if setting == "auto":
            return 1
        if runner.model.fused_pointwise:
            return int(setting)
        why = "CUDA batches only under invariant numerics (the fused kernels are off)"
    elif isinstance(runner, CompiledCpuRunner) and runner.compiled:
        return DEFAULT_CPU_BATCH if setting == "auto" else int(setting)
    else:
        why = f"the {type(runner).__name__} steps one sequence at a time (no batched twin of its step)"
    if setting != "auto" and int(setting) > 1:  # asked for explicitly: say why it is not granted
        log.warning("max_batch %s not applied: %s; this engine serves one generation at a time", setting, why)
    return 1


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise DeviceError("--device cuda was asked for, but torch sees no CUDA device")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise DeviceError(f"unknown device {device!r}; use cpu, cuda or auto")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise DeviceError(f"unknown dtype {dtype!r}; use float32, bfloat16 or float16")
    return DTYPES[dtype]


def _is_local_profile(profile: TuneProfile, cache_dir: Path, device: torch.device,
                      dtype: torch.dtype) -> bool:
    """Whether ``profile`` is the one ``elesium tune`` wrote on this machine (else it shipped with us)."""
    path = profile_path(cache_dir, profile.model_sha256, device, dtype, profile.weights)
    return path.exists() and TuneProfile.load(path) == profile


class Engine:
    """A loaded model plus everything needed to generate from it."""

    def __init__(self, model: Transformer, tokenizer: Tokenizer, *, weights: LoadedWeights | None = None,
                 heads: DraftHeads | None = None, policy: TreePolicy | None = None,
                 max_len: int | None = None, cuda_graphs: bool | None = None, speculate: bool = True,
                 profile: TuneProfile | None = None, heads_dir: str = "", heads_reason: str = "",
                 profile_reason: str = "", cpu_compile: bool = False, max_batch: int | str = "auto",
                 prefix_cache_mb: int = DEFAULT_PREFIX_CACHE_MB, precompile: PrecompileStore | None = None,
                 ) -> None:
        self.model = model
        # Where compiled CPU step graphs are saved and loaded (runtime/precompiled.py); None: compiled
        # in each process, as torch.compile does.
        self.precompile = precompile
        self.speculate = speculate
        # What Engine.load chose and why (describe(), fingerprint(), the load log line).
        self.profile = profile
        self.heads_dir = heads_dir if heads is not None else ""
        self.heads_reason = heads_reason or ("heads given" if heads is not None else "no heads given")
        self.profile_reason = profile_reason or ("policy given" if policy is not None else "built-in policy")
        self.tokenizer = tokenizer
        self.weights_info = weights
        self.policy = policy or TreePolicy()
        self.cache = model.new_cache(max_len)
        use_graphs = model.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        self.runner: ForwardRunner
        if use_graphs:
            self.runner = CudaGraphRunner(model, self.cache, heads, buckets=TREE_BUCKETS)
        elif cpu_compile and model.device.type == "cpu":
            self.runner = CompiledCpuRunner(model, self.cache, heads, precompile=precompile)
        else:
            self.runner = ForwardRunner(model, self.cache, heads)
        # Prompt prefixes shared across generations (runtime/prefix_cache.py), where the prefill's blocks
        # make reuse exact: the eager prefill. The CUDA graph prefill is not wired to it yet.
        self.prefix_cache: PrefixCache | None = None
        if prefix_cache_mb > 0 and not isinstance(self.runner, CudaGraphRunner):
            self.prefix_cache = PrefixCache(prefix_cache_mb << 20, PREFILL_CHUNK)
            self.runner.prefix_cache = self.prefix_cache
        self._gate = FifoGate()  # owned by one generation at a time, FIFO (generation_stream.py)
        # Many generations per step (batcher.py) where the step can batch: the compiled CPU step.
        slots = resolve_max_batch(max_batch, self.runner)
        self.batcher: Batcher | None = Batcher(self, slots) if slots > 1 else None
        # Called with each generation's timing when it ends (serving metrics). A tuple replaced under a
        # lock: notifying iterates a snapshot without locking, and several apps may share this engine.
        self._observers: tuple[TimingObserver, ...] = ()
        self._observers_lock = threading.Lock()
        # hidden_states of recent (ids, layers), least recently used first: a workflow asks for the same
        # prompt's states twice (ticket-triage's category and priority probes read one prompt, its two span
        # extractors another), and the answer is the same tensor, so the second ask costs nothing.
        self._hidden_memo: OrderedDict[tuple[tuple[int, ...], tuple[int, ...]], torch.Tensor] = OrderedDict()
        self._hidden_memo_bytes = 0
        self._memo_lock = threading.Lock()
        self.hidden_memo_hits = 0
        self.hidden_memo_misses = 0

    @property
    def heads(self) -> DraftHeads | None:
        """The Medusa heads (None: vanilla decoding only). Setting them re-arms the runner."""
        return self.runner.heads

    @heads.setter
    def heads(self, heads: DraftHeads | None) -> None:
        self.runner.set_heads(heads)

    @classmethod
    def load(cls, model: str | Path | None = None, *, device: str = "auto", dtype: str = "auto",
             heads: str | Path | None = "default", policy: TreePolicy | None = None,
             max_len: int | None = None, cuda_graphs: bool | None = None,
             settings: Settings | None = None, draft_depth: int | None = None) -> Engine:
        """Load a model and, where they exist, its Medusa heads and tuning profile.

        Args:
            model: GGUF file or HF directory; None reads ``ELESIUM_MODEL``, else the bundled model.
            heads: "default" loads the shipped heads when they were trained for this exact model
                (by sha256) and runs vanilla-only otherwise; a path must match or it raises;
                None disables speculative decoding.
            policy: tree policy; None uses the tuned profile for this device, if any.
            draft_depth: levels an eagle drafter tree drafts (``DrafterTree.set_depth``; None: its
                manifest's); it changes the heads' sha256, so fingerprints record it and profiles tuned
                at another depth do not apply.
        """
        settings = settings or Settings.from_env()
        set_tree_attention(settings.tree_attention)  # once per load, not per attention call
        dev = resolve_device(device if device != "auto" else settings.device)
        dt = resolve_dtype(dtype if dtype != "auto" else settings.dtype, dev)
        weights = load_weights(model if model is not None else settings.model, settings.cache_dir)
        net = build_model(weights.config, weights.state, dev, dt)
        apply_invariant_numerics(net, resolve_invariant(settings.invariant_numerics, dev))
        # CPU fast path (cpu_weights.py): the file's 4-bit codes through torch's int4 kernel by default.
        asked = dtype if dtype != "auto" else settings.dtype
        apply_weight_format(net, resolve_cpu_weights(settings.cpu_weights, dev, asked), weights.source,
                            cache_dir=settings.cache_dir, sha256=weights.sha256)
        cpu_compile = resolve_cpu_compile(settings.cpu_compile, dev, weights_of(net))
        if cpu_compile:
            # Inductor's compiled artefacts beside ours, so a second start loads them (seconds, not a minute).
            use_inductor_cache(settings.cache_dir / "inductor")
        medusa = None
        heads_dir = ""
        if heads == "default":
            try:
                medusa = load_heads(None, base_sha256=weights.sha256, device=dev, dtype=dt)
                heads_dir = str(default_heads_dir())
                heads_reason = "the shipped heads, trained for this model"
            except (FileNotFoundError, HeadsMismatchError) as exc:
                # Not silent: a model without matching heads decodes vanilla only, and the log says why.
                heads_reason = f"shipped heads not used: {exc}"
                log.warning("%s; decoding is vanilla only", heads_reason)
        elif heads is not None:
            medusa = load_heads(heads, base_sha256=weights.sha256, device=dev, dtype=dt)
            heads_dir, heads_reason = str(Path(heads).expanduser()), "heads given (--heads)"
        else:
            heads_reason = "heads turned off (--heads none)"
        if draft_depth is not None:
            apply_draft_depth(medusa, draft_depth)
            heads_reason += f"; drafting {draft_depth} levels (--draft-depth)"
        speculate = True
        profile = None
        if policy is not None:
            profile_reason = "policy given by the caller"
        else:
            profile = find_profile(settings.cache_dir, weights.sha256, dev, dt,
                                   medusa.source_sha256 if medusa is not None else "",
                                   profile_weights(weights_of(net), "compiled" if cpu_compile else "eager"))
            policy = profile.policy() if profile is not None else None
            # On a CPU, speculation costs more than it saves unless a profile measured otherwise.
            speculate = profile.speculate if profile is not None else dev.type != "cpu"
            profile_reason = ("no tuning profile for this model, device and heads: built-in tree policy"
                              if profile is None else
                              f"tuned on {profile.host or 'an unnamed host'}" if _is_local_profile(
                                  profile, settings.cache_dir, dev, dt) else "shipped with the package")
        engine = cls(net, weights.tokenizer, weights=weights, heads=medusa, policy=policy, max_len=max_len,
                     cuda_graphs=cuda_graphs, speculate=speculate, profile=profile, heads_dir=heads_dir,
                     heads_reason=heads_reason, profile_reason=profile_reason, cpu_compile=cpu_compile,
                     max_batch=settings.max_batch, prefix_cache_mb=int(settings.prefix_cache_mb),
                     precompile=PrecompileStore(settings.cache_dir / "precompiled",
                                                f"{weights.sha256}-{weights_of(net)}")
                     if cpu_compile else None)
        if isinstance(engine.runner, CompiledCpuRunner):  # saved graphs now, not in the first request
            engine.runner.preload(trees=engine.default_mode != "vanilla")
        d = engine.describe()
        log.info("engine: model %s on %s/%s; heads %s (%s); profile %s (%s); default mode %s (%s); "
                 "tree attention %s", weights.source.name, d["device"], d["dtype"], d["heads_dir"] or "none",
                 d["heads_reason"], d["profile_id"] or "none", d["profile_reason"], d["default_mode"],
                 d["mode_reason"], d["attention"])
        return engine

    @property
    def profile_id(self) -> str:
        """Which tuning profile chose the tree ("" for the built-in policy): device kind and dtype."""
        return f"{self.profile.device_kind}-{self.profile.dtype}" if self.profile is not None else ""

    @property
    def profile_version(self) -> str:
        """A content hash of the profile (16 hex), so re-tuning shows up in run fingerprints."""
        if self.profile is None:
            return ""
        doc = json.dumps(dataclasses.asdict(self.profile), sort_keys=True)
        return hashlib.sha256(doc.encode()).hexdigest()[:16]

    @property
    def mode_reason(self) -> str:
        """Why ``default_mode`` is what it is, in words."""
        if self.heads is None:
            return "no draft heads loaded"
        if not self.speculate and self.profile is None:
            return ("no tuning profile for this CPU, thread count and weight format (run `elesium tune`); "
                    "--mode speculative still runs it")
        if not self.speculate:
            return (f"profile {self.profile_id} measured speculation slower than vanilla on this hardware "
                    "(speculate: false); --mode speculative still runs it")
        if self.profile is not None:
            return f"profile {self.profile_id} measured speculation faster here"
        return "draft heads loaded and no profile says otherwise"

    @property
    def attention(self) -> str:
        """The tree-attention path the forward takes: "triton" on CUDA where Triton is installed."""
        forced = tree_attention_backend()
        if forced != "auto":
            return forced
        triton = importlib.util.find_spec("triton") is not None
        return "triton" if self.model.device.type == "cuda" and triton else "reference"

    def describe(self) -> dict[str, str]:
        """What this engine runs and why: stated in ``elesium generate --json`` and logged at load."""
        heads_sha = self.heads.source_sha256 if self.heads is not None else ""
        return {
            "model": str(self.weights_info.source) if self.weights_info is not None else "",
            "model_sha256": self.weights_info.sha256 if self.weights_info is not None else "",
            "device": self.model.device.type, "dtype": str(self.model.dtype).removeprefix("torch."),
            "heads_dir": self.heads_dir if self.heads is not None else "", "heads_sha256": heads_sha,
            "heads_reason": self.heads_reason,
            "profile_id": self.profile_id, "profile_version": self.profile_version,
            "profile_reason": self.profile_reason,
            "default_mode": self.default_mode, "mode_reason": self.mode_reason,
            "modes": ",".join(self.modes), "attention": self.attention, "weights": weights_of(self.model),
            "numerics": "invariant" if is_invariant(self.model) else "standard",
            "forward": self.forward_path,
        }

    @property
    def forward_path(self) -> str:
        """How decode steps run: "cuda-graphs", "cuda-graph-chains" (tree steps as self-feeding
        graphs, which sample from other uniforms than the host tree step: one per node), "compiled"
        (the CPU step graph) or "eager". A chain whose drafting selects its top-k in slices says so
        (``/topk-chunk-N``): its trees may differ from the reference form's at exact ties."""
        if isinstance(self.runner, CudaGraphRunner):
            if not self.runner.tree_chains:
                return "cuda-graphs"
            chunk = self.runner.draft_topk_chunk
            return "cuda-graph-chains" if chunk is None else f"cuda-graph-chains/topk-chunk-{chunk}"
        return "compiled" if isinstance(self.runner, CompiledCpuRunner) else "eager"

    def fingerprint(self, mode: DecodeMode | str | None = None) -> dict[str, str]:
        """What a run's output depends on besides its input and seed: model, heads,
        profile (its tree policy), dtype, device, decoding mode, attention path, CPU weight format,
        whether shape-invariant kernels run and how the step runs (each changes the bits of the logits)."""
        d = self.describe()
        keys = ("model_sha256", "heads_sha256", "profile_id", "profile_version", "dtype", "device",
                "attention", "weights", "numerics", "forward")
        return {**{k: d[k] for k in keys}, "mode": self.resolve_mode(mode)}

    @property
    def modes(self) -> tuple[DecodeMode, ...]:
        """Decoding modes this engine can run (speculative ones need Medusa heads)."""
        return ("vanilla", "speculative", "typical") if self.heads is not None else ("vanilla",)

    @property
    def default_mode(self) -> DecodeMode:
        return "speculative" if self.heads is not None and self.speculate else "vanilla"

    @property
    def context_length(self) -> int:
        return self.cache.max_len

    def encode_prompt(self, prompt: Prompt | list[int], *, raw: bool = False) -> list[int]:
        """Token ids for a prompt: a user message through the chat template, unless ``raw``."""
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
        elif isinstance(prompt, str):
            if not prompt.strip():
                raise PromptError("prompt is empty")
            ids = self.tokenizer.encode(prompt) if raw else self.tokenizer.encode_chat(
                [{"role": "user", "content": prompt}])
        else:
            ids = self.tokenizer.encode_chat(list(prompt))  # type: ignore[arg-type]
        if not ids:
            raise PromptError("prompt is empty")
        if len(ids) >= self.context_length:
            raise PromptTooLongError(f"prompt is {len(ids):,} tokens; this model's context is "
                                     f"{self.context_length:,} (leave room for at least one new token)")
        return ids

    def _no_heads_message(self, mode: str) -> str:
        return (f"mode {mode!r} needs draft heads, and none are loaded for this model "
                "(train them with `elesium train-heads`, pass --heads DIR, or use --mode vanilla)")

    def resolve_mode(self, mode: DecodeMode | str | None) -> DecodeMode:
        """The mode a generation runs in: ``default_mode`` for None; speculative without heads raises."""
        chosen = self.default_mode if mode is None else normalize_mode(mode)
        if chosen not in self.modes:
            raise ModeUnavailableError(self._no_heads_message(chosen))
        return chosen

    def make_decoder(self, mode: DecodeMode | str, params: SamplingParams, sampler: Sampler, *,
                     constraint: Constraint | None = None, policy: TreePolicy | None = None) -> Decoder:
        mode = normalize_mode(mode)  # "medusa" still names the speculative mode
        # Constrained output: a fresh grammar state per generation, which the decoder advances.
        vocab = self.model.config.vocab_size
        grammar = None if constraint is None else constraint.start(self.tokenizer, vocab)
        if mode == "vanilla":
            return VanillaDecoder(self.runner, params, sampler, grammar)
        if mode in ("speculative", "typical"):
            if self.heads is None:
                raise ModeUnavailableError(self._no_heads_message(mode))
            # A fresh policy per generation: online adaptation must not carry over between runs, or a
            # seeded sampled run would not replay to the same tokens. ``policy``: a caller's own (a
            # workflow node's calibration) in place of the engine's.
            policy = dataclasses.replace(self.policy if policy is None else policy)
            return TreeDecoder(self.runner, self.heads, params, sampler, policy, mode, grammar)
        raise AssertionError(f"normalize_mode let {mode!r} through")

    def stream(self, prompt: Prompt | list[int], params: SamplingParams | None = None, *,
               mode: DecodeMode | str | None = None, raw: bool = False,
               on_step: Callable[[StepRecord], None] | None = None,
               constraint: Constraint | None = None, policy: TreePolicy | None = None,
               arrived_at: float | None = None, tenant: str | None = None) -> GenerationStream:
        """Start a generation; iterate the returned stream for chunks, then read ``.result``.

        Bad input (empty or too long prompt, a speculative mode without heads) raises here, before
        the stream exists. The stream takes the engine on its first chunk and holds it until it
        finishes or is closed; ``on_step`` runs outside inference mode, after each step. ``arrived_at``
        (``time.perf_counter()``): when the request arrived, if earlier than now (its timing's start).
        ``tenant``: who asked, for fair admission to the batch (``GenerationRequest.tenant``).
        """
        params = params or SamplingParams()
        chosen = self.resolve_mode(mode)
        ids = self.encode_prompt(prompt, raw=raw)
        if self.batcher is not None:
            self.batcher.check_room()
        seed = params.seed if params.seed is not None else random.SystemRandom().randrange(2**63)
        return GenerationStream(self, ids, params, chosen, seed, on_step, constraint, policy,
                                arrived_at=arrived_at, tenant=tenant)

    def start(self, request: GenerationRequest, *, on_step: StepHook | None = None) -> GenerationStream:
        """:class:`~elesium.inference.types.TextEngine`'s entry: ``stream`` for a request value."""
        return self.stream(request.prompt, request.sampling, mode=request.mode, raw=request.raw,  # type: ignore[arg-type]
                           on_step=on_step, constraint=request.constraint, policy=request.policy,
                           arrived_at=request.arrived_at, tenant=request.tenant)

    def warm_up(self) -> float:
        """Compile what serving needs before the first request (seconds taken): the one-sequence step,
        by a two-token generation, the tree step where the default mode speculates, and the batched step
        where there is a batcher.

        Why: each graph costs ~10 s to trace even with inductor's cache warm (minutes cold), and a
        graph compiled by a request makes every request running beside it wait. Servers call this at
        start; a one-shot ``generate`` need not (it never runs two rows).
        """
        started = time.perf_counter()
        if self.batcher is not None and self.model.device.type == "cuda":
            self.batcher.warm_up()  # on CUDA every generation's steps, the ones below too, are its graphs
        self.generate("Hi", SamplingParams(max_tokens=2, temperature=0.0), mode="vanilla")
        if self.default_mode != "vanilla":  # the tree graph too, where requests speculate by default
            self.generate("Hi", SamplingParams(max_tokens=4, temperature=0.0))
        if self.batcher is not None:
            self.batcher.warm_up()
        return time.perf_counter() - started

    def step_cost(self, nodes: int) -> float:
        """Relative cost of one decode step verifying ``nodes`` tree nodes, from the tuned profile: what
        a node calibration trial weighs acceptance against."""
        return float(self.policy.cost(nodes))

    def generate(self, prompt: Prompt | list[int], params: SamplingParams | None = None, *,
                 mode: DecodeMode | str | None = None, raw: bool = False,
                 on_step: Callable[[StepRecord], None] | None = None,
                 constraint: Constraint | None = None, policy: TreePolicy | None = None) -> Generation:
        """Run a generation to the end; waits (FIFO) while another generation holds the engine."""
        stream = self.stream(prompt, params, mode=mode, raw=raw, on_step=on_step, constraint=constraint,
                             policy=policy)
        with stream:
            for _ in stream:
                pass
            return stream.result

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Raw ids of ``text`` (no chat template) and each token's character span: how span
        extraction maps words of an input to their hidden states (``graphs/spans.py``)."""
        return self.tokenizer.encode_with_offsets(text)

    def hidden_states(self, prompt_ids: list[int], layers: Sequence[int]) -> torch.Tensor:
        """The residual stream of ``prompt_ids`` after each of ``layers`` (0: the embeddings, i: block
        i), float32 ``[len(layers), tokens, hidden]``.

        Why: a closed-set question (a ticket's category) is answered more reliably by a linear probe
        on the model's own representation of the input than by asking a 135M model to write the
        answer (``graphs/classifier.py``). The forward runs on a KV cache of its own, so no
        generation's cache is touched, and on the batcher's step loop between steps (or under the
        engine's gate) like a generation. It is the engine's plain forward (its configured weights,
        no compiled step), cut after the deepest block asked for: deterministic for a given engine
        configuration, which is what replay needs, and so kept for a repeated question (a memo of
        ``HIDDEN_MEMO_BYTES``).
        """
        n_layers = self.model.config.num_layers
        if not layers or any(not 0 <= i <= n_layers for i in layers):
            raise ValueError(f"layers must be in 0..{n_layers}, got {list(layers)}")
        ids = self.encode_prompt(list(prompt_ids))
        key = (tuple(ids), tuple(layers))
        hit = self._memo_get(key)
        if hit is not None:
            return hit
        if self.batcher is not None:  # on the step loop, between steps: one thread drives the model
            return self.batcher.call(lambda: self._hidden_states(key))
        token = object()
        self._gate.acquire(token)
        try:
            return self._hidden_states(key)
        finally:
            self._gate.release(token)

    def _memo_get(self, key: tuple[tuple[int, ...], tuple[int, ...]]) -> torch.Tensor | None:
        with self._memo_lock:
            hit = self._hidden_memo.get(key)
            if hit is None:
                return None
            self._hidden_memo.move_to_end(key)
            self.hidden_memo_hits += 1
            return hit.clone()  # a copy: the caller may change what it gets

    def _hidden_states(self, key: tuple[tuple[int, ...], tuple[int, ...]]) -> torch.Tensor:
        ids, layers = key
        hit = self._memo_get(key)  # asked again while this one waited for the loop
        if hit is not None:
            return hit
        with torch.inference_mode():
            cache = self.model.new_cache(len(ids))
            tokens = torch.tensor([ids], device=self.model.device)
            positions = torch.arange(len(ids), device=self.model.device)
            collected: list[torch.Tensor] = []
            # Only the blocks the deepest asked-for layer needs: the later ones cannot change it.
            self.model(tokens, positions, cache, 0, collect=collected, blocks=max(layers))
            states = torch.stack([collected[i][0].float().cpu() for i in layers])
        with self._memo_lock:
            self.hidden_memo_misses += 1
            self._hidden_memo[key] = states.clone()
            self._hidden_memo_bytes += states.numel() * states.element_size()
            while self._hidden_memo_bytes > HIDDEN_MEMO_BYTES and self._hidden_memo:
                _, old = self._hidden_memo.popitem(last=False)
                self._hidden_memo_bytes -= old.numel() * old.element_size()
        return states

    def add_observer(self, observer: TimingObserver) -> None:
        """Call ``observer(timing)`` when each generation ends (finished, closed or failed), on the
        thread that ended it, after the engine was given back.

        Why here: every path that generates (chat completions, workflow runs, replays) goes through
        this engine, so one observer sees all of them. An observer must be quick and thread-safe; an
        exception it raises is logged and swallowed, never breaking the generation.
        """
        with self._observers_lock:
            self._observers = (*self._observers, observer)

    def remove_observer(self, observer: TimingObserver) -> None:
        """Stop calling ``observer`` (one registration of it; one never added is ignored)."""
        with self._observers_lock:
            observers = list(self._observers)
            if observer in observers:
                observers.remove(observer)
                self._observers = tuple(observers)

    def _notify(self, timing: GenerationTiming) -> None:
        """Hand a finished generation's timing to each observer; their failures stay theirs."""
        for observer in self._observers:
            try:
                observer(timing)
            except Exception:
                log.exception("generation timing observer %r failed; ignored", observer)

    @property
    def waiting(self) -> int:
        """Generations waiting to start: behind the one that holds the engine, or for a batch slot."""
        return self.batcher.waiting if self.batcher is not None else self._gate.waiting

    @property
    def running(self) -> int:
        """Generations being decoded now (at most one without a batcher)."""
        return self.batcher.running if self.batcher is not None else int(self._gate.busy)

    @property
    def busy(self) -> bool:
        """Whether a generation holds the engine now."""
        return self.running > 0

    def _wake(self) -> None:
        """Wake generations waiting to start, so a cancelled one notices (``GenerationStream.close``)."""
        self._gate.wake()
        if self.batcher is not None:
            self.batcher.wake()

