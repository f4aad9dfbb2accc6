"""GPU and model catalog: specs, built-in data, user additions, quantisation bytes."""

from __future__ import annotations

from kiloserve.catalog.loader import (
    estimate_num_params,
    get_gpu,
    get_model,
    list_gpus,
    list_models,
    load_gpus_file,
    load_model_config,
    load_models_file,
)
from kiloserve.catalog.specs import (
    GIB,
    KV_DTYPES,
    QUANTS,
    GpuSpec,
    ModelSpec,
    kv_bytes_per_element,
    normalize_name,
    weight_bytes_per_param,
)

__all__ = [
    "GIB",
    "KV_DTYPES",
    "QUANTS",
    "GpuSpec",
    "ModelSpec",
    "estimate_num_params",
    "get_gpu",
    "get_model",
    "kv_bytes_per_element",
    "list_gpus",
    "list_models",
    "load_gpus_file",
    "load_model_config",
    "load_models_file",
    "normalize_name",
    "weight_bytes_per_param",
]
