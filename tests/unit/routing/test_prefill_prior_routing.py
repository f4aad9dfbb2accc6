"""Start-up on a mixed H100/A100 pool through the real gateway config, table and
``Router`` with the ``default`` policy (issue 14, the live mix at 90%).

The H100s have learned their prefill speed, the A100s are young (fewer than three
first tokens). Before the prior, a young A100 took the pool's median speed, the
H100s', and a long prompt went to the A100 with the least queued work; now it
predicts the H100 speed x the catalog's capability ratio (2.4x slower) and the
long prompt goes to an H100 that finishes it first.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from kiloserve.gateway.config import parse_gateway_config
from kiloserve.policies import create_policy
from kiloserve.policies.base import RequestInfo
from kiloserve.routing.config import BackendConfig
from kiloserve.routing.engine_metrics import EngineMetrics
from kiloserve.routing.router import Router
from kiloserve.routing.table import BackendTable

GPUS = {"h1": "H100", "h2": "H100", "a1": "A100", "a2": "A100"}


def _router(gpus: dict[str, str], tp: int = 1) -> Router:
    backends: list[dict[str, Any]] = [
        {"name": b, "url": f"http://127.0.0.1:{9001 + i}", "models": ["m"], "gpu": gpu, "tp": tp}
        for i, (b, gpu) in enumerate(gpus.items())
    ]
    table = BackendTable(parse_gateway_config({"backends": backends}))
    return Router(table, create_policy("default"), random.Random(0))


def _info(rid: str, tokens: int) -> RequestInfo:
    return RequestInfo(rid, "m", input_tokens=tokens, predicted_output_tokens=64)


def _start_up(router: Router) -> None:
    """Three 1,000-token requests done on each H100 at 0.1 ms/token (learned); then
    each backend runs one request: 2,000 prompt tokens on the H100s, 500 on the A100s."""
    for b in ("h1", "h2"):
        for i in range(3):
            info = _info(f"{b}-{i}", 1000)
            router.dispatch(b, info)
            router.first_token(b, info, 100.0)
            router.complete(b, info, ok=True, status=200, started_s=0.0, first_token_s=0.1,
                            last_token_s=0.5, output_tokens=64)  # fmt: skip
    for b in router.table.backend_ids():
        router.dispatch(b, _info(f"{b}-busy", 2000 if b.startswith("h") else 500))
        router.table.record_scrape(b, EngineMetrics("vllm", 1, 0, 0.05), now_s=1.0)


@pytest.mark.parametrize("tp", [1, 4])
def test_a_long_prompt_at_start_up_goes_to_an_h100(tp: int) -> None:
    router = _router(GPUS, tp)
    _start_up(router)
    states = {b: router.table.state(b) for b in GPUS}
    assert states["h1"].num_ttft_samples == 3 and states["a1"].num_ttft_samples == 0
    assert states["h1"].prefill_capability == pytest.approx(tp * 989.0 * 0.45)
    assert states["a1"].prefill_capability == pytest.approx(tp * 312.0 * 0.60)
    # H100: 0.1 x (2000 + 16000) = 1.8 s; A100: 0.1 x 2.38 x (500 + 16000) = 3.9 s (the
    # pool median, 0.1, said 1.65 s: the A100 won, and its real TTFT formed the tail)
    ranked = router.decide(_info("long", 16_000), now_s=1.0).ranked
    assert ranked[0] in {"h1", "h2"}
    assert set(ranked[2:]) == {"a1", "a2"}
    # a short prompt still goes to the least-loaded A100: 0.24 x 600 < 0.1 x 2100
    assert router.decide(_info("short", 100), now_s=1.0).ranked[0] in {"a1", "a2"}


def test_without_a_catalog_gpu_the_a100s_take_the_pool_median() -> None:
    """The same start-up with GPU names the catalog does not know: no prior, the young
    backends take the learned median (the old behaviour) and win the long prompt."""
    router = _router({"h1": "gpu-x", "h2": "gpu-x", "a1": "gpu-y", "a2": "gpu-y"})
    _start_up(router)
    assert router.table.state("a1").prefill_capability is None
    assert router.decide(_info("long", 16_000), now_s=1.0).ranked[0] in {"a1", "a2"}


def test_a_re_added_backend_gets_its_new_capability() -> None:
    """The registry re-adding a backend with another GPU or TP updates its capability."""
    router = _router({"h1": "H100", "a1": "A100"})
    table = router.table
    table.add_backend(BackendConfig(url="http://127.0.0.1:9002", name="a1", gpu="H100", tp=2))
    assert table.state("a1").prefill_capability == pytest.approx(2 * 989.0 * 0.45)
    table.add_backend(BackendConfig(url="http://127.0.0.1:9002", name="a1", gpu="unknown"))
    assert table.state("a1").prefill_capability is None
