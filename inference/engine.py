"""The engine: one loaded model, one KV cache, and the decoders that share them.

This is the clean Python API the workflow layer calls::

    engine = Engine.load()                       # bundled model, best device
    result = engine.generate("Summarise ...", SamplingParams(max_tokens=128, seed=7))
    for chunk in (stream := engine.stream("Hi", SamplingParams(temperature=0.7, seed=1))):
        print(chunk.text, end="")
    stream.result.steps                            # typed per-step acceptance records

One generation runs at a time per engine (the cache is shared): a stream owns the engine from its
first chunk until it finishes, is closed, is left by its ``for`` loop, or is garbage-collected; other
generations queue in arrival order (see :mod:`elesium.inference.generation_stream`).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import torch

from elesium.config import Settings
from elesium.errors import UserError
from elesium.inference.constraints import Constraint
from elesium.inference.decoding.speculative import TreeDecoder
from elesium.inference.decoding.tree_policy import TreePolicy
from elesium.inference.decoding.vanilla import VanillaDecoder
from elesium.inference.drafters.files import HeadsMismatchError, load_heads
from elesium.inference.drafters.protocol import DraftHeads
from elesium.inference.fifo_gate import FifoGate
from elesium.inference.generation_stream import GenerationStream
from elesium.inference.records import DecodeMode, Generation, StepRecord, normalize_mode
from elesium.inference.runtime.config import DTYPES
from elesium.inference.runtime.forward import TREE_BUCKETS, CudaGraphRunner, ForwardRunner
from elesium.inference.runtime.model import Transformer, build_model
from elesium.inference.sampling import Sampler, SamplingParams
from elesium.inference.tuning.profile import find_profile
from elesium.inference.weights.loading import LoadedWeights, load_weights
from elesium.inference.weights.tokenizer import Message, Tokenizer

Prompt = str | Sequence[Message]


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


class Engine:
    """A loaded model plus everything needed to generate from it."""

    def __init__(self, model: Transformer, tokenizer: Tokenizer, *, weights: LoadedWeights | None = None,
                 heads: DraftHeads | None = None, policy: TreePolicy | None = None,
                 max_len: int | None = None, cuda_graphs: bool | None = None, speculate: bool = True) -> None:
        self.model = model
        self.speculate = speculate
        self.tokenizer = tokenizer
        self.weights_info = weights
        self.policy = policy or TreePolicy()
        self.cache = model.new_cache(max_len)
        use_graphs = model.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        self.runner: ForwardRunner = (CudaGraphRunner(model, self.cache, heads, buckets=TREE_BUCKETS) if use_graphs
                                      else ForwardRunner(model, self.cache, heads))
        self._gate = FifoGate()  # owned by one generation at a time, FIFO (generation_stream.py)

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
             settings: Settings | None = None) -> Engine:
        """Load a model and, where they exist, its Medusa heads and tuning profile.

        Args:
            model: GGUF file or HF directory; None reads ``ELESIUM_MODEL``, else the bundled model.
            heads: "default" loads the shipped heads when they were trained for this exact model
                (by sha256) and runs vanilla-only otherwise; a path must match or it raises;
                None disables speculative decoding.
            policy: tree policy; None uses the tuned profile for this device, if any.
        """
        settings = settings or Settings.from_env()
        dev = resolve_device(device if device != "auto" else settings.device)
        dt = resolve_dtype(dtype if dtype != "auto" else settings.dtype, dev)
        weights = load_weights(model if model is not None else settings.model, settings.cache_dir)
        net = build_model(weights.config, weights.state, dev, dt)
        medusa = None
        if heads == "default":
            try:
                medusa = load_heads(None, base_sha256=weights.sha256, device=dev, dtype=dt)
            except (FileNotFoundError, HeadsMismatchError):
                medusa = None  # no heads trained for this model: vanilla decoding only
        elif heads is not None:
            medusa = load_heads(heads, base_sha256=weights.sha256, device=dev, dtype=dt)
        speculate = True
        if policy is None:
            profile = find_profile(settings.cache_dir, weights.sha256, dev, dt,
                                   medusa.source_sha256 if medusa is not None else "")
            policy = profile.policy() if profile is not None else None
            speculate = profile.speculate if profile is not None else True
        return cls(net, weights.tokenizer, weights=weights, heads=medusa, policy=policy, max_len=max_len,
                   cuda_graphs=cuda_graphs, speculate=speculate)

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
                     constraint: Constraint | None = None) -> Decoder:
        mode = normalize_mode(mode)  # "medusa" still names the speculative mode
        # Constrained output: a fresh grammar state per generation, which the decoder advances.
        grammar = None if constraint is None else constraint.start(self.tokenizer, self.model.config.vocab_size)
        if mode == "vanilla":
            return VanillaDecoder(self.runner, params, sampler, grammar)
        if mode in ("speculative", "typical"):
            if self.heads is None:
                raise ModeUnavailableError(self._no_heads_message(mode))
            # A fresh policy per generation: online adaptation must not carry over between runs, or a
            # seeded sampled run would not replay to the same tokens.
            return TreeDecoder(self.runner, self.heads, params, sampler, dataclasses.replace(self.policy), mode,
                               grammar)
        raise AssertionError(f"normalize_mode let {mode!r} through")

    def stream(self, prompt: Prompt | list[int], params: SamplingParams | None = None, *,
               mode: DecodeMode | str | None = None, raw: bool = False,
               on_step: Callable[[StepRecord], None] | None = None,
               constraint: Constraint | None = None) -> GenerationStream:
        """Start a generation; iterate the returned stream for chunks, then read ``.result``.

        Bad input (empty or too long prompt, a speculative mode without heads) raises here, before
        the stream exists. The stream takes the engine on its first chunk and holds it until it
        finishes or is closed; ``on_step`` runs outside inference mode, after each step.
        """
        params = params or SamplingParams()
        chosen = self.resolve_mode(mode)
        ids = self.encode_prompt(prompt, raw=raw)
        seed = params.seed if params.seed is not None else random.SystemRandom().randrange(2**63)
        return GenerationStream(self, ids, params, chosen, seed, on_step, constraint)

    def generate(self, prompt: Prompt | list[int], params: SamplingParams | None = None, *,
                 mode: DecodeMode | str | None = None, raw: bool = False,
                 on_step: Callable[[StepRecord], None] | None = None,
                 constraint: Constraint | None = None) -> Generation:
        """Run a generation to the end; waits (FIFO) while another generation holds the engine."""
        stream = self.stream(prompt, params, mode=mode, raw=raw, on_step=on_step, constraint=constraint)
        with stream:
            for _ in stream:
                pass
            return stream.result

    @property
    def waiting(self) -> int:
        """Generations queued behind the one that holds the engine (for metrics and tests)."""
        return self._gate.waiting

    @property
    def busy(self) -> bool:
        """Whether a generation holds the engine now."""
        return self._gate.busy

