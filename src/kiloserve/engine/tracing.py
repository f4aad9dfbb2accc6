"""OpenTelemetry tracing: the OTLP/HTTP exporter setup (shared with the gateway) and
the twin's span per request, as vLLM's ``--otlp-traces-endpoint``.

The OpenTelemetry packages are the optional extra ``kiloserve[tracing]``: they are
imported here only when tracing is switched on, and a missing extra is a
``ConfigError`` that says how to install it (docs/observability.md, "Tracing").

The twin's span (``llm_request``, kind SERVER, as vLLM names it) continues the W3C
``traceparent`` the request came with, so one trace shows the gateway's spans and the
engine's. It carries the GenAI attributes vLLM sets: ``gen_ai.response.model``,
``gen_ai.usage.prompt_tokens`` / ``completion_tokens`` (and the newer
``input_tokens`` / ``output_tokens`` names).
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from aiohttp import web

from kiloserve.errors import ConfigError

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

__all__ = ["TRACE_STREAM_KEY", "TracingSetup", "install_twin_tracing", "make_tracing"]

# the twin's RequestStream, kept on the request for the span's token counts;
# aiohttp >= 3.13 wants a RequestKey, older versions have none
TRACE_STREAM_KEY: Any = (
    web.RequestKey("kiloserve_trace_stream", object)
    if hasattr(web, "RequestKey")
    else "kiloserve_trace_stream"
)
_TRACED_PATHS = frozenset(("/v1/completions", "/v1/chat/completions"))
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _require_otel() -> None:
    """Import the extra's packages, or say how to install them."""
    for name in ("opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.http"):
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise ConfigError(
                "tracing is enabled but the OpenTelemetry packages are missing: "
                "pip install 'kiloserve[tracing]'"
            ) from exc


class TracingSetup:
    """A tracer provider that exports to ``endpoint`` (OTLP/HTTP protobuf) through a
    BatchSpanProcessor, and the W3C trace-context propagator."""

    def __init__(self, endpoint: str, service_name: str, sample_ratio: float = 1.0) -> None:
        _require_otel()
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBasedTraceIdRatio
        from opentelemetry.trace.propagation.tracecontext import (
            TraceContextTextMapPropagator,
        )

        resource = Resource.create({"service.name": service_name})
        sampler = ParentBasedTraceIdRatio(sample_ratio)
        self.provider: TracerProvider = TracerProvider(resource=resource, sampler=sampler)
        exporter = OTLPSpanExporter(endpoint=endpoint)
        self.provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=500))
        self.tracer: Tracer = self.provider.get_tracer("kiloserve")
        self.propagator = TraceContextTextMapPropagator()

    def extract(self, headers: Mapping[str, str]) -> Any:
        """The OpenTelemetry context of an incoming ``traceparent`` (empty without one)."""
        return self.propagator.extract(dict(headers.items()))

    def inject(self, span: Span) -> dict[str, str]:
        """``traceparent`` (and ``tracestate``) naming ``span`` as the parent."""
        from opentelemetry import trace

        carrier: dict[str, str] = {}
        self.propagator.inject(carrier, context=trace.set_span_in_context(span))
        return carrier

    def shutdown(self) -> None:
        """Export what is buffered, then stop the exporter."""
        self.provider.shutdown()


def make_tracing(endpoint: str, service_name: str, sample_ratio: float = 1.0) -> TracingSetup:
    return TracingSetup(endpoint, service_name, sample_ratio)


def _twin_middleware(setup: TracingSetup, model_name: str) -> Any:
    from opentelemetry.trace import SpanKind

    @web.middleware
    async def trace_request(request: web.Request, handler: _Handler) -> web.StreamResponse:
        if request.method != "POST" or request.path not in _TRACED_PATHS:
            return await handler(request)
        parent = setup.extract(request.headers)
        with setup.tracer.start_as_current_span(
            "llm_request", context=parent, kind=SpanKind.SERVER, end_on_exit=True
        ) as span:
            span.set_attribute("gen_ai.response.model", model_name)
            span.set_attribute("http.request.method", "POST")
            span.set_attribute("url.path", request.path)
            try:
                response = await handler(request)
            finally:
                _usage_attributes(span, request.get(TRACE_STREAM_KEY))
            span.set_attribute("http.response.status_code", response.status)
            return response

    return trace_request


def _usage_attributes(span: Span, stream: Any) -> None:
    if stream is None:
        return
    for key in ("gen_ai.usage.prompt_tokens", "gen_ai.usage.input_tokens"):
        span.set_attribute(key, stream.num_prompt_tokens)
    for key in ("gen_ai.usage.completion_tokens", "gen_ai.usage.output_tokens"):
        span.set_attribute(key, stream.num_generated_tokens)
    span.set_attribute("gen_ai.request.id", stream.seq_id)


def install_twin_tracing(app: web.Application, endpoint: str, model_name: str) -> None:
    """A span per generation request, exported to ``endpoint``; flushed on cleanup."""
    setup = make_tracing(endpoint, "kiloserve-engine")
    app.middlewares.append(_twin_middleware(setup, model_name))

    async def flush(_app: web.Application) -> None:
        await asyncio.to_thread(setup.shutdown)

    app.on_cleanup.append(flush)
