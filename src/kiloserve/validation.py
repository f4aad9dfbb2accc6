"""Helpers for validation errors shared by every config loader (pydantic or not)."""

from __future__ import annotations

import types
import typing
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported lazily: the catalog uses this module without pydantic
    from pydantic import BaseModel

__all__ = ["is_tcp_endpoint", "model_at", "unknown_keys_message"]


def is_tcp_endpoint(value: str) -> bool:
    """True for a ZMQ ``tcp://host:port`` to connect to (a host, not ``*``; a port > 0)."""
    from urllib.parse import urlsplit

    parts = urlsplit(value)
    try:
        port = parts.port
    except ValueError:
        return False
    return parts.scheme == "tcp" and bool(parts.hostname) and parts.hostname != "*" and bool(port)


def _models_in(annotation: object) -> list[type[BaseModel]]:
    """Pydantic models inside an annotation (``X``, ``X | None``, ``list[X]``, ...)."""
    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    args = typing.get_args(annotation)
    if not args and isinstance(annotation, types.UnionType):
        args = annotation.__args__
    return [m for a in args for m in _models_in(a)]


def model_at(root: type[BaseModel], loc: tuple[int | str, ...]) -> type[BaseModel]:
    """The model that owns the key at ``loc`` of a validation error, for a 'valid keys'
    hint: walks ``loc`` (minus its last part) through nested models, lists and dicts."""
    model = root
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part)
        if field is None:
            continue  # a dict key (e.g. a model name): stay in the current model
        inner = _models_in(field.annotation)
        if not inner:
            break
        model = inner[0]
    return model


def unknown_keys_message(unknown: Iterable[object], valid: Iterable[str]) -> str:
    """``unknown key 'x' (valid keys: a, b)``, or ``unknown keys 'x', 'y' (...)`` for
    several; ``valid`` is listed in the order given (callers sort it where they want)."""
    names = [f"'{key}'" for key in unknown]
    noun = "key" if len(names) == 1 else "keys"
    return f"unknown {noun} {', '.join(names)} (valid keys: {', '.join(valid)})"
