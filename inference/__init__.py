"""The engine: exact tree speculative decoding of one model, behind the typed interface of
:mod:`elesium.inference.types` (what graphs, the API and replay use)."""

from elesium.inference.types import (
    CallTag,
    Chunk,
    Generation,
    GenerationHandle,
    GenerationRequest,
    Prompt,
    SamplingParams,
    StepRecord,
    TextEngine,
    generate,
)

__all__ = ["CallTag", "Chunk", "Generation", "GenerationHandle", "GenerationRequest", "Prompt",
           "SamplingParams", "StepRecord", "TextEngine", "generate"]
