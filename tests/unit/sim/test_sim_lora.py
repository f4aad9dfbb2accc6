"""LoRA adapters in the simulator: the gateway's placement rule and the twin's swap cost."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiloserve.engine.lora import LORA_DISK_LOAD_S, LORA_GPU_SWAP_S
from kiloserve.launch.config import load_cluster_config
from kiloserve.policies.registry import create_policy
from kiloserve.sim.cluster import build_backends, build_gateway_config, describe_backends
from kiloserve.sim.gateway import ModelPicker, SimGateway
from kiloserve.sim.lora import SimLora, SimLoraSpec
from kiloserve.sim.prompts import PromptIds
from kiloserve.sim.results import MetricsCollector
from kiloserve.sim.simulator import Simulator
from kiloserve.workload import load_workload

TINY = Path(__file__).resolve().parents[3] / "examples" / "cluster-tiny.yaml"
BASE = "Llama-3.1-8B"


class _Recording(SimLora):
    """Records, for each request, its model and the adapter's holders at routing time."""

    seen: dict[str, tuple[str, list[str]]]

    def model_for(self, model: str, request_id: str, now_s: float) -> str:
        chosen = super().model_for(model, request_id, now_s)
        holders = self.placement.holders(chosen) if chosen != model else []
        self.seen[request_id] = (chosen, holders)
        return chosen


def _run(spec: SimLoraSpec | None, num_requests: int = 120) -> tuple[Simulator, _Recording | None]:
    cluster = load_cluster_config(TINY)
    backends = build_backends(cluster)
    gateway_cfg = build_gateway_config(cluster, describe_backends(cluster), 0.2)
    gateway = SimGateway(gateway_cfg, create_policy("least_request"), backends, seed=0)
    workload = load_workload(
        "synthetic:input=uniform(64,400),output=uniform(8,40)", seed=0, rate=20,
        num_requests=num_requests, with_prompts=False,
    )  # fmt: skip
    lora = None
    if spec is not None:
        lora = _Recording(spec, gateway, backends, seed=0)
        lora.seen = {}
    sim = Simulator(
        backends, gateway, iter(workload), PromptIds(workload),
        MetricsCollector([b.backend_id for b in backends], keep_records=True),
        models=ModelPicker({BASE: 2.0}, None, 0), network_delay_s=0.001,
        scrape_interval_s=0.2, lora=lora,
    )  # fmt: skip
    sim.run()
    return sim, lora


def test_adapters_route_to_holders_within_the_budget() -> None:
    spec = SimLoraSpec({n: BASE for n in ("a", "b", "c")}, max_adapters_per_backend=1)
    sim, lora = _run(spec)
    assert lora is not None
    routed = dict(sim.metrics.routing)
    assert len(routed) == 120 and len(lora.seen) == 120
    for request_id, (model, holders) in lora.seen.items():
        assert model in {"a", "b", "c"}
        assert routed[request_id] in holders  # only a backend that held it then
    assert lora.num_loads > 2 and lora.num_unloads == lora.num_loads - 2  # 2 backends, budget 1
    for backend in sim.backends:
        assert len(lora.placement.adapters_on(backend.backend_id)) <= 1
    assert all(r.is_ok for r in sim.metrics.records)


def test_swap_cost_is_charged_per_adapter_brought_into_a_slot() -> None:
    spec = SimLoraSpec({"a": BASE}, max_adapters_per_backend=1, max_loras=1)
    _, lora = _run(spec, num_requests=40)
    assert lora is not None and lora.num_loads == 1 and lora.num_unloads == 0
    assert lora.swap_s == pytest.approx(LORA_GPU_SWAP_S + LORA_DISK_LOAD_S)  # once, cold


def _mean_ttft_s(sim: Simulator) -> float:
    ttfts = [r.ttft_s for r in sim.metrics.records if r.ttft_s is not None]
    return sum(ttfts) / len(ttfts)


def test_swaps_slow_the_engine() -> None:
    """Four adapters, one GPU slot: most steps swap; the swap shows in TTFT and busy time."""
    base, _ = _run(None, num_requests=60)
    spec = SimLoraSpec({n: BASE for n in ("a", "b", "c", "d")}, max_loras=1, max_cpu_loras=2)
    swapped, lora = _run(spec, num_requests=60)
    assert lora is not None and lora.swap_s > 20 * LORA_GPU_SWAP_S
    assert _mean_ttft_s(swapped) > _mean_ttft_s(base) + LORA_GPU_SWAP_S
    for sim in (base, swapped):
        assert all(r.is_ok for r in sim.metrics.records)
    busy_s = sum(b.busy_s for b in swapped.backends)
    assert busy_s > lora.swap_s  # swap time counts as busy (utilisation)


def test_simulate_reports_lora_and_is_deterministic() -> None:
    from kiloserve.sim import simulate

    def run() -> dict[str, object]:
        workload = load_workload(
            "synthetic:input=uniform(64,400),output=uniform(8,40)", seed=1, rate=20,
            num_requests=80, with_prompts=False,
        )  # fmt: skip
        spec = SimLoraSpec({n: BASE for n in ("a", "b", "c")}, max_adapters_per_backend=1)
        result = simulate(load_cluster_config(TINY), workload, "default", lora=spec)
        return dict(result.summary["lora"])

    first = run()
    assert first == run()
    assert int(first["loads"]) > 2 and float(first["swap_s"]) > 0
