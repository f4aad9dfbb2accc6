"""The front door's flow control: API keys, input limits, rate limits and admission.

``install_flow_control(app, ctx, cfg)`` (called by ``create_gateway_app``) adds a
``FlowControl`` to the app only when one of its sections is configured (``auth.keys``,
``admission.enabled``, input limits); without one the gateway behaves as before.

Per request, in order: the API key (401 unknown, 403 model not allowed; before the body
is read), input limits (400 naming the limit), rate limits (429 + ``Retry-After``), the
admission queue (429 full, 503 waited too long), then the app's usual decide + forward
(``dispatch``) along admission's decision, the admitted backend first (the router is
asked once per request). At completion the admission reservation is returned and the
key's token bucket is reconciled with the tokens actually used (prompt + completion).
Every refusal is raised (``kiloserve.errors``) and answered by the gateway's error
middleware (``gateway/errors.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping

from aiohttp import web

from kiloserve.errors import RequestError, TooManyRequestsError, UnavailableError
from kiloserve.gateway.admission.auth import ApiKey, KeyStore
from kiloserve.gateway.admission.controller import AdmissionController
from kiloserve.gateway.admission.queue import AdmissionConfig
from kiloserve.gateway.admission.ratelimit import Quota, RateLimiter, create_limiter
from kiloserve.gateway.config import GatewayConfig
from kiloserve.gateway.proxy import ProxyContext
from kiloserve.policies.base import Decision, Outcome, RequestInfo

__all__ = [
    "FLOW_KEY",
    "Dispatch",
    "FlowControl",
    "check_input_limits",
    "install_flow_control",
    "is_flow_configured",
]

logger = logging.getLogger(__name__)
_MAX_PRIORITY = 9
Response = web.StreamResponse
Dispatch = Callable[[Decision | None], Awaitable[web.StreamResponse]]


def is_flow_configured(cfg: GatewayConfig) -> bool:
    lim = cfg.admission.limits
    has_limits = bool(lim.max_context_tokens or lim.model_context_tokens or lim.max_output_tokens)
    return bool(cfg.admission.enabled or cfg.auth.keys or has_limits)


def _parse_priority(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        prio = int(value)
    except ValueError as exc:
        raise RequestError(f"priority header must be an integer 0..{_MAX_PRIORITY}") from exc
    if not 0 <= prio <= _MAX_PRIORITY:
        raise RequestError(f"priority header must be an integer 0..{_MAX_PRIORITY}")
    return prio


def check_input_limits(cfg: AdmissionConfig, info: RequestInfo) -> None:
    """400 naming the limit when the prompt or ``max_tokens`` is over it."""
    lim = cfg.limits
    if lim.max_output_tokens is not None and (info.max_tokens or 0) > lim.max_output_tokens:
        raise RequestError(
            f"max_tokens={info.max_tokens} is over the limit of {lim.max_output_tokens} "
            "(admission.limits.max_output_tokens)",
            param="max_tokens", code="max_tokens_over_limit",
        )  # fmt: skip
    context = lim.model_context_tokens.get(info.model, lim.max_context_tokens)
    if context is None:
        return
    total = info.input_tokens + (info.max_tokens or 0)
    if total > context:
        raise RequestError(
            f"the prompt ({info.input_tokens} tokens) plus max_tokens ({info.max_tokens or 0}) "
            f"is over the model's context of {context} tokens",
            param="messages", code="context_length_exceeded",
        )  # fmt: skip


class FlowControl:
    """Per-app flow control state (no globals)."""

    def __init__(self, cfg: GatewayConfig, ctx: ProxyContext) -> None:
        self.cfg = cfg
        self.ctx = ctx
        self.keys = KeyStore(cfg.auth, cfg.effective_admin_token())
        has_quota = any(k.max_requests_per_min or k.max_tokens_per_min for k in cfg.auth.keys)
        self.limiter: RateLimiter | None = create_limiter(cfg.rate_limit) if has_quota else None
        self.output_tokens: dict[str, int] = {}  # request id -> last attempt's output
        ctx.router.completion_listeners.append(self._note_usage)
        self.admission: AdmissionController | None = None
        if cfg.admission.enabled:
            self.admission = AdmissionController(cfg.admission, ctx.router)
        self._tasks: list[asyncio.Task[None]] = []

    def _note_usage(self, _backend_id: str, info: RequestInfo, outcome: Outcome) -> None:
        self.output_tokens[info.request_id] = outcome.output_tokens

    # -- before the body is read -----------------------------------------------------
    def authenticate(self, headers: Mapping[str, str]) -> ApiKey | None:
        return self.keys.authenticate(headers.get("authorization"))

    # -- after profiling -----------------------------------------------------------
    def classify(
        self, key: ApiKey | None, info: RequestInfo, headers: Mapping[str, str]
    ) -> RequestInfo:
        """403 / 400 checks; sets the request's priority and tenant."""
        KeyStore.check_model(key, info.model)
        check_input_limits(self.cfg.admission, info)
        asked = _parse_priority(headers.get(self.cfg.admission.priority_header))
        if key is None:
            return info.with_admission(asked or 0, info.tenant)
        prio = key.priority if asked is None else min(asked, key.priority)
        return info.with_admission(prio, key.name)

    async def guard(self, info: RequestInfo, key: ApiKey | None, dispatch: Dispatch) -> Response:
        """Rate limit and admit ``info``, then ``dispatch(admission's decision)``; reconcile.
        Raises TooManyRequestsError (429) or UnavailableError (503), counted here."""
        quota, reserved = self._quota(key), self._reserve_tokens(info)
        if quota is not None and self.limiter is not None:
            wait_s = await self._acquire(quota, reserved)
            if wait_s > 0:
                self.ctx.metrics.request_done(info.model, "", 429)
                raise TooManyRequestsError(
                    "rate limit reached for this API key", code="rate_limit", retry_after_s=wait_s
                )
        try:
            return await self._admitted(info, dispatch)
        finally:
            await self._reconcile(quota, info, reserved)

    async def _acquire(self, quota: Quota, reserved: int) -> float:
        """The limiter's wait; a store that fails (Redis down) lets the request through."""
        if self.limiter is None:
            return 0.0
        try:
            return await self.limiter.acquire(quota, reserved, time.monotonic())
        except Exception as exc:
            logger.warning("rate-limit store failed (%s): not limiting", type(exc).__name__)
            return 0.0

    def _quota(self, key: ApiKey | None) -> Quota | None:
        if key is None or (key.max_requests_per_min is None and key.max_tokens_per_min is None):
            return None
        return Quota(key.name, key.max_requests_per_min, key.max_tokens_per_min)

    @staticmethod
    def _reserve_tokens(info: RequestInfo) -> int:
        output = info.max_tokens if info.max_tokens is not None else info.predicted_output_tokens
        return info.input_tokens + output

    async def _reconcile(self, quota: Quota | None, info: RequestInfo, reserved: int) -> None:
        output = self.output_tokens.pop(info.request_id, None)
        if quota is None or self.limiter is None or output is None:
            return
        delta = reserved - (info.input_tokens + output)
        try:
            await self.limiter.reconcile(quota, delta, time.monotonic())
        except Exception as exc:  # a Redis hiccup must not fail an answered request
            logger.warning("rate-limit reconcile failed: %s", type(exc).__name__)

    async def _admitted(self, info: RequestInfo, dispatch: Dispatch) -> Response:
        if self.admission is None:
            return await dispatch(None)
        try:
            adm = await self.admission.admit(info)
        except (TooManyRequestsError, UnavailableError) as exc:
            self.ctx.metrics.request_done(info.model, "", exc.status)
            raise
        try:
            self.admission.dispatched(adm)  # forward counts it on the backend before any await
            policy = self.ctx.router.policy_name
            return await dispatch(Decision(adm.ranked, policy, cached_blocks=adm.cached_blocks))
        finally:
            self.admission.done(adm)

    # -- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        if self.admission is not None:
            self._tasks.append(asyncio.create_task(self.admission.run_ticker()))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        if self.limiter is not None:
            await self.limiter.close()


FLOW_KEY = web.AppKey("kiloserve_gateway_flow", FlowControl)


def install_flow_control(app: web.Application, ctx: ProxyContext, cfg: GatewayConfig) -> None:
    """Attach flow control to ``app`` when configured (startup / cleanup hooks, metrics)."""
    if not is_flow_configured(cfg):
        return
    flow = FlowControl(cfg, ctx)
    app[FLOW_KEY] = flow
    if flow.admission is not None:
        ctx.metrics.registry.register(flow.admission.metrics)

    async def on_startup(_: web.Application) -> None:
        await flow.start()

    async def on_cleanup(_: web.Application) -> None:
        await flow.stop()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
