"""What tracing costs a gateway request when it is off (issue 18): the hooks' own work.

    .venv/bin/python benchmarks/tracing_off_cost.py

With ``tracing.enabled: false`` no middleware is installed and no OpenTelemetry code
runs; what remains on a request's path is three reads of ``ProxyContext.is_traced``
(two in the front door, one in the proxy), and per attempt one ``None`` stored and
four ``is not None`` checks. This times exactly that sequence on a real
``ProxyContext`` against an empty function and prints nanoseconds per request. Compare
with the gateway's CPU per request (benchmarks/gateway_overhead.py, ~100 us).
"""

from __future__ import annotations

import timeit

from kiloserve.gateway.app import CTX_KEY, create_gateway_app
from kiloserve.gateway.config import parse_gateway_config
from kiloserve.gateway.proxy import ProxyContext

NUM = 1_000_000


class _Attempt:  # the proxy's attempt, reduced to its tracing slot
    __slots__ = ("span",)

    def __init__(self) -> None:
        self.span: object | None = None


def _hooks(ctx: ProxyContext) -> None:
    if ctx.is_traced:  # app.py, _proxy
        raise AssertionError
    if ctx.is_traced:  # app.py, _dispatch
        raise AssertionError
    call_trace = object() if ctx.is_traced else None  # proxy.py, forward
    att = _Attempt()  # proxy.py, _Attempt.__init__ (its other fields are not tracing's)
    if call_trace is not None:  # _try_backend
        raise AssertionError
    if att.span is not None:  # _try_backend
        raise AssertionError
    if att.span is not None:  # _Attempt.mark_first_token
        raise AssertionError
    if att.span is not None:  # _Attempt.finish
        raise AssertionError


def _baseline(ctx: ProxyContext) -> None:
    _Attempt()  # the attempt object exists anyway


def main() -> None:
    cfg = parse_gateway_config({"backends": [{"url": "http://127.0.0.1:9", "models": ["m"]}]})
    app = create_gateway_app(cfg)
    ctx = app[CTX_KEY]
    assert not ctx.is_traced
    best_hooks = min(timeit.repeat(lambda: _hooks(ctx), number=NUM, repeat=5))
    best_base = min(timeit.repeat(lambda: _baseline(ctx), number=NUM, repeat=5))
    print(f"tracing off: {(best_hooks - best_base) / NUM * 1e9:.0f} ns per request (hooks)")


if __name__ == "__main__":
    main()
