"""OpenTelemetry spans for each gateway request (docs/observability.md, "Tracing").

One trace per request, continued from the client's W3C ``traceparent`` when it sends one::

    POST /v1/chat/completions        root, kind SERVER (HTTP + GenAI attributes)
      kiloserve.admission            the wait in the admission queue (admission on only)
      kiloserve.route                the decision: policy, chosen backend, ranked, scores
      kiloserve.attempt              one per try on a backend, kind CLIENT (first, retry,
        kiloserve.upstream.connect     or migration); its ``traceparent`` goes upstream, so
                                       the engine's span is its child; event ``first_token``

Off by default, and then free: the middleware is not installed, and the hooks are checks
of ``ProxyContext.is_traced`` (front door and proxy) and ``is not None`` (per attempt).
The OpenTelemetry packages (extra ``kiloserve[tracing]``) are imported only when
tracing is enabled.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from kiloserve.engine.tracing import TracingSetup
from kiloserve.gateway.tracing_settings import TracingConfig

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from kiloserve.policies.base import Decision, RequestInfo

__all__ = ["TRACE_KEY", "AttemptTrace", "RequestTrace", "install_tracing"]

_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_TRACE_HEADERS = frozenset((b"traceparent", b"tracestate"))
_MAX_SCORES = 16  # backends listed with their score on the route span


class AttemptTrace:
    """One try on one backend: a CLIENT span whose context goes upstream."""

    __slots__ = ("_connect", "_trace", "span")

    def __init__(self, trace: RequestTrace, span: Span) -> None:
        self._trace = trace
        self.span = span
        self._connect: Span | None = None

    def carry(
        self, ours: dict[str, str], theirs: list[tuple[bytes, bytes]]
    ) -> list[tuple[bytes, bytes]]:
        """Put this attempt's ``traceparent`` in ``ours``; return ``theirs`` without the
        client's; start the connect span."""
        from opentelemetry import trace

        ours.update(self._trace.setup.inject(self.span))
        ctx = trace.set_span_in_context(self.span)
        self._connect = self._trace.setup.tracer.start_span("kiloserve.upstream.connect", ctx)
        return [h for h in theirs if h[0].lower() not in _TRACE_HEADERS]

    def connected(self) -> None:
        """The response head arrived."""
        if self._connect is not None:
            self._connect.end()
            self._connect = None

    def first_token(self) -> None:
        self.span.add_event("first_token")
        self._trace.first_token()

    def end(self, status: int, output_tokens: int) -> None:
        """The attempt's outcome; only the first call counts (as ``_Attempt.finish``)."""
        if not self.span.is_recording():
            return
        self.connected()
        self.span.set_attribute("http.response.status_code", status)
        self.span.set_attribute("gen_ai.usage.output_tokens", output_tokens)
        if status >= 500 or status == 429:
            _set_error(self.span, f"HTTP {status}")
        self._trace.output_tokens += output_tokens
        self.span.end()


class RequestTrace:
    """One request's root span and its children."""

    __slots__ = (
        "admission_started_ns", "had_first_token", "num_attempts", "output_tokens", "root",
        "setup",
    )  # fmt: skip

    def __init__(self, setup: TracingSetup, root: Span) -> None:
        self.setup = setup
        self.root = root
        self.admission_started_ns: int | None = None
        self.had_first_token = False
        self.num_attempts = 0
        self.output_tokens = 0

    def _child(self, name: str, **kwargs: Any) -> Span:
        from opentelemetry import trace

        ctx = trace.set_span_in_context(self.root)
        return self.setup.tracer.start_span(name, ctx, **kwargs)

    def profiled(self, info: RequestInfo, *, queued: bool) -> None:
        """The request is parsed: GenAI attributes; the admission wait starts."""
        root = self.root
        root.set_attribute("gen_ai.request.model", info.model)
        root.set_attribute("gen_ai.usage.input_tokens", info.input_tokens)
        root.set_attribute("kiloserve.request_id", info.request_id)
        if queued:
            self.admission_started_ns = time.time_ns()

    def decided(self, decision: Decision) -> None:
        """The admission wait ends (when queued); the routing decision, as a span."""
        if self.admission_started_ns is not None:
            wait = self._child("kiloserve.admission", start_time=self.admission_started_ns)
            wait.end()
        span = self._child("kiloserve.route")
        span.set_attribute("kiloserve.policy", decision.policy)
        span.set_attribute("kiloserve.ranked", list(decision.ranked))
        if decision.ranked:
            span.set_attribute("kiloserve.backend", decision.ranked[0])
            self.root.set_attribute("kiloserve.backend", decision.ranked[0])
        if decision.reason:
            span.set_attribute("kiloserve.reason", decision.reason)
        scores = decision.scores
        if scores:  # in rank order, the first _MAX_SCORES
            ranked = [b for b in decision.ranked[:_MAX_SCORES] if b in scores]
            span.set_attribute("kiloserve.scores", [f"{b}={scores[b]:.4g}" for b in ranked])
        span.end()

    def attempt(self, backend_id: str, base_url: str, path: str) -> AttemptTrace:
        from opentelemetry.trace import SpanKind

        self.num_attempts += 1
        kind = "first" if self.num_attempts == 1 else "retry"
        if self.num_attempts > 1 and self.had_first_token:
            kind = "migration"  # bytes reached the client: a continuation
        span = self._child("kiloserve.attempt", kind=SpanKind.CLIENT)
        span.set_attribute("kiloserve.backend", backend_id)
        span.set_attribute("kiloserve.attempt.number", self.num_attempts)
        span.set_attribute("kiloserve.attempt.kind", kind)
        span.set_attribute("http.request.method", "POST")
        span.set_attribute("url.full", base_url.rstrip("/") + path)
        self.root.set_attribute("kiloserve.backend", backend_id)
        return AttemptTrace(self, span)

    def first_token(self) -> None:
        if not self.had_first_token:
            self.had_first_token = True
            self.root.add_event("first_token")

    def end(self, status: int) -> None:
        self.root.set_attribute("http.response.status_code", status)
        self.root.set_attribute("gen_ai.usage.output_tokens", self.output_tokens)
        self.root.set_attribute("kiloserve.attempts", self.num_attempts)
        if status >= 500:
            _set_error(self.root, f"HTTP {status}")
        self.root.end()


def _set_error(span: Span, description: str) -> None:
    from opentelemetry.trace import Status, StatusCode

    span.set_status(Status(StatusCode.ERROR, description))


# the request's trace, kept on the request; aiohttp >= 3.13 wants a RequestKey
TRACE_KEY: Any = (
    web.RequestKey("kiloserve_trace", RequestTrace)
    if hasattr(web, "RequestKey")
    else "kiloserve_trace"
)


def _middleware(setup: TracingSetup) -> Any:
    from opentelemetry.trace import SpanKind

    @web.middleware
    async def trace_request(request: web.Request, handler: _Handler) -> web.StreamResponse:
        if request.method != "POST" or request.path.startswith("/admin"):
            return await handler(request)
        parent = setup.extract(request.headers)
        root = setup.tracer.start_span(
            f"POST {request.path}", parent, kind=SpanKind.SERVER,
            attributes={"http.request.method": "POST", "http.route": request.path,
                        "url.path": request.path},
        )  # fmt: skip
        trace = request[TRACE_KEY] = RequestTrace(setup, root)
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except BaseException as exc:
            code = getattr(exc, "status", None)  # RequestError, web.HTTPException
            status = code if isinstance(code, int) else 500
            raise
        finally:
            trace.end(status)

    return trace_request


def install_tracing(app: web.Application, cfg: TracingConfig) -> bool:
    """When ``cfg.enabled``: the tracer provider (``ConfigError`` without the extra), a
    root span per request (middleware), export flushed on cleanup; returns True. Else
    nothing, and False."""
    if not cfg.enabled:
        return False
    setup = TracingSetup(cfg.otlp_endpoint, cfg.service_name, cfg.sample_ratio)
    app.middlewares.append(_middleware(setup))

    async def flush(_app: web.Application) -> None:
        import asyncio

        await asyncio.to_thread(setup.shutdown)

    app.on_cleanup.append(flush)
    return True
