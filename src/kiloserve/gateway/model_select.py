"""Which model a request asks for (SPEC S1.1): the body's ``model``, a header, or a
claim of a verified JWT (the ``model_from:`` config section; off by default).

Precedence, highest first (docs/gateway.md, "Model selection"):

1. the ``jwt_claim`` of a JWT whose signature verified (``jwt_secret_env``: HMAC
   SHA-256/384/512): an identity provider pins a tenant to a model version, and a
   client cannot talk its way past it;
2. the ``header`` (``x-kiloserve-model``): set by a trusted proxy in front (an A/B or
   canary split, an ingress rule);
3. the body's ``model``: the client's own choice.

With ``override_body: false`` the header and the claim only fill a body without a
``model``. A token that looks like a JWT (three dot-separated parts) and fails its
check (signature, algorithm, ``exp`` / ``nbf``, ``iss`` / ``aud`` when configured) is
a 401: a claim is never read from an unverified token. A bearer value that is no JWT
(an API key) carries no claim. The chosen model then goes through the same checks as
a body's (served models, an API key's ``allowed_models``).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import time
from collections.abc import Callable, Mapping
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, model_validator

from kiloserve.errors import ConfigError, UnauthorizedError

__all__ = ["ModelFromConfig", "ModelPicker", "verify_jwt"]

JwtAlgorithm = Literal["HS256", "HS384", "HS512"]
_DIGESTS: dict[str, Callable[[], Any]] = {
    "HS256": hashlib.sha256,
    "HS384": hashlib.sha384,
    "HS512": hashlib.sha512,
}
_LEEWAY_S = 30.0  # clock skew allowed on exp / nbf


def _default_algorithms() -> list[JwtAlgorithm]:
    return ["HS256"]


class ModelFromConfig(BaseModel):
    """The ``model_from:`` config section (every source off by default)."""

    model_config = ConfigDict(extra="forbid")

    header: str | None = Field(default=None, min_length=1)
    jwt_claim: str | None = Field(default=None, min_length=1)
    jwt_secret_env: str | None = Field(default=None, min_length=1)
    jwt_algorithms: list[JwtAlgorithm] = Field(default_factory=_default_algorithms, min_length=1)
    jwt_header: str = "authorization"
    jwt_issuer: str | None = None
    jwt_audience: str | None = None
    override_body: bool = True

    @model_validator(mode="after")
    def _claim_needs_secret(self) -> ModelFromConfig:
        if self.jwt_claim is not None and self.jwt_secret_env is None:
            raise ValueError("jwt_claim needs jwt_secret_env (claims are read only when verified)")
        return self


def _b64url(segment: str) -> bytes:
    return base64.urlsafe_b64decode(segment + "=" * (-len(segment) % 4))


def _json_part(segment: str) -> dict[str, Any]:
    try:
        value = orjson.loads(_b64url(segment))
    except (binascii.Error, ValueError) as exc:
        raise UnauthorizedError("malformed JWT", code="invalid_token") from exc
    if not isinstance(value, dict):
        raise UnauthorizedError("malformed JWT", code="invalid_token")
    return value


def _check_times(claims: Mapping[str, Any], now_s: float) -> None:
    exp, nbf = claims.get("exp"), claims.get("nbf")
    if isinstance(exp, int | float) and now_s > exp + _LEEWAY_S:
        raise UnauthorizedError("the JWT has expired", code="invalid_token")
    if isinstance(nbf, int | float) and now_s < nbf - _LEEWAY_S:
        raise UnauthorizedError("the JWT is not valid yet", code="invalid_token")


def verify_jwt(
    token: str,
    secret: bytes,
    algorithms: list[JwtAlgorithm],
    now_s: float,
    *,
    issuer: str | None = None,
    audience: str | None = None,
) -> dict[str, Any]:
    """The claims of an HMAC-signed JWT, or ``UnauthorizedError`` (401) when its
    algorithm is not allowed, its signature is wrong, it expired or is not valid yet,
    or its ``iss`` / ``aud`` differ from the configured ones."""
    parts = token.split(".")
    if len(parts) != 3:
        raise UnauthorizedError("malformed JWT", code="invalid_token")
    alg = _json_part(parts[0]).get("alg")
    if alg not in algorithms:  # never "none", never an algorithm the config left out
        raise UnauthorizedError(f"JWT algorithm {alg!r} is not allowed", code="invalid_token")
    signed = f"{parts[0]}.{parts[1]}".encode()
    expected = hmac.new(secret, signed, _DIGESTS[str(alg)]).digest()
    try:
        given = _b64url(parts[2])
    except (binascii.Error, ValueError) as exc:
        raise UnauthorizedError("malformed JWT signature", code="invalid_token") from exc
    if not hmac.compare_digest(expected, given):
        raise UnauthorizedError("invalid JWT signature", code="invalid_token")
    claims = _json_part(parts[1])
    _check_times(claims, now_s)
    if issuer is not None and claims.get("iss") != issuer:
        raise UnauthorizedError("JWT issuer not accepted", code="invalid_token")
    aud = claims.get("aud")
    if audience is not None and audience != aud and not (isinstance(aud, list) and audience in aud):
        raise UnauthorizedError("JWT audience not accepted", code="invalid_token")
    return claims


class ModelPicker:
    """Applies ``model_from`` to a parsed body (module docstring for the precedence)."""

    def __init__(self, cfg: ModelFromConfig, env: Mapping[str, str] | None = None) -> None:
        self.cfg = cfg
        self._header = cfg.header.lower() if cfg.header else None
        self._secret: bytes | None = None
        if cfg.jwt_claim is not None and cfg.jwt_secret_env is not None:
            value = (os.environ if env is None else env).get(cfg.jwt_secret_env, "")
            if not value:
                raise ConfigError(
                    f"model_from.jwt_secret_env: environment variable {cfg.jwt_secret_env} "
                    "is not set"
                )
            self._secret = value.encode()

    @property
    def is_enabled(self) -> bool:
        return self._header is not None or self._secret is not None

    def _claim(self, headers: Mapping[str, str]) -> str | None:
        if self._secret is None or self.cfg.jwt_claim is None:
            return None
        value = headers.get(self.cfg.jwt_header, "")
        token = value[7:].strip() if value.startswith("Bearer ") else ""
        if token.count(".") != 2:  # no bearer token, or one that is no JWT (an API key)
            return None
        claims = verify_jwt(
            token, self._secret, self.cfg.jwt_algorithms, time.time(),
            issuer=self.cfg.jwt_issuer, audience=self.cfg.jwt_audience,
        )  # fmt: skip
        model = claims.get(self.cfg.jwt_claim)
        return model if isinstance(model, str) and model else None

    def pick(self, body: dict[str, Any], headers: Mapping[str, str]) -> bool:
        """Set ``body["model"]`` from the configured sources; True when it changed (the
        body must then be re-encoded before it is sent on)."""
        if not self.is_enabled:
            return False
        chosen = self._claim(headers)
        if chosen is None and self._header is not None:
            chosen = headers.get(self._header) or None
        current = body.get("model")
        has_model = isinstance(current, str) and bool(current)
        if chosen is None or chosen == current or (has_model and not self.cfg.override_body):
            return False
        body["model"] = chosen
        return True
