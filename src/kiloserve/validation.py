"""Helpers for pydantic validation errors shared by every config loader."""

from __future__ import annotations

import types
import typing

from pydantic import BaseModel

__all__ = ["model_at"]


def _models_in(annotation: object) -> list[type[BaseModel]]:
    """Pydantic models inside an annotation (``X``, ``X | None``, ``list[X]``, ...)."""
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
