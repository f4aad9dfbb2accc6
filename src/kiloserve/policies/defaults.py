"""The ``default`` policy's configuration, as data (the lead tunes it by measurement).

``default`` is ``scored`` with these scorer weights and the ``max`` picker: predicted
time to first token (``ttft``, 2.0: each backend's learned prefill speed times the
prefill work queued on it, cached prefix blocks counted as done), queue share (1.0),
KV headroom (1.0) and prefix match (0.5). ``ttft`` sends long prompts where they finish
first on a heterogeneous pool; ``queue`` and ``kv`` break ties and keep a saturated
backend from winning on an old prefix; ``prefix`` at 0.5 keeps affinity when the
predictions are close. The measurements behind the numbers are in docs/policies.md
("Why the default weights"). Change the numbers here or override them per deployment
in YAML."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Literal

__all__ = ["DEFAULT_PICKER", "DEFAULT_SCORER_WEIGHTS"]

DEFAULT_SCORER_WEIGHTS: Mapping[str, float] = MappingProxyType(
    {"ttft": 2.0, "queue": 1.0, "kv": 1.0, "prefix": 0.5}
)
DEFAULT_PICKER: Literal["max", "weighted_random"] = "max"
