"""Loading and looking up GPU and model specs.

The built-in catalog is two YAML files shipped inside the package (``data/gpus.yaml``,
``data/models.yaml``). Users add GPUs from their own YAML file (same schema: a list of
entries, or one mapping) and models from a Hugging Face ``config.json``; lookups take
those as ``extra`` mappings, checked before the built-ins. Names and aliases match
case-insensitively (``_`` and spaces read as ``-``), and a Hugging Face id such as
``meta-llama/Llama-3.1-8B`` also matches without its organisation prefix.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Iterable, Mapping
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

import yaml

from kiloserve.catalog.specs import GpuSpec, ModelSpec, normalize_name
from kiloserve.errors import CatalogError
from kiloserve.validation import unknown_keys_message

__all__ = [
    "estimate_num_params",
    "get_gpu",
    "get_model",
    "list_gpus",
    "list_models",
    "load_gpus_file",
    "load_model_config",
    "load_models_file",
]

SpecT = TypeVar("SpecT", GpuSpec, ModelSpec)


def _field_kinds(cls: type[Any]) -> tuple[set[str], set[str]]:
    """(all field names, required field names) of a spec dataclass."""
    fields = dataclasses.fields(cls)
    names = {f.name for f in fields}
    required = {f.name for f in fields if f.default is dataclasses.MISSING}
    return names, required - {"aliases"}


def _spec_from_mapping(cls: type[SpecT], raw: Mapping[str, Any], origin: str) -> SpecT:
    """Build a spec from one YAML mapping; unknown or missing keys are named."""
    names, required = _field_kinds(cls)
    unknown = sorted(set(raw) - names)
    if unknown:
        raise CatalogError(f"{origin}: {unknown_keys_message(unknown, sorted(names))}")
    missing = sorted(required - set(raw))
    if missing:
        raise CatalogError(f"{origin}: missing key(s) {', '.join(missing)}")
    values = {f.name: _coerce(raw, f, origin) for f in dataclasses.fields(cls) if f.name in raw}
    values["aliases"] = tuple(str(a) for a in raw.get("aliases") or ())
    spec = cls(**values)
    _check_positive(spec)
    return spec


def _coerce(raw: Mapping[str, Any], field: dataclasses.Field[Any], origin: str) -> Any:
    """Convert one YAML value to the field's type (int, float, optional float, str)."""
    value = raw[field.name]
    kind = str(field.type)
    if field.name == "aliases" or (value is None and "None" in kind):
        return value
    try:
        if kind == "str":
            return str(value)
        if kind == "int" and not isinstance(value, bool) and float(value) == int(value):
            return int(value)
        if kind.startswith("float") and not isinstance(value, bool):
            return float(value)
    except (TypeError, ValueError):
        pass
    raise CatalogError(f"{origin}: {field.name} must be {kind}, got {value!r}")


def _entries(data: Any, origin: str) -> list[Mapping[str, Any]]:
    if isinstance(data, Mapping):
        data = [data]
    if not isinstance(data, list) or not all(isinstance(e, Mapping) for e in data):
        raise CatalogError(f"{origin}: expected a list of mappings (or one mapping)")
    return data


def _parse_yaml(cls: type[SpecT], text: str, origin: str) -> tuple[SpecT, ...]:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise CatalogError(f"{origin}: invalid YAML: {exc}") from exc
    entries = _entries(data, origin)
    return tuple(_spec_from_mapping(cls, e, f"{origin} entry {i}") for i, e in enumerate(entries))


@functools.cache
def _builtin(cls: type[SpecT], filename: str) -> tuple[SpecT, ...]:
    """Built-in specs (immutable tuple, read once per process)."""
    text = resources.files("kiloserve.catalog").joinpath("data", filename).read_text("utf-8")
    return _parse_yaml(cls, text, f"catalog/data/{filename}")


def _builtin_gpus() -> tuple[GpuSpec, ...]:
    return _builtin(GpuSpec, "gpus.yaml")


def _builtin_models() -> tuple[ModelSpec, ...]:
    return _builtin(ModelSpec, "models.yaml")


def _index(specs: Iterable[SpecT]) -> dict[str, SpecT]:
    index: dict[str, SpecT] = {}
    for spec in specs:
        for key in _names(spec):
            index.setdefault(normalize_name(key), spec)
    return index


def _names(spec: GpuSpec | ModelSpec) -> tuple[str, ...]:
    return (spec.name, *spec.aliases)


def _lookup(
    kind: str, name: str, builtin: tuple[SpecT, ...], extra: Mapping[str, SpecT] | None
) -> SpecT:
    specs: list[SpecT] = list((extra or {}).values()) + list(builtin)
    index = _index(specs)
    key = normalize_name(name)
    candidates = [key, key.rsplit("/", 1)[-1]]
    for candidate in candidates:
        if candidate in index:
            return index[candidate]
    valid = ", ".join(dict.fromkeys(s.name for s in specs))
    raise CatalogError(f"unknown {kind} {name!r}; valid: {valid}")


def get_gpu(name: str, extra: Mapping[str, GpuSpec] | None = None) -> GpuSpec:
    """The GPU called ``name`` (or an alias); ``extra`` specs shadow the built-ins."""
    return _lookup("GPU", name, _builtin_gpus(), extra)


def get_model(name: str, extra: Mapping[str, ModelSpec] | None = None) -> ModelSpec:
    """The model called ``name`` (or an alias); ``extra`` specs shadow the built-ins."""
    return _lookup("model", name, _builtin_models(), extra)


def list_gpus() -> list[GpuSpec]:
    """Built-in GPUs in catalog order."""
    return list(_builtin_gpus())


def list_models() -> list[ModelSpec]:
    """Built-in models in catalog order."""
    return list(_builtin_models())


def _read_text(path: str | Path) -> str:
    try:
        return Path(path).read_text("utf-8")
    except OSError as exc:
        raise CatalogError(f"cannot read {path}: {exc}") from exc


def load_gpus_file(path: str | Path) -> dict[str, GpuSpec]:
    """User GPUs from a YAML file (``gpus.yaml`` schema), keyed by name for ``extra``."""
    specs = _parse_yaml(GpuSpec, _read_text(path), str(path))
    return {s.name: s for s in specs}


def load_models_file(path: str | Path) -> dict[str, ModelSpec]:
    """User models from a YAML file (``models.yaml`` schema), keyed by name."""
    specs = _parse_yaml(ModelSpec, _read_text(path), str(path))
    return {s.name: s for s in specs}


def estimate_num_params(
    *,
    num_layers: int,
    hidden_size: int,
    num_attention_heads: int,
    num_kv_heads: int,
    head_dim: int,
    intermediate_size: int,
    vocab_size: int,
    tie_word_embeddings: bool = False,
) -> int:
    """Parameters of a dense Llama/Qwen-style decoder (gated MLP, GQA, RMSNorm)."""
    q_dim = num_attention_heads * head_dim
    kv_dim = num_kv_heads * head_dim
    attention = hidden_size * q_dim * 2 + hidden_size * kv_dim * 2
    mlp = 3 * hidden_size * intermediate_size
    per_layer = attention + mlp + 2 * hidden_size
    embeddings = vocab_size * hidden_size * (1 if tie_word_embeddings else 2)
    return num_layers * per_layer + embeddings + hidden_size


def _config_int(config: Mapping[str, Any], key: str, origin: str) -> int:
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise CatalogError(f"{origin}: {key!r} must be a positive integer, got {value!r}")
    return value


def _model_dims(config: Mapping[str, Any], origin: str) -> dict[str, int]:
    heads = _config_int(config, "num_attention_heads", origin)
    hidden = _config_int(config, "hidden_size", origin)
    dims = {
        "num_layers": _config_int(config, "num_hidden_layers", origin),
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_kv_heads": heads,
        "head_dim": hidden // heads,
        "intermediate_size": _config_int(config, "intermediate_size", origin),
        "vocab_size": _config_int(config, "vocab_size", origin),
    }
    if config.get("num_key_value_heads") is not None:
        dims["num_kv_heads"] = _config_int(config, "num_key_value_heads", origin)
    if config.get("head_dim") is not None:
        dims["head_dim"] = _config_int(config, "head_dim", origin)
    return dims


def _config_name(config: Mapping[str, Any], path: Path) -> str:
    raw = config.get("_name_or_path")
    if isinstance(raw, str) and raw.strip():
        return raw.strip().rstrip("/").rsplit("/", 1)[-1]
    return path.parent.name or path.stem


def load_model_config(
    path: str | Path, name: str | None = None, max_model_len: int | None = None
) -> ModelSpec:
    """A ``ModelSpec`` from a Hugging Face ``config.json`` (file or its folder).

    ``num_params`` is taken from the config when present, else computed from the
    dimensions (``estimate_num_params``). ``max_model_len`` defaults to the config's
    ``max_position_embeddings``.
    """
    file = Path(path)
    if file.is_dir():
        file = file / "config.json"
    origin = str(file)
    try:
        config = json.loads(_read_text(file))
    except json.JSONDecodeError as exc:
        raise CatalogError(f"{origin}: invalid JSON: {exc}") from exc
    if not isinstance(config, Mapping):
        raise CatalogError(f"{origin}: expected a JSON object")
    dims = _model_dims(config, origin)
    num_params = config.get("num_params") or estimate_num_params(
        **dims, tie_word_embeddings=bool(config.get("tie_word_embeddings", False))
    )
    if max_model_len is None:
        max_model_len = _config_int(config, "max_position_embeddings", origin)
    return ModelSpec(
        name=name or _config_name(config, file),
        aliases=(),
        num_params=int(num_params),
        max_model_len=max_model_len,
        **dims,
    )


def _check_positive(spec: GpuSpec | ModelSpec) -> None:
    """Every numeric figure of a spec must be positive (MFUs also at most 1)."""
    for f in dataclasses.fields(spec):
        value = getattr(spec, f.name)
        is_number = isinstance(value, int | float) and not isinstance(value, bool)
        if is_number and (not math.isfinite(value) or value <= 0):
            raise CatalogError(f"{spec.name}: {f.name} must be positive, got {value}")
    if isinstance(spec, GpuSpec) and not (spec.prefill_mfu <= 1 and spec.decode_mfu <= 1):
        raise CatalogError(f"{spec.name}: prefill_mfu / decode_mfu must be <= 1")
