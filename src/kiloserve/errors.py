"""One error hierarchy for kiloserve.

    KiloserveError
    ├── ConfigError            bad YAML / flags / catalog entries (message names the key)
    ├── CatalogError           unknown GPU / model / quantisation
    ├── DoesNotFitError        a model does not fit the GPU memory (says what would)
    ├── BackendError           an engine failed to answer as expected (gateway side)
    └── RequestError           a client's request is invalid; carries an HTTP status
        ├── NotFoundError      404 (unknown model)
        └── PayloadTooLargeError 413

Third-party exceptions are translated at the edge with ``raise ... from exc``.
"""

from __future__ import annotations

from collections.abc import Iterable


class KiloserveError(Exception):
    """Base of every error kiloserve raises on purpose."""


class ConfigError(KiloserveError):
    """Invalid configuration; the message names the offending key."""


class CatalogError(ConfigError):
    """Unknown or malformed GPU / model / quantisation entry."""


class DoesNotFitError(KiloserveError):
    """A model's weights (or a minimal KV cache) do not fit in GPU memory."""


class BackendError(KiloserveError):
    """A backend engine failed (connect error, 5xx, timeout, bad protocol)."""


class RequestError(KiloserveError):
    """A client request is invalid. ``status`` and ``err_type`` follow OpenAI's errors."""

    status = 400
    err_type = "invalid_request_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def to_body(self) -> dict[str, object]:
        """OpenAI-style error body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {
            "error": {
                "message": self.message,
                "type": self.err_type,
                "param": self.param,
                "code": self.code if self.code is not None else self.status,
            }
        }


class NotFoundError(RequestError):
    status = 404
    err_type = "NotFoundError"


class PayloadTooLargeError(RequestError):
    status = 413
    err_type = "invalid_request_error"


def some_of(names: Iterable[str], limit: int = 10) -> str:
    """``a, b, c`` for an error message; past ``limit`` names, the first ``limit`` and
    ``... (N in all)`` (a 1,024-GPU cluster has hundreds of backends)."""
    items = list(names)
    if len(items) <= limit:
        return ", ".join(items)
    return f"{', '.join(items[:limit])}, ... ({len(items)} in all)"
