"""Guards of the admin surfaces against the operator's own browser: DNS rebinding, CSRF.

A web page the operator visits can make the browser send requests to
``http://127.0.0.1:8000``: cross-site POSTs with a ``text/plain`` or form body need no
CORS preflight (CSRF), and a page whose own DNS name is rebound to 127.0.0.1 can even
read the answers (the request then carries ``Host: attacker.example``). The gateway's
admin API and dashboard and the engine twin's ``/admin/faults`` call
``check_browser_request`` on every request; it raises the errors of
``kiloserve.errors`` for:

* a ``Host`` that is neither an IP address, ``localhost``, the bound host nor a
  configured name: 403 ``host_not_allowed`` (an IP literal cannot be rebound, a name can);
* ``Sec-Fetch-Site: cross-site``, unless it is a plain top-level navigation (a link
  followed to a page): 403 ``cross_site``;
* an ``Origin`` other than the request's own (its scheme's default port filled in) or a
  configured name: 403 ``cross_origin``;
* a write (POST, PUT, PATCH, DELETE) whose body is not ``application/json``, or that
  names a type a page may send cross-site without a CORS preflight (``text/plain``,
  ``application/x-www-form-urlencoded``, ``multipart/form-data``) even with no body:
  400 ``json_required``. A write with no body and another type or none passes
  (``curl -XPOST``; aiohttp sends ``application/octet-stream``); a browser must ask a
  preflight (which nothing here answers) before it sends such a type cross-origin.

Pure functions over header values, no aiohttp: the gateway and the engine twin sit on
different layers and both use this. ``check_bearer`` compares a bearer token in
constant time.
"""

from __future__ import annotations

import hmac
import ipaddress
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from kiloserve.errors import ForbiddenError, RequestError, UnauthorizedError

__all__ = [
    "WRITE_METHODS",
    "HostPolicy",
    "check_bearer",
    "check_browser_request",
    "is_loopback_host",
    "split_host",
]

WRITE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
_DEFAULT_PORTS = {"http": 80, "https": 443}
# what a page may send cross-site without a CORS preflight (a form or a no-cors fetch)
_CORS_SAFELISTED_TYPES = frozenset(
    {"text/plain", "application/x-www-form-urlencoded", "multipart/form-data"}
)
_NAME = re.compile(r"[a-z0-9_]([a-z0-9_.-]*[a-z0-9_])?")
_WILDCARD_BINDS = frozenset({"", "0.0.0.0", "::"})


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def split_host(value: str) -> tuple[str, int | None]:
    """``host``, ``host:port``, ``[v6]``, ``[v6]:port`` (or a bare IPv6 address) ->
    ``(host, port)``: lower case, no brackets, no trailing dot, port ``None`` when absent.
    Raises ``ValueError`` for anything else (a path, user info, a bad port)."""
    text = value.strip().lower()
    port_text: str | None = None
    if text.startswith("["):
        host, bracket, rest = text[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")) or not _is_ip(host):
            raise ValueError(f"not a host or host:port: {value!r}")
        port_text = rest[1:] if rest else None
    elif text.count(":") > 1:  # a bare IPv6 address (config values), never with a port
        host = text
        if not _is_ip(host):
            raise ValueError(f"not a host or host:port: {value!r}")
    else:
        host, colon, port_text_or_empty = text.partition(":")
        port_text = port_text_or_empty if colon else None
        host = host.removesuffix(".")
        if not _NAME.fullmatch(host):
            raise ValueError(f"not a host or host:port: {value!r}")
    if port_text is None:
        return host, None
    if not port_text.isdigit() or len(port_text) > 5 or int(port_text) > 65535:
        raise ValueError(f"not a host or host:port: {value!r}")
    return host, int(port_text)


def is_loopback_host(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1; with or without a
    port or brackets): a bind address only this machine can reach."""
    try:
        name, _ = split_host(host)
    except ValueError:
        return False
    if name == "localhost":
        return True
    try:
        addr = ipaddress.ip_address(name)
    except ValueError:
        return False
    mapped = getattr(addr, "ipv4_mapped", None)
    return bool(addr.is_loopback or (mapped is not None and mapped.is_loopback))


@dataclass(frozen=True, slots=True)
class HostPolicy:
    """Which ``Host`` (and ``Origin``) names a guarded endpoint answers.

    ``bound``: the bind address when it is a name (any port); ``allowed``: configured
    ``(name, port)`` pairs, port ``None`` for any port. IP addresses and ``localhost``
    are always allowed as ``Host``; as ``Origin`` only the request's own origin and the
    ``allowed`` names are (a different port on the same host is another web origin).
    """

    bound: frozenset[str] = frozenset()
    allowed: frozenset[tuple[str, int | None]] = frozenset()
    setting: str = "the allowed hosts"  # where names are configured, for the error message

    @classmethod
    def of(
        cls, bound_host: str | None = None, allowed: Iterable[str] = (), setting: str = ""
    ) -> HostPolicy:
        """From the bind address and configured names (``name`` or ``name:port``);
        raises ``ValueError`` for a malformed name. ``setting`` names where the names
        are configured (error messages)."""
        bound: set[str] = set()
        if bound_host is not None and bound_host.strip() not in _WILDCARD_BINDS:
            name, _ = split_host(bound_host)
            if not _is_ip(name):
                bound.add(name)
        allowed_pairs = frozenset(split_host(a) for a in allowed)
        return cls(frozenset(bound), allowed_pairs, setting or "the allowed hosts")

    def _is_listed(self, host: str, port: int | None) -> bool:
        return (host, None) in self.allowed or (port is not None and (host, port) in self.allowed)

    def allows_host(self, host: str, port: int | None) -> bool:
        """May a request with this ``Host`` be answered (DNS rebinding)?"""
        if host == "localhost" or host in self.bound:
            return True
        return _is_ip(host) or self._is_listed(host, port)

    def allows_origin(self, origin: str, host_header: str | None) -> bool:
        """Is ``origin`` the request's own origin (``Host`` with the scheme's default
        port filled in) or a configured name?"""
        try:
            parts = urlsplit(origin.strip())
            default_port = _DEFAULT_PORTS[parts.scheme]
            o_host, o_port = split_host(parts.netloc)
        except (KeyError, ValueError):
            return False  # "null" (sandboxed frames, file://), other schemes, junk
        if parts.path or parts.query or parts.fragment:
            return False
        o_port = default_port if o_port is None else o_port
        if host_header is not None:
            try:
                h_host, h_port = split_host(host_header)
            except ValueError:
                return False
            if (h_host, default_port if h_port is None else h_port) == (o_host, o_port):
                return True
        return self._is_listed(o_host, o_port)


def _is_navigation(method: str, headers: Mapping[str, str]) -> bool:
    """A plain top-level navigation (a link followed): harmless even cross-site."""
    return (
        method in ("GET", "HEAD")
        and headers.get("Sec-Fetch-Mode") == "navigate"
        and headers.get("Sec-Fetch-Dest") not in ("object", "embed")
    )


def _is_json_enough(content_type: str | None, has_body: bool) -> bool:
    """A body must be JSON; no body may come with any type but a CORS-safelisted one."""
    media_type = (content_type or "").partition(";")[0].strip().lower()
    if media_type == "application/json":
        return True
    return not has_body and media_type not in _CORS_SAFELISTED_TYPES


def check_browser_request(
    method: str, headers: Mapping[str, str], has_body: bool, policy: HostPolicy
) -> None:
    """Refuse what a hostile web page could make the operator's browser send (see the
    module docstring). ``headers`` is looked up by the names ``Host``, ``Origin``,
    ``Sec-Fetch-Site``, ``Sec-Fetch-Mode``, ``Sec-Fetch-Dest``, ``Content-Type`` (aiohttp's
    ``request.headers`` is case-insensitive); ``has_body``: the request carries a body."""
    method = method.upper()
    host_header = headers.get("Host")
    if host_header is not None:
        try:
            host, port = split_host(host_header)
        except ValueError:
            host, port = "", None
        if not policy.allows_host(host, port):
            raise ForbiddenError(
                f"Host {host_header[:100]!r} is not allowed here: call it by IP address or"
                f" localhost, or add the name to {policy.setting}",
                code="host_not_allowed",
            )
    if headers.get("Sec-Fetch-Site") == "cross-site" and not _is_navigation(method, headers):
        raise ForbiddenError("cross-site requests are refused here", code="cross_site")
    origin = headers.get("Origin")
    if origin is not None and not policy.allows_origin(origin, host_header):
        raise ForbiddenError("cross-origin requests are refused here", code="cross_origin")
    if method in WRITE_METHODS and not _is_json_enough(headers.get("Content-Type"), has_body):
        raise RequestError(
            "this endpoint takes Content-Type: application/json", code="json_required"
        )


def check_bearer(authorization: str | None, token: str) -> None:
    """Raise ``UnauthorizedError`` unless ``authorization`` is ``Bearer <token>``
    (compared in constant time)."""
    given = (authorization or "").encode()
    if not hmac.compare_digest(given, f"Bearer {token}".encode()):
        raise UnauthorizedError("missing or wrong bearer token")
