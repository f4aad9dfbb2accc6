"""GPU and model catalog: specs, built-in data, user additions, quantisation bytes."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kiloserve.lazy import lazy_exports

if TYPE_CHECKING:
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

_HOMES = {
    "GIB": "kiloserve.catalog.specs",
    "KV_DTYPES": "kiloserve.catalog.specs",
    "QUANTS": "kiloserve.catalog.specs",
    "GpuSpec": "kiloserve.catalog.specs",
    "ModelSpec": "kiloserve.catalog.specs",
    "estimate_num_params": "kiloserve.catalog.loader",
    "get_gpu": "kiloserve.catalog.loader",
    "get_model": "kiloserve.catalog.loader",
    "kv_bytes_per_element": "kiloserve.catalog.specs",
    "list_gpus": "kiloserve.catalog.loader",
    "list_models": "kiloserve.catalog.loader",
    "load_gpus_file": "kiloserve.catalog.loader",
    "load_model_config": "kiloserve.catalog.loader",
    "load_models_file": "kiloserve.catalog.loader",
    "normalize_name": "kiloserve.catalog.specs",
    "weight_bytes_per_param": "kiloserve.catalog.specs",
}
__getattr__, __dir__ = lazy_exports(__name__, __all__, _HOMES)
