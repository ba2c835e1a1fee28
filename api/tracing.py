"""OpenTelemetry spans, off unless ``ELESIUM_OTEL_EXPORTER`` is ``console`` or ``otlp``.

Spans follow the GenAI semantic conventions: ``invoke_workflow <name>`` per run, one span per node
(``langgraph.node <name>``), and ``chat <model>`` per LLM call with ``gen_ai.*`` attributes including
token usage. The tracer provider is private to the app, so tests and embedding apps are unaffected.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


class Tracing:
    def __init__(self, exporter: str = "none", model: str = "elesium", *, span_exporter: Any = None) -> None:
        """``span_exporter``: an SDK SpanExporter to use instead (exported synchronously; tests use it)."""
        self.enabled = exporter in ("console", "otlp") or span_exporter is not None
        self.model = model
        self.tracer: Any = None
        self.exporter: Any = span_exporter
        if not self.enabled:
            return
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import (
            BatchSpanProcessor,
            ConsoleSpanExporter,
            SimpleSpanProcessor,
        )

        if span_exporter is not None:
            provider = TracerProvider(resource=Resource.create({"service.name": "elesium"}))
            provider.add_span_processor(SimpleSpanProcessor(span_exporter))
            self.provider = provider
            self.tracer = provider.get_tracer("elesium.api")
            return
        if exporter == "otlp":
            try:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            except ImportError as exc:
                raise ValueError(
                    "ELESIUM_OTEL_EXPORTER=otlp needs opentelemetry-exporter-otlp-proto-http installed"
                ) from exc
            self.exporter = OTLPSpanExporter()
        else:
            self.exporter = ConsoleSpanExporter()
        provider = TracerProvider(resource=Resource.create({"service.name": "elesium"}))
        provider.add_span_processor(BatchSpanProcessor(self.exporter))
        self.provider = provider
        self.tracer = provider.get_tracer("elesium.api")

    @contextlib.contextmanager
    def span(self, name: str, **attributes: Any) -> Iterator[Any]:
        if self.tracer is None:
            yield None
            return
        with self.tracer.start_as_current_span(name) as span:
            for k, v in attributes.items():
                if v is not None:
                    span.set_attribute(k, v)
            yield span

    def run_spans(
        self, workflow: str, run_id: str, thread_id: str, calls: list[Any], nodes: list[str]
    ) -> None:
        """Emit the spans of a finished run: workflow, its nodes, and its LLM calls with token usage.

        Recorded after the fact from the run's record (node order, LLM calls), which keeps tracing
        out of the graph's hot path and works the same for every workflow.
        """
        if self.tracer is None:
            return
        with self.span(
            f"invoke_workflow {workflow}",
            **{
                "gen_ai.operation.name": "invoke_workflow",
                "elesium.run_id": run_id,
                "elesium.thread_id": thread_id,
            },
        ):
            for node in nodes:
                with self.span(f"langgraph.node {node}", **{"langgraph.node": node}):
                    for c in [c for c in calls if c.node == node]:
                        with self.span(
                            f"chat {self.model}",
                            **{
                                "gen_ai.operation.name": "chat",
                                "gen_ai.system": "elesium",
                                "gen_ai.request.model": self.model,
                                "gen_ai.request.seed": c.seed,
                                "gen_ai.usage.input_tokens": c.prompt_tokens,
                                "gen_ai.usage.output_tokens": len(c.token_ids),
                                "gen_ai.response.finish_reasons": [c.finish_reason],
                                "elesium.call": c.call,
                            },
                        ):
                            pass

    def shutdown(self) -> None:
        if self.tracer is not None:
            self.provider.shutdown()
