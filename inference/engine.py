"""The engine: one loaded model, one KV cache, and the decoders that share them.

This is the clean Python API the workflow layer calls::

    engine = Engine.load()                       # bundled model, best device
    result = engine.generate("Summarise ...", SamplingParams(max_tokens=128, seed=7))
    for chunk in (stream := engine.stream("Hi", SamplingParams(temperature=0.7, seed=1))):
        print(chunk.text, end="")
    stream.result.steps                            # typed per-step acceptance records

One generation runs at a time per engine (the cache is shared); ``stream`` holds a lock for the life
of its iterator.
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Protocol

import torch

from elesium.config import Settings
from elesium.inference.runtime.forward import CudaGraphRunner, ForwardRunner
from elesium.inference.drafters.files import HeadsMismatchError, load_heads
from elesium.inference.weights.loading import LoadedWeights, load_weights
from elesium.inference.runtime.model import Transformer, build_model
from elesium.inference.tuning.profile import find_profile
from elesium.inference.records import Chunk, DecodeMode, FinishReason, Generation, StepRecord
from elesium.inference.sampling import Sampler, SamplingParams
from elesium.inference.decoding.speculative import MedusaDecoder
from elesium.inference.text_stream import TextStream
from elesium.inference.decoding.tree_policy import TreePolicy
from elesium.inference.weights.tokenizer import Message, Tokenizer
from elesium.inference.decoding.vanilla import VanillaDecoder

Prompt = str | Sequence[Message]
# Tree sizes that get their own CUDA graph (a tree runs in the smallest bucket that holds it).
GRAPH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class PromptTooLongError(ValueError):
    """The prompt leaves no room to generate within the model's context."""


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
        raise ValueError("--device cuda was asked for, but torch sees no CUDA device")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"unknown device {device!r}; use cpu, cuda or auto")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use float32, bfloat16 or float16")
    return DTYPES[dtype]


class Engine:
    """A loaded model plus everything needed to generate from it."""

    def __init__(self, model: Transformer, tokenizer: Tokenizer, *, weights: LoadedWeights | None = None,
                 heads: torch.nn.Module | None = None, policy: TreePolicy | None = None,
                 max_len: int | None = None, cuda_graphs: bool | None = None, speculate: bool = True) -> None:
        self.model = model
        self.speculate = speculate
        self.tokenizer = tokenizer
        self.weights_info = weights
        self.policy = policy or TreePolicy()
        self.cache = model.new_cache(max_len)
        use_graphs = model.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        self.runner: ForwardRunner = (CudaGraphRunner(model, self.cache, heads, buckets=GRAPH_BUCKETS) if use_graphs
                                      else ForwardRunner(model, self.cache, heads))
        self._lock = threading.Lock()

    @property
    def heads(self) -> torch.nn.Module | None:
        """The Medusa heads (None: vanilla decoding only). Setting them re-arms the runner."""
        return self.runner.heads

    @heads.setter
    def heads(self, heads: torch.nn.Module | None) -> None:
        self.runner.set_heads(heads)

    @classmethod
    def load(cls, model: str | Path | None = None, *, device: str = "auto", dtype: str = "auto",
             heads: str | Path | None = "default", policy: TreePolicy | None = None,
             max_len: int | None = None, cuda_graphs: bool | None = None,
             settings: Settings | None = None) -> "Engine":
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
                                   getattr(medusa, "source_sha256", ""))
            policy = profile.policy() if profile is not None else None
            speculate = profile.speculate if profile is not None else True
        return cls(net, weights.tokenizer, weights=weights, heads=medusa, policy=policy, max_len=max_len,
                   cuda_graphs=cuda_graphs, speculate=speculate)

    @property
    def modes(self) -> tuple[DecodeMode, ...]:
        """Decoding modes this engine can run (speculative ones need Medusa heads)."""
        return ("vanilla", "medusa", "typical") if self.heads is not None else ("vanilla",)

    @property
    def default_mode(self) -> DecodeMode:
        return "medusa" if self.heads is not None and self.speculate else "vanilla"

    @property
    def context_length(self) -> int:
        return self.cache.max_len

    def encode_prompt(self, prompt: Prompt | list[int], *, raw: bool = False) -> list[int]:
        """Token ids for a prompt: a user message through the chat template, unless ``raw``."""
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
        elif isinstance(prompt, str):
            if not prompt.strip():
                raise ValueError("prompt is empty")
            ids = self.tokenizer.encode(prompt) if raw else self.tokenizer.encode_chat(
                [{"role": "user", "content": prompt}])
        else:
            ids = self.tokenizer.encode_chat(list(prompt))  # type: ignore[arg-type]
        if not ids:
            raise ValueError("prompt is empty")
        if len(ids) >= self.context_length:
            raise PromptTooLongError(f"prompt is {len(ids):,} tokens; this model's context is "
                                     f"{self.context_length:,} (leave room for at least one new token)")
        return ids

    def make_decoder(self, mode: DecodeMode, params: SamplingParams, sampler: Sampler) -> Decoder:
        if mode == "vanilla":
            return VanillaDecoder(self.runner, params, sampler)
        if mode in ("medusa", "typical"):
            if self.heads is None:
                raise ValueError(f"mode {mode!r} needs Medusa heads, and none are loaded for this model "
                                 "(train them with `elesium train-heads`, or use --mode vanilla)")
            # A fresh policy per generation: online adaptation must not carry over between runs, or a
            # seeded sampled run would not replay to the same tokens.
            return MedusaDecoder(self.runner, self.heads, params, sampler, dataclasses.replace(self.policy), mode)
        raise ValueError(f"unknown decoding mode {mode!r}; use vanilla, medusa or typical")

    def stream(self, prompt: Prompt | list[int], params: SamplingParams | None = None, *,
               mode: DecodeMode | None = None, raw: bool = False,
               on_step: Callable[[StepRecord], None] | None = None) -> "GenerationStream":
        """Start a generation; iterate the returned stream for chunks, then read ``.result``."""
        params = params or SamplingParams()
        ids = self.encode_prompt(prompt, raw=raw)
        seed = params.seed if params.seed is not None else random.SystemRandom().randrange(2**63)
        return GenerationStream(self, ids, params, mode or self.default_mode, seed, on_step)

    def generate(self, prompt: Prompt | list[int], params: SamplingParams | None = None, *,
                 mode: DecodeMode | None = None, raw: bool = False,
                 on_step: Callable[[StepRecord], None] | None = None) -> Generation:
        stream = self.stream(prompt, params, mode=mode, raw=raw, on_step=on_step)
        for _ in stream:
            pass
        return stream.result


class GenerationStream:
    """Iterator of ``Chunk``s; ``result`` holds the ``Generation`` once it is exhausted."""

    def __init__(self, engine: Engine, prompt_ids: list[int], params: SamplingParams, mode: DecodeMode,
                 seed: int, on_step: Callable[[StepRecord], None] | None) -> None:
        self.engine = engine
        self.prompt_ids = prompt_ids
        self.params = params
        self.mode = mode
        self.seed = seed
        self.on_step = on_step
        self._result: Generation | None = None
        self._iter = self._run()

    def __iter__(self) -> Iterator[Chunk]:
        return self._iter

    def __next__(self) -> Chunk:
        return next(self._iter)

    @property
    def result(self) -> Generation:
        if self._result is None:
            raise RuntimeError("the stream has not finished; iterate it to the end first")
        return self._result

    def _run(self) -> Iterator[Chunk]:
        engine, params = self.engine, self.params
        with engine._lock, torch.inference_mode():
            start = time.perf_counter()
            decoder = engine.make_decoder(self.mode, params, Sampler(self.seed))
            text = TextStream(engine.tokenizer, params.stop)
            steps: list[StepRecord] = []
            eos = engine.tokenizer.eos_ids
            finish: FinishReason | None = None

            def commit(tokens: list[int]) -> tuple[list[int], str]:
                """Apply stop conditions token by token: a stop can land mid-way through a step."""
                nonlocal finish
                kept: list[int] = []
                out = ""
                for t in tokens:
                    if t in eos:
                        finish = "eos"
                        break
                    kept.append(t)
                    out += text.push(t)
                    if text.stopped:
                        finish = "stop"
                        break
                    if len(text.token_ids) >= params.max_tokens:
                        finish = "length"
                        break
                return kept, out

            first = decoder.prefill(self.prompt_ids)
            kept, out = commit([first])
            if kept:
                yield Chunk(out, tuple(kept))
            while finish is None:
                room = engine.context_length - decoder.offset
                if room < 1:
                    finish = "length"
                    break
                tokens, record = decoder.step(room)
                steps.append(record)
                if self.on_step is not None:
                    self.on_step(record)
                kept, out = commit(tokens)
                if kept or out:
                    yield Chunk(out, tuple(kept), record)
            tail = text.flush()
            if tail:
                yield Chunk(tail, ())
            self._result = Generation(
                text=text.text, token_ids=tuple(text.token_ids), prompt_tokens=len(self.prompt_ids),
                finish_reason=finish, mode=self.mode, seed=self.seed,
                elapsed_s=time.perf_counter() - start, steps=tuple(steps))
