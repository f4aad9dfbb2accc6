"""Policies by name: the only entry point the gateway and the simulator use.

``create_policy(name, params)`` validates ``params`` with the policy's pydantic model
(``extra="forbid"``) and returns a fresh policy object (its own cursor / prefix index).
``"default"`` is ``scored`` with ``defaults.DEFAULT_SCORER_WEIGHTS``; params given to
``default`` override those defaults key by key.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, TypeVar

from pydantic import ValidationError

from kiloserve.errors import ConfigError
from kiloserve.policies.base import Policy
from kiloserve.policies.canary import CanaryParams, CanaryPolicy
from kiloserve.policies.cost_aware import CostAwareParams, CostAwarePolicy
from kiloserve.policies.defaults import DEFAULT_PICKER, DEFAULT_SCORER_WEIGHTS
from kiloserve.policies.least_kv import LeastKvParams, LeastKvPolicy
from kiloserve.policies.least_request import LeastRequestParams, LeastRequestPolicy
from kiloserve.policies.least_tokens import LeastTokensParams, LeastTokensPolicy
from kiloserve.policies.length_least_conn import LengthLeastConnParams, LengthLeastConnPolicy
from kiloserve.policies.params import PolicyParams
from kiloserve.policies.power_of_two import PowerOfTwoParams, PowerOfTwoPolicy
from kiloserve.policies.prefix_affinity import PrefixAffinityParams, PrefixAffinityPolicy
from kiloserve.policies.random_pick import RandomParams, RandomPolicy
from kiloserve.policies.round_robin import RoundRobinParams, RoundRobinPolicy
from kiloserve.policies.scored import ScoredParams, ScoredPolicy
from kiloserve.policies.seed_weighted import SeedWeightedParams, SeedWeightedPolicy
from kiloserve.policies.session_affinity import SessionAffinityParams, SessionAffinityPolicy
from kiloserve.policies.weighted_round_robin import (
    WeightedRoundRobinParams,
    WeightedRoundRobinPolicy,
)

__all__ = ["available_policies", "create_policy"]

_Factory = Callable[[Any], Policy]

_POLICIES: Mapping[str, tuple[type[PolicyParams], _Factory]] = MappingProxyType(
    {
        "round_robin": (RoundRobinParams, RoundRobinPolicy),
        "random": (RandomParams, RandomPolicy),
        "least_request": (LeastRequestParams, LeastRequestPolicy),
        "least_tokens": (LeastTokensParams, LeastTokensPolicy),
        "power_of_two": (PowerOfTwoParams, PowerOfTwoPolicy),
        "least_kv": (LeastKvParams, LeastKvPolicy),
        "seed_weighted": (SeedWeightedParams, SeedWeightedPolicy),
        "weighted_round_robin": (WeightedRoundRobinParams, WeightedRoundRobinPolicy),
        "length_least_conn": (LengthLeastConnParams, LengthLeastConnPolicy),
        "prefix_affinity": (PrefixAffinityParams, PrefixAffinityPolicy),
        "session_affinity": (SessionAffinityParams, SessionAffinityPolicy),
        "cost_aware": (CostAwareParams, CostAwarePolicy),
        "canary": (CanaryParams, CanaryPolicy),
        "scored": (ScoredParams, ScoredPolicy),
    }
)
_DEFAULT = "default"
_P = TypeVar("_P", bound=PolicyParams)


def available_policies() -> list[str]:
    """Every name ``create_policy`` accepts, sorted (``default`` included)."""
    return sorted([*_POLICIES, _DEFAULT])


def create_policy(name: str, params: Mapping[str, Any] | None = None) -> Policy:
    """A new policy called ``name`` configured by ``params`` (raises ``ConfigError``)."""
    if name == _DEFAULT:
        merged = {"scorers": dict(DEFAULT_SCORER_WEIGHTS), "picker": DEFAULT_PICKER}
        merged.update(params or {})
        return ScoredPolicy(_validate(ScoredParams, merged, name), name=_DEFAULT)
    entry = _POLICIES.get(name)
    if entry is None:
        valid = ", ".join(available_policies())
        raise ConfigError(f"unknown policy {name!r}; valid policies: {valid}")
    params_cls, factory = entry
    return factory(_validate(params_cls, params or {}, name))


def _validate(params_cls: type[_P], params: Mapping[str, Any], policy: str) -> _P:
    if not isinstance(params, Mapping):
        raise ConfigError(f"params of policy {policy!r} must be a mapping, got {params!r}")
    try:
        return params_cls.model_validate(dict(params))
    except ValidationError as exc:
        raise ConfigError(_describe(exc, params_cls, policy)) from exc


def _describe(exc: ValidationError, params_cls: type[PolicyParams], policy: str) -> str:
    valid = ", ".join(params_cls.model_fields) or "none"
    problems = []
    for err in exc.errors():
        where = ".".join(str(part) for part in err["loc"]) or "params"
        if err["type"] == "extra_forbidden":
            problems.append(f"unknown parameter {where!r}")
        else:
            problems.append(f"invalid parameter {where!r}: {err['msg']}")
    return f"policy {policy!r}: {'; '.join(problems)} (valid parameters: {valid})"
