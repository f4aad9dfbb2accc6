"""``kiloserve.httpguard``: the Host / Origin / Fetch-Metadata / Content-Type checks the
gateway's admin API and dashboard and the twin's ``/admin/faults`` share."""

from __future__ import annotations

import pytest

from kiloserve.errors import ForbiddenError, RequestError, UnauthorizedError
from kiloserve.httpguard import (
    HostPolicy,
    check_bearer,
    check_browser_request,
    is_loopback_host,
    split_host,
)

POLICY = HostPolicy.of("127.0.0.1", ["gw.example", "ops.example:443"], "admin_allowed_hosts")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("localhost", ("localhost", None)),
        ("LocalHost.:8000", ("localhost", 8000)),
        ("127.0.0.1:80", ("127.0.0.1", 80)),
        ("[::1]", ("::1", None)),
        ("[::1]:8000", ("::1", 8000)),
        ("::1", ("::1", None)),
        ("gw-1.example_x", ("gw-1.example_x", None)),
    ],
)
def test_split_host(value: str, expected: tuple[str, int | None]) -> None:
    assert split_host(value) == expected


@pytest.mark.parametrize(
    "value",
    ["", ":80", "a b", "user@host", "http://x/", "host:", "host:x", "host:65536", "[::1",
     "[nothost]:1", "[::1]x", "host/path", "-bad"],
)  # fmt: skip
def test_split_host_refuses_junk(value: str) -> None:
    with pytest.raises(ValueError, match="host"):
        split_host(value)


@pytest.mark.parametrize(
    ("host", "expected"),
    [("127.0.0.1", True), ("127.9.9.9", True), ("localhost", True), ("::1", True),
     ("[::1]:8000", True), ("::ffff:127.0.0.1", True), ("0.0.0.0", False),
     ("10.0.0.5", False), ("gw.example", False), ("", False)],
)  # fmt: skip
def test_is_loopback_host(host: str, expected: bool) -> None:
    assert is_loopback_host(host) is expected


def _check(method: str = "GET", has_body: bool = False, **headers: str) -> None:
    names = {k: k.replace("_", "-") for k in headers}
    check_browser_request(method, {names[k]: v for k, v in headers.items()}, has_body, POLICY)


@pytest.mark.parametrize(
    "host",
    ["127.0.0.1:8000", "localhost", "localhost:1", "[::1]:8000", "10.0.0.5:8000", "gw.example",
     "GW.EXAMPLE:8000", "ops.example:443"],
)  # fmt: skip
def test_hosts_allowed(host: str) -> None:
    _check(Host=host)


@pytest.mark.parametrize(
    "host", ["evil.example", "attacker.example:8000", "ops.example:8000", "localhost.evil", "a b",
             "gw.example.evil.example", ""],
)  # fmt: skip
def test_foreign_hosts_are_403(host: str) -> None:
    with pytest.raises(ForbiddenError) as info:
        _check(Host=host)
    assert info.value.code == "host_not_allowed"
    assert "admin_allowed_hosts" in info.value.message


def test_bound_name_is_allowed_with_any_port_and_wildcards_add_nothing() -> None:
    policy = HostPolicy.of("myhost.internal")
    check_browser_request("GET", {"Host": "myhost.internal:8000"}, False, policy)
    assert HostPolicy.of("0.0.0.0") == HostPolicy.of("::") == HostPolicy.of(None)
    with pytest.raises(ForbiddenError):
        check_browser_request("GET", {"Host": "myhost.internal"}, False, HostPolicy.of("0.0.0.0"))


@pytest.mark.parametrize(
    ("origin", "host"),
    [("http://127.0.0.1:8000", "127.0.0.1:8000"), ("http://localhost", "localhost:80"),
     ("https://gw.example", "gw.example"), ("http://gw.example:9", "127.0.0.1:8000"),
     ("https://ops.example", "127.0.0.1:8000"), ("http://[::1]:8000", "[::1]:8000")],
)  # fmt: skip
def test_same_or_allowed_origins_pass(origin: str, host: str) -> None:
    _check("POST", Host=host, Origin=origin, Content_Type="application/json")


@pytest.mark.parametrize(
    ("origin", "host"),
    [("http://evil.example", "127.0.0.1:8000"), ("null", "127.0.0.1:8000"),
     ("http://localhost:8000", "127.0.0.1:8000"), ("http://127.0.0.1:3000", "127.0.0.1:8000"),
     ("https://ops.example:8443", "127.0.0.1"),
     ("file://", "127.0.0.1"), ("http://127.0.0.1:8000/path", "127.0.0.1:8000"),
     ("http://127.0.0.1:8000", "10.0.0.5:8000")],
)  # fmt: skip
def test_cross_origins_are_403(origin: str, host: str) -> None:
    with pytest.raises(ForbiddenError) as info:
        _check("GET", Host=host, Origin=origin)
    assert info.value.code == "cross_origin"


def test_origin_without_host_must_be_listed() -> None:
    check_browser_request("GET", {"Origin": "https://ops.example"}, False, POLICY)
    with pytest.raises(ForbiddenError):
        check_browser_request("GET", {"Origin": "http://127.0.0.1:8000"}, False, POLICY)


def test_cross_site_fetch_metadata() -> None:
    for site in ("same-origin", "same-site", "none"):
        _check("POST", Sec_Fetch_Site=site, Content_Type="application/json")
    for method, mode, dest in [
        ("POST", "navigate", "document"),  # a cross-site form post
        ("GET", "no-cors", "image"),
        ("GET", "cors", "empty"),
        ("GET", "navigate", "object"),
    ]:
        with pytest.raises(ForbiddenError) as info:
            _check(method, Sec_Fetch_Site="cross-site", Sec_Fetch_Mode=mode, Sec_Fetch_Dest=dest)
        assert info.value.code == "cross_site"
    _check("GET", Sec_Fetch_Site="cross-site", Sec_Fetch_Mode="navigate", Sec_Fetch_Dest="document")


@pytest.mark.parametrize("method", ["POST", "PUT", "PATCH", "DELETE", "post"])
def test_writes_must_be_json(method: str) -> None:
    _check(method, True, Content_Type="application/json")
    _check(method, True, Content_Type="Application/JSON; charset=utf-8")
    _check(method, False)  # no body, no Content-Type: curl -XPOST
    _check(method, False, Content_Type="application/octet-stream")  # aiohttp's bare post
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; b=1",
                  "application/jsonx", "text/json"):  # fmt: skip
        with pytest.raises(RequestError) as info:
            _check(method, True, Content_Type=ctype)
        assert info.value.status == 400 and info.value.code == "json_required"
    with pytest.raises(RequestError):
        _check(method, False, Content_Type="text/plain")  # empty, but a page may send it
    with pytest.raises(RequestError):
        _check(method, False, Content_Type="multipart/form-data; boundary=x")
    with pytest.raises(RequestError):
        _check(method, True, Content_Type="application/octet-stream")
    with pytest.raises(RequestError):
        _check(method, True)  # a body without a Content-Type


def test_reads_take_any_content_type() -> None:
    _check("GET", True, Content_Type="text/plain")
    _check("HEAD")


def test_bad_allowed_names_are_value_errors() -> None:
    with pytest.raises(ValueError, match="host"):
        HostPolicy.of(None, ["https://gw.example/"])


def test_check_bearer() -> None:
    check_bearer("Bearer s3cret", "s3cret")
    for given in (None, "", "Bearer nope", "bearer s3cret", "Bearer s3cret ", "s3cret", "Bearer"):
        with pytest.raises(UnauthorizedError):
            check_bearer(given, "s3cret")
