"""Hot reload of the gateway config (S1.9): ``POST /admin/reload`` and SIGHUP.

A reload reads the config the gateway was started with again (the ``-c`` file with the
command-line flags on top: ``Reloader.source``), validates all of it, and only then
applies it, in one step of the event loop (no request sees half a config):

* ``policy`` (name and params: canary shares, scorer weights): a new policy object
  when the section changed, else the running one keeps its state;
* ``backends``: added ones join the table, removed ones stop taking new requests and
  leave once their in-flight requests end, changed ones (weight, version, models ...)
  are updated in place; unchanged backends keep their counters, health and history;
* limits and timeouts read per request (``LIVE_FIELDS``) and ``admission.limits``;
  ``auth`` keys and their rate limits.

Anything else (``port``, ``workers``, ``host``, the registry, admission queues ...)
cannot change live: a reload that changes it is refused, naming the fields, and the
gateway keeps running its config untouched. So is a config that does not parse or
validate: ``POST /admin/reload`` answers 400 with an OpenAI-style error naming the
problem. ``kiloserve_gateway_config_reloads_total{result}`` counts the outcomes.

With ``--workers N`` a worker hands ``POST /admin/reload`` to the supervisor
(``fan_out``: SIGHUP to it) after checking the file, and the supervisor sends SIGHUP
to every worker, so all of them load the same file.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable, Iterator
from typing import Any

from aiohttp import web
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from kiloserve.errors import KiloserveError, RequestError
from kiloserve.gateway.admin import LiveConfig, config_hash
from kiloserve.gateway.admission.auth import KeyStore
from kiloserve.gateway.admission.gate import FlowControl, is_flow_configured
from kiloserve.gateway.config import GatewayConfig
from kiloserve.gateway.limits import BodyBudget
from kiloserve.gateway.metrics import PREFIX
from kiloserve.gateway.proxy import ProxyContext
from kiloserve.gateway.resilience.manager import Resilience
from kiloserve.policies.base import Policy
from kiloserve.policies.registry import create_policy

__all__ = [
    "LIVE_FIELDS",
    "RELOAD_KEY",
    "Reloader",
    "changed_fields",
    "install_signal",
    "restart_fields",
]

logger = logging.getLogger(__name__)

# top-level keys a reload applies while serving (read per request, or swapped whole)
LIVE_FIELDS = frozenset({
    "policy", "backends", "auth", "max_in_flight", "max_body_bytes",
    "max_buffered_body_bytes", "client_body_timeout_s", "profile_offload_bytes",
    "retries", "first_byte_timeout_s", "non_stream_timeout_s", "request_timeout_s",
    "migration", "disagg",
})  # fmt: skip
_ADMISSION_LIVE = "admission.limits"


def changed_fields(old: GatewayConfig, new: GatewayConfig) -> list[str]:
    """The top-level keys whose values differ (``admission.limits`` on its own)."""
    changed = [n for n in GatewayConfig.model_fields if getattr(old, n) != getattr(new, n)]
    if "admission" in changed:
        rest_old = old.admission.model_copy(update={"limits": new.admission.limits})
        if rest_old == new.admission:
            changed[changed.index("admission")] = _ADMISSION_LIVE
    return changed


def _has_quota(cfg: GatewayConfig) -> bool:
    return any(k.max_requests_per_min or k.max_tokens_per_min for k in cfg.auth.keys)


def restart_fields(old: GatewayConfig, new: GatewayConfig) -> list[str]:
    """What ``new`` changes that only a restart applies (empty: it can go live)."""
    changed = changed_fields(old, new)
    fixed = [f for f in changed if f not in LIVE_FIELDS and f != _ADMISSION_LIVE]
    if is_flow_configured(old) != is_flow_configured(new):
        fixed.append("auth.keys / admission.limits (turning flow control on or off)")
    elif _has_quota(old) != _has_quota(new):
        fixed.append("auth.keys rate limits (turning rate limiting on or off)")
    return fixed


class _ReloadCollector(Collector):
    def __init__(self, reloader: Reloader) -> None:
        self._r = reloader

    def collect(self) -> Iterator[Any]:
        fam = CounterMetricFamily(
            PREFIX + "config_reloads", "config reloads by result (ok, error)", labels=["result"]
        )
        fam.add_metric(["ok"], self._r.num_ok)
        fam.add_metric(["error"], self._r.num_failed)
        yield fam


class Reloader:
    """Reloads one gateway app's config from ``source`` (None: nothing to reload)."""

    def __init__(
        self,
        ctx: ProxyContext,
        live: LiveConfig,
        budget: BodyBudget,
        resilience: Resilience,
        flow: Callable[[], FlowControl | None],
        on_policy: Callable[[Policy], None],
    ) -> None:
        self.ctx, self.live, self.budget, self.resilience = ctx, live, budget, resilience
        self._flow, self._on_policy = flow, on_policy
        self.source: Callable[[], GatewayConfig] | None = None
        self.fan_out: Callable[[], None] | None = None  # --workers N: SIGHUP the supervisor
        self.num_ok = 0
        self.num_failed = 0
        self.last_error = ""
        ctx.metrics.registry.register(_ReloadCollector(self))
        live.reload = self.reload

    # -- entry points ----------------------------------------------------------------
    async def reload(self) -> dict[str, Any]:
        """``POST /admin/reload``: apply (or hand to the supervisor); 400 when refused."""
        new, policy = self._checked()
        if self.fan_out is not None:
            self.fan_out()
            changed = changed_fields(self.ctx.cfg, new)
            return {"reloaded": True, "workers": "signalled", "changed": changed}
        return self._apply(new, policy)

    def on_signal(self) -> None:
        """SIGHUP: reload in this process; the outcome is logged and counted."""
        try:
            new, policy = self._checked()
            self._apply(new, policy)
        except RequestError:
            pass  # logged and counted by _checked

    # -- check, then apply -------------------------------------------------------------
    def _refuse(self, message: str, code: str, param: str | None = None) -> RequestError:
        self.num_failed += 1
        self.last_error = message
        logger.warning("config reload refused, nothing changed: %s", message)
        return RequestError(
            f"config reload refused, nothing changed: {message}", code=code, param=param
        )

    def _checked(self) -> tuple[GatewayConfig, Policy | None]:
        """The new config and (when its section changed) its policy, both validated."""
        if self.source is None:
            raise self._refuse("the gateway was started without a config file", "no_config")
        try:
            new = self.source()
            old = self.ctx.cfg
            fixed = restart_fields(old, new)
            policy = create_policy(new.policy.name, new.policy.params) if (
                new.policy != old.policy) else None  # fmt: skip
        except KiloserveError as exc:  # ConfigError: bad YAML, key, value or policy
            raise self._refuse(str(exc), "invalid_config") from exc
        if fixed:
            raise self._refuse(
                f"{', '.join(fixed)} cannot change while the gateway runs (restart it to "
                "apply them)",
                "restart_required",
                param=fixed[0],
            )
        return new, policy

    def _apply(self, new: GatewayConfig, policy: Policy | None) -> dict[str, Any]:
        """Swap ``new`` in (no await: one step of the event loop)."""
        old, ctx = self.ctx.cfg, self.ctx
        changed = changed_fields(old, new)
        moved = self._apply_backends(old, new)
        if policy is not None:
            ctx.router.policy = policy
            self.live.policy_name = policy.name
            self._on_policy(policy)
        flow = self._flow()
        if flow is not None:
            flow.cfg = new
            flow.keys = KeyStore(new.auth, new.effective_admin_token())
        self.budget.max_bytes = new.max_buffered_body_bytes
        ctx.cfg = self.live.cfg = new
        digest = config_hash(new)
        ctx.metrics.set_config_hash(digest)
        self.num_ok += 1
        logger.info("config reloaded: changed %s; backends %s", changed or "nothing", moved)
        return {
            "reloaded": True, "changed": changed, "backends": moved,
            "policy": ctx.router.policy_name, "config_hash": digest,
        }  # fmt: skip

    def _apply_backends(self, old: GatewayConfig, new: GatewayConfig) -> dict[str, list[str]]:
        table = self.ctx.table
        before = {b.backend_id: b for b in old.backends}
        after = {b.backend_id: b for b in new.backends}
        removed = [b for b in before if b not in after]
        added = [b for b in after if b not in before]
        updated = [b for b in after if b in before and after[b] != before[b]]
        for b in removed:
            table.remove_backend(b)  # in-flight requests finish; no new ones
        for b in added + updated:
            table.add_backend(after[b])
        for b in updated:
            if after[b].weight != before[b].weight:
                self.resilience.reset_weight(b)
        return {"added": added, "removed": removed, "updated": updated}


def install_signal(loop: asyncio.AbstractEventLoop, reloader: Reloader) -> None:
    """SIGHUP reloads (where the platform has it)."""
    with contextlib.suppress(NotImplementedError, RuntimeError, AttributeError):
        loop.add_signal_handler(signal.SIGHUP, reloader.on_signal)


RELOAD_KEY = web.AppKey("kiloserve_gateway_reloader", Reloader)
