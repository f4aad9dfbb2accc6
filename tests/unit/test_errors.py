"""The one error tree: its drawing is true, and every HTTP error has one type per status."""

from __future__ import annotations

import importlib
import pkgutil
import re

import pytest

import kiloserve
import kiloserve.errors as errors
from kiloserve.errors import ERROR_TYPES, KiloserveError, RequestError

# every module that raises or answers HTTP errors: none may define its own error class
_HTTP_MODULES = (
    "kiloserve.gateway.app",
    "kiloserve.gateway.admin",
    "kiloserve.gateway.errors",
    "kiloserve.gateway.proxy",
    "kiloserve.gateway.admission.auth",
    "kiloserve.gateway.admission.controller",
    "kiloserve.gateway.admission.gate",
    "kiloserve.gateway.admission.queue",
    "kiloserve.engine.server",
)
_LINE = re.compile(r"^(?P<indent>[ │├└─]*)(?P<name>\w+)(?:\s+(?P<status>\d{3}) (?P<type>\w+))?")


def _subclasses(cls: type[KiloserveError]) -> list[type[KiloserveError]]:
    out = []
    for sub in cls.__subclasses__():
        out += [sub, *_subclasses(sub)]
    return out


def _drawing() -> list[tuple[int, str, int | None, str | None]]:
    """(depth, class name, status, type) per line of the tree in errors.py's docstring."""
    doc = errors.__doc__ or ""
    block = doc.split("\n\n")[1]
    rows = []
    for line in block.splitlines():
        m = _LINE.match(line.strip("\n")[4:])
        if m is None or not m["name"].endswith("Error"):
            continue  # a continuation line
        status = int(m["status"]) if m["status"] else None
        rows.append((len(m["indent"]), m["name"], status, m["type"]))
    return rows


def _http_classes() -> list[type[RequestError]]:
    for name in _HTTP_MODULES:
        importlib.import_module(name)
    return [RequestError, *(c for c in _subclasses(RequestError) if issubclass(c, RequestError))]


def _import_every_module() -> None:
    """Every kiloserve module, so a subclass defined anywhere is seen (not only those
    an earlier test happened to import)."""
    for info in pkgutil.walk_packages(kiloserve.__path__, "kiloserve."):
        if not info.name.endswith("__main__"):
            importlib.import_module(info.name)


def test_the_drawing_is_the_tree() -> None:
    _import_every_module()
    rows = _drawing()
    drawn = {name for _, name, _, _ in rows}
    defined = {"KiloserveError", *(c.__name__ for c in _subclasses(KiloserveError))}
    assert drawn == defined
    parents: list[tuple[int, str]] = []
    for depth, name, status, err_type in rows:
        while parents and parents[-1][0] >= depth:
            parents.pop()
        cls = getattr(errors, name)
        if parents:
            assert cls.__bases__ == (getattr(errors, parents[-1][1]),), name
        if issubclass(cls, RequestError):
            assert (status, err_type) == (cls.status, cls.err_type), name
        parents.append((depth, name))


@pytest.mark.parametrize("cls", _http_classes(), ids=lambda c: c.__name__)
def test_every_http_error_has_the_one_type_of_its_status(cls: type[RequestError]) -> None:
    assert cls.__module__ == "kiloserve.errors"  # one tree: no HTTP error defined elsewhere
    assert ERROR_TYPES[cls.status] == cls.err_type
    if issubclass(cls, errors.QueueFullError):
        exc: RequestError = cls("boom", lane="short", code="c")
    else:
        exc = cls("boom", code="c")
    assert exc.to_body() == {
        "error": {"message": "boom", "type": cls.err_type, "param": None, "code": "c"}
    }


def test_one_type_per_status_across_the_tree() -> None:
    types: dict[int, set[str]] = {}
    for cls in _http_classes():
        types.setdefault(cls.status, set()).add(cls.err_type)
    assert all(len(t) == 1 for t in types.values()), types
    assert set(types) == set(ERROR_TYPES)


def test_code_defaults_to_the_status_and_retry_after_is_whole_seconds() -> None:
    exc = errors.UnavailableError("later", retry_after_s=0.2, headers={"x-a": "b"})
    assert exc.to_body()["error"] == {
        "message": "later", "type": "service_unavailable", "param": None, "code": 503,
    }  # fmt: skip
    assert exc.response_headers() == {"Retry-After": "1", "x-a": "b"}
    assert errors.TooManyRequestsError("x", retry_after_s=19.2).response_headers() == {
        "Retry-After": "20"
    }
    assert errors.RequestError("x").response_headers() == {}
    assert errors.GatewayTimeoutError("x").status == 504


def test_405_is_in_the_tree_with_the_400_type() -> None:
    exc = errors.MethodNotAllowedError("no", headers={"Allow": "POST"})
    assert (exc.status, exc.err_type) == (405, "invalid_request_error") == (405, ERROR_TYPES[405])
    assert isinstance(exc, RequestError) and exc.response_headers() == {"Allow": "POST"}


def test_clip_keeps_short_values_and_cuts_long_ones_with_their_length() -> None:
    assert errors.clip("m" * 256) == "m" * 256
    assert errors.clip("m" * 100_000) == "m" * 256 + "... (100000 chars)"
    assert errors.clip("abcdef", 3) == "abc... (6 chars)"
