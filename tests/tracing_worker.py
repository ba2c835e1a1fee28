"""An ``elesium worker`` executor whose spans go to a file the test reads (tests/test_tracing_context.py).

``elesium worker --executor tracing_worker:make_executor`` with ``ELESIUM_TEST_SPANS_FILE`` set in its
environment: the API runs of :mod:`api_workflows`' workflows, on the engine the tests' ``engine`` fixture
loads (the runs' fingerprints must match), traced as ``ELESIUM_OTEL_EXPORTER`` would trace them but
exported synchronously, one JSON object per finished span and line, with nanosecond times (the console
exporter's ISO times keep only microseconds). Test-only: the product's exporters are console and otlp.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from typing import Any

from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

MODEL = "elesium-smollm2-135m"


def span_record(span: Any) -> dict[str, Any]:
    """What the test checks of a finished span (ids as 32/16 hex digits)."""
    return {
        "name": span.name,
        "kind": span.kind.name,
        "trace_id": f"{span.context.trace_id:032x}",
        "span_id": f"{span.context.span_id:016x}",
        "parent_id": f"{span.parent.span_id:016x}" if span.parent is not None else None,
        "parent_remote": bool(span.parent.is_remote) if span.parent is not None else None,
        "trace_state": span.context.trace_state.to_header(),
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "attributes": dict(span.attributes or {}),
        "status": span.status.status_code.name,
        "pid": os.getpid(),
    }


class JsonLinesExporter(SpanExporter):
    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()

    def export(self, spans: Sequence[Any]) -> SpanExportResult:
        lines = "".join(json.dumps(span_record(s), default=list) + "\n" for s in spans)
        with self._lock, open(self.path, "a", encoding="utf-8") as out:
            out.write(lines)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def make_executor(args: Any, queue: Any) -> Any:
    from api_workflows import make_worker_executor
    from elesium.api.tracing import Tracing

    executor = make_worker_executor(args, queue)
    spans = JsonLinesExporter(os.environ["ELESIUM_TEST_SPANS_FILE"])
    executor.svc.tracing = Tracing(model=MODEL, span_exporter=spans)
    return executor
