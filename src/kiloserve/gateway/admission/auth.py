"""API keys (S6.1, S6.2): ``Authorization: Bearer <key>`` for the ``/v1`` routes.

Keys come from the config (as a SHA-256 hex digest, ``key_sha256``) or from the
environment (``key_env`` names the variable that holds the key); the plain key is
hashed at load and never kept, logged or used as a metric label: a key is known by
its ``name`` only. Each key carries its allowed models (empty: all), a priority
class and rate limits. Auth is off when no key is configured (today's behaviour).

Admin endpoints stay behind the gateway's separate ``admin_token``; an API key equal
to the admin token is rejected at load, so a client key never opens ``/admin``.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kiloserve.errors import ConfigError, ForbiddenError, UnauthorizedError

__all__ = ["ApiKey", "ApiKeyConfig", "AuthConfig", "KeyStore", "hash_key"]


class ApiKeyConfig(BaseModel):
    """One API key: exactly one of ``key_sha256`` / ``key_env``."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64)
    key_sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    key_env: str | None = None
    allowed_models: list[str] = Field(default_factory=list)
    priority: int = Field(default=0, ge=0, le=9)
    max_requests_per_min: float | None = Field(default=None, gt=0.0)
    max_tokens_per_min: float | None = Field(default=None, gt=0.0)
    weight: float = Field(default=1.0, gt=0.0)

    @model_validator(mode="after")
    def _one_source(self) -> ApiKeyConfig:
        if (self.key_sha256 is None) == (self.key_env is None):
            raise ValueError(f"key '{self.name}': set exactly one of key_sha256, key_env")
        return self


class AuthConfig(BaseModel):
    """The ``auth`` config section."""

    model_config = ConfigDict(extra="forbid")

    keys: list[ApiKeyConfig] = Field(default_factory=list)


def hash_key(key: str) -> str:
    """SHA-256 hex digest of a key (what the config and the store keep)."""
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class ApiKey:
    """A loaded key, known by its name (never by its value)."""

    name: str
    allowed_models: frozenset[str]
    priority: int
    max_requests_per_min: float | None
    max_tokens_per_min: float | None
    weight: float

    def allows(self, model: str) -> bool:
        return not self.allowed_models or model in self.allowed_models


def _digest_of(k: ApiKeyConfig, env: Mapping[str, str]) -> str:
    if k.key_sha256 is not None:
        return k.key_sha256
    value = env.get(k.key_env or "", "")
    if not value:
        raise ConfigError(f"auth.keys '{k.name}': environment variable {k.key_env} is not set")
    return hash_key(value)


class KeyStore:
    """Hashed keys, looked up by digest."""

    def __init__(
        self,
        cfg: AuthConfig,
        admin_token: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        environ = os.environ if env is None else env
        self._by_digest: dict[str, ApiKey] = {}
        for k in cfg.keys:
            digest = _digest_of(k, environ)
            if digest in self._by_digest:
                raise ConfigError(f"auth.keys '{k.name}': the same key is configured twice")
            self._by_digest[digest] = ApiKey(
                k.name, frozenset(k.allowed_models), k.priority,
                k.max_requests_per_min, k.max_tokens_per_min, k.weight,
            )  # fmt: skip
        if admin_token and hash_key(admin_token) in self._by_digest:
            raise ConfigError("auth.keys: an API key must differ from the admin token")

    @property
    def is_enabled(self) -> bool:
        return bool(self._by_digest)

    def keys(self) -> list[ApiKey]:
        return list(self._by_digest.values())

    def authenticate(self, authorization: str | None) -> ApiKey | None:
        """The caller's key; None when auth is off. Raises UnauthorizedError (401)."""
        if not self._by_digest:
            return None
        if not authorization or not authorization.startswith("Bearer "):
            raise UnauthorizedError("missing API key: send 'Authorization: Bearer <key>'")
        digest = hash_key(authorization[7:].strip())
        key = self._by_digest.get(digest)  # a digest lookup leaks nothing about the key
        if key is None:
            raise UnauthorizedError("invalid API key", code="invalid_api_key")
        return key

    @staticmethod
    def check_model(key: ApiKey | None, model: str) -> None:
        """Raises ForbiddenError (403) when ``key`` may not use ``model``."""
        if key is not None and not key.allows(model):
            raise ForbiddenError(
                f"this API key may not use the model `{model}`",
                param="model",
                code="model_not_allowed",
            )
