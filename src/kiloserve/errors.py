"""One error hierarchy for kiloserve.

    KiloserveError
    ├── ConfigError                  bad YAML / flags / catalog entries (names the key)
    │   └── CatalogError             unknown GPU / model / quantisation
    ├── DoesNotFitError              a model does not fit the GPU memory (says what would)
    ├── LaunchError                  a child process failed to start or to become healthy
    ├── EtcdError                    etcd could not be reached or answered an error
    ├── DoctorError                  kiloserve doctor cannot read the gateway it triages
    ├── KvEventError                 a KV-cache event message not in vLLM's wire format
    ├── BackendError                 an engine failed to answer as expected (gateway side)
    │   └── UpstreamError            connecting to / writing to / reading from it failed
    └── RequestError                 400 invalid_request_error   the base of every HTTP error
        ├── UnauthorizedError        401 authentication_error    no / wrong API key or token
        ├── ForbiddenError           403 permission_error        model not allowed, admin remote
        ├── NotFoundError            404 not_found_error         unknown model / backend / URL
        ├── ConflictError            409 conflict_error          a stale state move (S3.5)
        ├── MethodNotAllowedError    405 invalid_request_error   wrong method for a URL (Allow)
        ├── PayloadTooLargeError     413 invalid_request_error   body over max_body_bytes
        ├── TooManyRequestsError     429 rate_limit_error        rate limit (Retry-After)
        │   └── QueueFullError       429 rate_limit_error        an admission lane is full
        ├── UnavailableError         503 service_unavailable     no backend, overloaded, queued
        │                                                        too long (Retry-After)
        └── BadGatewayError          502 upstream_error          no backend answered
            └── GatewayTimeoutError  504 upstream_error          ... in time

Every HTTP error class has one ``status`` and one OpenAI-style ``err_type``, and each
status has one type (``ERROR_TYPES``). A handler raises one; the gateway's middleware
(``kiloserve.gateway.errors``) and the engine twin's turn it into
``{"error": {"message", "type", "param", "code"}}`` with its status, and a
``Retry-After`` header when the error carries ``retry_after_s``. (The engine twin
speaks vLLM's dialect and writes ``NotFoundError`` as the type of its 404s.)

Third-party exceptions are translated at the edge with ``raise ... from exc``. A client
value quoted in a message goes through ``clip`` (at most 256 characters, then its length).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

__all__ = [
    "ERROR_TYPES",
    "BackendError",
    "BadGatewayError",
    "CatalogError",
    "ConfigError",
    "ConflictError",
    "DoctorError",
    "DoesNotFitError",
    "EtcdError",
    "ForbiddenError",
    "GatewayTimeoutError",
    "KiloserveError",
    "KvEventError",
    "LaunchError",
    "MethodNotAllowedError",
    "NotFoundError",
    "PayloadTooLargeError",
    "QueueFullError",
    "RequestError",
    "TooManyRequestsError",
    "UnauthorizedError",
    "UnavailableError",
    "UpstreamError",
    "clip",
    "retry_after_header",
    "some_of",
]

# HTTP status -> the one OpenAI-style error type the gateway writes for it
ERROR_TYPES: Mapping[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "upstream_error",
}


class KiloserveError(Exception):
    """Base of every error kiloserve raises on purpose."""


class ConfigError(KiloserveError):
    """Invalid configuration; the message names the offending key."""


class CatalogError(ConfigError):
    """Unknown or malformed GPU / model / quantisation entry."""


class DoesNotFitError(KiloserveError):
    """A model's weights (or a minimal KV cache) do not fit in GPU memory."""


class LaunchError(KiloserveError):
    """A child process failed to start or became unhealthy while starting."""


class EtcdError(KiloserveError):
    """etcd could not be reached or answered an error."""


class DoctorError(KiloserveError):
    """``kiloserve doctor`` cannot read the gateway it triages."""


class KvEventError(KiloserveError):
    """A KV-cache event message (ZMQ frame or msgpack batch) not in vLLM's format."""


class BackendError(KiloserveError):
    """A backend engine failed (connect error, 5xx, timeout, bad protocol)."""


class UpstreamError(BackendError):
    """Connecting to, writing to or reading from a backend failed (the proxy's client)."""


def retry_after_header(wait_s: float) -> str:
    """A ``Retry-After`` value: whole seconds, rounded up, at least 1."""
    return str(max(1, math.ceil(wait_s)))


class RequestError(KiloserveError):
    """An HTTP request is refused. ``status`` and ``err_type`` follow OpenAI's errors;
    this base is a 400 (the client's request is invalid)."""

    status = 400
    err_type = "invalid_request_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s
        self.headers = dict(headers or {})

    def to_body(self, err_type: str | None = None) -> dict[str, object]:
        """OpenAI-style error body: ``{"error": {"message", "type", "param", "code"}}``
        (``err_type`` overrides the class's type: the engine twin's vLLM dialect)."""
        return {
            "error": {
                "message": self.message,
                "type": err_type or self.err_type,
                "param": self.param,
                "code": self.code if self.code is not None else self.status,
            }
        }

    def response_headers(self) -> dict[str, str]:
        """Headers of the error answer: ``Retry-After`` when set, then ``headers``."""
        out: dict[str, str] = {}
        if self.retry_after_s is not None:
            out["Retry-After"] = retry_after_header(self.retry_after_s)
        out.update(self.headers)
        return out


class UnauthorizedError(RequestError):
    status = 401
    err_type = "authentication_error"


class ForbiddenError(RequestError):
    status = 403
    err_type = "permission_error"


class NotFoundError(RequestError):
    status = 404
    err_type = "not_found_error"


class ConflictError(RequestError):
    """A state move names an expected version the state has moved past (S3.5)."""

    status = 409
    err_type = "conflict_error"


class MethodNotAllowedError(RequestError):
    """The URL exists, the method does not (the answer keeps aiohttp's ``Allow``)."""

    status = 405
    err_type = "invalid_request_error"


class PayloadTooLargeError(RequestError):
    status = 413
    err_type = "invalid_request_error"


class TooManyRequestsError(RequestError):
    status = 429
    err_type = "rate_limit_error"


class QueueFullError(TooManyRequestsError):
    """An admission lane is at ``max_queue_len`` (``lane`` names it)."""

    def __init__(
        self,
        message: str,
        *,
        lane: str,
        code: str | None = "queue_full",
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message, code=code, retry_after_s=retry_after_s)
        self.lane = lane


class UnavailableError(RequestError):
    status = 503
    err_type = "service_unavailable"


class BadGatewayError(RequestError):
    """No backend answered: every tried one failed to connect (or, subclass, timed out)."""

    status = 502
    err_type = "upstream_error"


class GatewayTimeoutError(BadGatewayError):
    status = 504


def clip(value: str, limit: int = 256) -> str:
    """``value`` for an error message: whole when at most ``limit`` characters, else its
    first ``limit`` and ``... (N chars)`` (a client's 100 KB model name is not echoed)."""
    if len(value) <= limit:
        return value
    return f"{value[:limit]}... ({len(value)} chars)"


def some_of(names: Iterable[str], limit: int = 10) -> str:
    """``a, b, c`` for an error message; past ``limit`` names, the first ``limit`` and
    ``... (N in all)`` (a 1,024-GPU cluster has hundreds of backends)."""
    items = list(names)
    if len(items) <= limit:
        return ", ".join(items)
    return f"{', '.join(items[:limit])}, ... ({len(items)} in all)"
