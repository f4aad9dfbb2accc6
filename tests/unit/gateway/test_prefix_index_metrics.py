"""``/metrics`` shows how full the policy's approximate prefix index is (issue 15).

The default policy's index fills to its cap (174,000 blocks, about 25 MiB) over
minutes of random prompts, which is the gateway's RSS growing with no leak; the soak
reads these gauges to tell the index filling from a leak.
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from kiloserve.gateway.app import CTX_KEY, create_gateway_app
from kiloserve.gateway.config import parse_gateway_config
from kiloserve.policies.prefix_index import PrefixIndex

_BACKENDS = [{"url": "http://127.0.0.1:9", "name": "b", "models": ["m"]}]


def _prefix_gauges(policy: dict[str, object]) -> tuple[dict[str, float], object]:
    app = create_gateway_app(parse_gateway_config({"backends": _BACKENDS, "policy": policy}))
    ctx = app[CTX_KEY]
    index = getattr(ctx.router.policy, "index", None)
    if isinstance(index, PrefixIndex):
        index.insert([11, 12, 13], "b")
    text = ctx.metrics.render().decode()
    gauges = {
        s.name: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name.startswith("kiloserve_prefix_index_")
    }
    return gauges, index


def test_default_policy_exports_its_prefix_index_fill_and_cap() -> None:
    gauges, index = _prefix_gauges({"name": "default"})
    assert isinstance(index, PrefixIndex)
    assert gauges == {
        "kiloserve_prefix_index_blocks": 3.0,
        "kiloserve_prefix_index_max_blocks": 174_000.0,
    }


def test_the_cap_follows_the_policy_params() -> None:
    gauges, _ = _prefix_gauges({"name": "prefix_affinity", "params": {"max_num_blocks": 2}})
    assert gauges == {
        "kiloserve_prefix_index_blocks": 2.0,
        "kiloserve_prefix_index_max_blocks": 2.0,
    }


def test_a_policy_without_an_index_exports_no_prefix_index_gauges() -> None:
    gauges, index = _prefix_gauges({"name": "round_robin"})
    assert index is None
    assert gauges == {}
