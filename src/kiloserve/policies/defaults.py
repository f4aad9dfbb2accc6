"""The ``default`` policy's configuration, as data (the lead tunes it by measurement).

``default`` is ``scored`` with these scorer weights and the ``max`` picker: load
(in-flight requests and outstanding tokens), KV headroom, and prefix match at 1.5. A
backend holding the whole prefix beats an idle one until its queue share plus KV usage
pass 1.5 (e.g. 75% of ``max_num_seqs`` and 75% KV), so affinity does not drive a node
into preemption. Change the numbers here or override them per deployment in YAML.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Literal

__all__ = ["DEFAULT_PICKER", "DEFAULT_SCORER_WEIGHTS"]

DEFAULT_SCORER_WEIGHTS: Mapping[str, float] = MappingProxyType(
    {"queue": 1.0, "tokens": 1.0, "kv": 1.0, "prefix": 1.5}
)
DEFAULT_PICKER: Literal["max", "weighted_random"] = "max"
