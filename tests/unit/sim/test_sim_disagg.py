"""Disaggregated prefill/decode in the simulator: the two legs' exact timing, the held
prefill blocks, the split rule's choices, failover and the summary keys."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import orjson
import pytest

from kiloserve.catalog import get_gpu, get_model
from kiloserve.cli import main
from kiloserve.engine.timing import StepTimeModel
from kiloserve.launch.config import ClusterConfig, parse_cluster_config
from kiloserve.policies.registry import create_policy
from kiloserve.sim import simulate
from kiloserve.sim.cluster import build_backends, build_gateway_config, describe_backends
from kiloserve.sim.disagg import HOLD_TIMEOUT_S, SimDisagg
from kiloserve.sim.events import EngineAdd, Scrape
from kiloserve.sim.faults import FaultEvent
from kiloserve.sim.gateway import ModelPicker, SimGateway
from kiloserve.sim.prompts import PromptIds
from kiloserve.sim.results import MetricsCollector
from kiloserve.sim.simulator import Simulator
from kiloserve.workload import load_workload

ROOT = Path(__file__).resolve().parents[3]
DELAY_S = 0.002
# Llama-3.1-8B KV per token: 2 (K, V) x 32 layers x 8 KV heads x 128 dims x 2 bytes (bf16)
LLAMA_8B_KV_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2
H100_NETWORK_BPS = 50e9  # a 400 Gb/s NIC per GPU
NETWORK_LATENCY_S = 100e-6


def _line(name: str, role: str, **keys: Any) -> dict[str, Any]:
    return {"name": name, "gpu": "H100", "model": "llama-3.1-8b", "role": role} | keys


def _cluster(*lines: dict[str, Any], **gateway: Any) -> ClusterConfig:
    gw = {"policy": "round_robin"} | gateway
    return parse_cluster_config({"name": "pd", "gateway": gw, "backends": list(lines)})


def _one_request(input_tokens: int, output_tokens: int) -> Any:
    spec = f"synthetic:input={input_tokens},output={output_tokens}"
    return load_workload(spec, seed=0, rate=1, num_requests=1, with_prompts=False)


def test_split_request_ttft_is_prefill_plus_transfer_plus_one_token_prefill() -> None:
    """One prefill and one decode H100: TTFT, computed independently of the simulator,
    is 4 network delays + two API overheads + the prefill step + the KV transfer over
    the decode GPU's NIC + the decode engine's one-token prefill over the pulled KV."""
    prompt, output = 2000, 4
    cluster = _cluster(_line("p", "prefill"), _line("d", "decode"))
    result = simulate(
        cluster, _one_request(prompt, output), "round_robin",
        network_delay_s=DELAY_S, keep_records=True, fast_forward=False,
    )  # fmt: skip
    timer = StepTimeModel(get_gpu("H100"), get_model("llama-3.1-8b"), 1, "bf16")
    overhead_s = timer.per_request_api_overhead_s
    prefill_s = timer.step_time_s([(prompt, 0)], [])
    transfer_s = (prompt - 1) * LLAMA_8B_KV_BYTES_PER_TOKEN / H100_NETWORK_BPS
    transfer_s += NETWORK_LATENCY_S
    first_token_s = timer.step_time_s([(1, prompt - 1)], [])  # the last prompt token
    ttft_s = 4 * DELAY_S + 2 * overhead_s + prefill_s + transfer_s + first_token_s
    (record,) = result.records
    assert record.is_ok and record.backend == "d"
    assert record.ttft_s == pytest.approx(ttft_s, rel=1e-9)
    decode_s = sum(timer.step_time_s([], [prompt + i]) for i in range(1, output))
    assert record.e2e_s == pytest.approx(ttft_s + decode_s, rel=1e-9)  # E2E spans both legs
    assert result.routing == [("req-000000", "p"), ("req-000000", "d")]
    summary = result.summary
    assert summary["kv_transfer_ms"]["p50"] == pytest.approx(transfer_s * 1000, rel=1e-6)
    assert summary["disagg"] == {"split": 1, "colocated": 0, "fallback": 0, "kv_releases": 1}
    assert set(summary["per_backend"]) == {"d"}  # the request is the decode backend's


def _simulator(cluster: ClusterConfig, workload: Any) -> Simulator:
    """A simulator built as ``simulate`` builds one, to be stepped event by event."""
    infos = describe_backends(cluster)
    backends = build_backends(cluster, fast_forward=False)
    gateway_cfg = build_gateway_config(cluster, infos, 0.2)
    gateway = SimGateway(gateway_cfg, create_policy("round_robin"), backends, seed=0)
    metrics = MetricsCollector([b.backend_id for b in backends])
    return Simulator(
        backends, gateway, iter(workload), PromptIds(workload), metrics,
        models=ModelPicker({"Llama-3.1-8B": 2.0}, None, 0), network_delay_s=DELAY_S,
        scrape_interval_s=0.2, disagg=SimDisagg(backends),
    )  # fmt: skip


def test_prefill_blocks_stay_held_until_the_decode_engine_pulled_them() -> None:
    prompt = 2000
    cluster = _cluster(_line("p", "prefill"), _line("d", "decode"))
    sim = _simulator(cluster, _one_request(prompt, 3))
    prefill, decode = sim.backends
    sim.push(Scrape(0.0))
    sim._push_next_arrival()
    held: list[tuple[float, str, int]] = []  # (time, event, held blocks after it)
    while (event := sim.pop()) is not None:
        for follow in event.handle(sim):
            sim.push(follow)
        core = prefill.core
        assert core is not None
        name = type(event).__name__
        if isinstance(event, EngineAdd):
            name += "@" + sim.backends[event.request.backend_index].backend_id
        held.append((event.time_s, name, core.num_held_blocks))
    names = [n for _, n, _ in held if n != "Scrape"]
    assert names[:6] == [
        "Arrival", "EngineAdd@p", "StepDone", "RequestDone", "EngineAdd@d", "KvRelease",
    ]  # fmt: skip
    blocks: dict[str, int] = {}
    for _, name, num_held in held:
        blocks.setdefault(name, num_held)  # after each kind's first event
    assert blocks["Arrival"] == 0
    # the engine commits a step as it starts (the sim's rule): the one-token prefill leg
    # finishes there and its prompt's blocks are held from then on
    num_blocks = math.ceil(prompt / 16)
    assert blocks["EngineAdd@p"] == blocks["StepDone"] == num_blocks
    assert blocks["RequestDone"] == blocks["EngineAdd@d"] == num_blocks
    assert blocks["KvRelease"] == 0
    times: dict[str, float] = {}
    for time_s, name, _ in held:
        times.setdefault(name, time_s)
    assert times["KvRelease"] == pytest.approx(times["EngineAdd@d"] + DELAY_S)  # the release
    transfer_s = (prompt - 1) * LLAMA_8B_KV_BYTES_PER_TOKEN / H100_NETWORK_BPS
    overhead_s = decode.model.api_overhead_s
    pulled_s = times["RequestDone"] + DELAY_S + overhead_s + transfer_s + NETWORK_LATENCY_S
    assert times["EngineAdd@d"] == pytest.approx(pulled_s, rel=1e-12)
    assert sim.metrics.num_ok == 1 and prefill.core is not None
    assert prefill.core.num_held_seqs == 0 and decode.core is not None
    assert decode.core.num_held_blocks == 0


def test_short_prompts_run_whole_on_a_both_backend_long_ones_split() -> None:
    cluster = _cluster(
        _line("p", "prefill"), _line("d", "decode"), _line("b", "both"),
        options={"disagg": {"min_prompt_tokens": 1024}},
    )  # fmt: skip
    workload = load_workload(
        "synthetic:input=uniform(200,2500),output=uniform(2,20)",
        seed=3, rate=5, num_requests=40, with_prompts=False,
    )  # fmt: skip
    result = simulate(cluster, workload, "round_robin", keep_records=True)
    by_request: dict[str, list[str]] = {}
    for request_id, backend in result.routing:
        by_request.setdefault(request_id, []).append(backend)
    num_long = 0
    for record in result.records:
        assert record.is_ok
        expected = ["p", "d"] if record.input_tokens >= 1024 else ["b"]
        assert by_request[record.request_id] == expected, record.input_tokens
        num_long += record.input_tokens >= 1024
    assert 0 < num_long < 40
    disagg = result.summary["disagg"]
    assert disagg == {"split": num_long, "colocated": 40 - num_long, "fallback": 0,
                      "kv_releases": num_long}  # fmt: skip


def test_without_a_both_backend_every_request_splits() -> None:
    cluster = _cluster(_line("p", "prefill"), _line("d", "decode", count=2))
    workload = load_workload(
        "synthetic:input=uniform(20,300),output=4", seed=1, rate=5, num_requests=12,
        with_prompts=False,
    )  # fmt: skip
    summary = simulate(cluster, workload, "round_robin").summary
    assert summary["requests_ok"] == 12
    assert summary["disagg"]["split"] == 12
    assert set(summary["per_backend"]) <= {"d-0", "d-1"}


def test_kv_transfer_stats_only_for_clusters_with_pd_pools() -> None:
    workload = _one_request(300, 4)
    plain = parse_cluster_config({"backends": [_line("b", "both")]})
    summary = simulate(plain, workload, "round_robin").summary
    assert not {"kv_transfer_ms", "disagg", "kv_tiers"} & set(summary)
    pd = simulate(_cluster(_line("p", "prefill"), _line("d", "decode")), workload, "round_robin")
    assert set(pd.summary["kv_transfer_ms"]) == set(summary["ttft_ms"])  # the same shape


def test_a_dead_prefill_backend_falls_back_to_the_whole_request_on_decode() -> None:
    """The prefill engine dies after the gateway chose it: the connect error finds no
    other prefill backend, so the whole request runs on the decode backend."""
    cluster = _cluster(_line("p", "prefill"), _line("d", "decode"))
    fault = FaultEvent(time_s=0.001, backend="p", kind="die")
    result = simulate(
        cluster, _one_request(1500, 5), "round_robin", faults=[fault], keep_records=True,
        network_delay_s=DELAY_S,
    )  # fmt: skip
    (record,) = result.records
    assert record.is_ok and record.backend == "d"
    assert result.routing == [("req-000000", "p"), ("req-000000", "d")]
    assert result.summary["disagg"] == {"split": 0, "colocated": 0, "fallback": 1,
                                        "kv_releases": 0}  # fmt: skip
    assert result.summary["kv_transfer_ms"]["p50"] is None  # nothing was transferred


def test_decode_leg_retries_on_the_next_decode_backend() -> None:
    """The first decode backend (least KV usage, then config order) is dead before the
    gateway saw it: the decode leg moves to the other one, pulling the KV again."""
    cluster = _cluster(_line("p", "prefill"), _line("d", "decode", count=2))
    fault = FaultEvent(time_s=0.001, backend="d-0", kind="die")
    result = simulate(
        cluster, _one_request(1500, 5), "round_robin", faults=[fault], keep_records=True,
        network_delay_s=DELAY_S,
    )  # fmt: skip
    (record,) = result.records
    assert record.is_ok and record.backend == "d-1"
    backends = [b for _, b in result.routing]
    assert backends == ["p", "d-0", "d-1"]
    assert result.summary["disagg"]["split"] == 1
    assert result.summary["disagg"]["kv_releases"] == 1


def test_sim_cli_runs_the_example_pd_cluster(tmp_path: Path) -> None:
    out = tmp_path / "sim"
    code = main([
        "sim", "-c", str(ROOT / "examples" / "cluster-pd.yaml"),
        "--workload", "synthetic:input=uniform(200,3000),output=uniform(4,32)",
        "--rate", "3", "--num-requests", "30", "--out", str(out), "--no-plots",
    ])  # fmt: skip
    assert code == 0
    summary = orjson.loads((out / "default" / "summary.json").read_bytes())
    assert summary["requests_ok"] == 30
    disagg = summary["disagg"]
    assert disagg["split"] + disagg["colocated"] == 30 and disagg["split"] > 0
    assert summary["kv_transfer_ms"]["p50"] > 0
    assert "kv_tiers" in summary  # the prefill lines have a CPU tier
    markdown = (out / "default" / "summary.md").read_text()
    assert f"| split requests | {disagg['split']} |" in markdown
    assert "| KV transfer p95 (ms) |" in markdown and "| CPU tier hit rate (tokens) |" in markdown


def test_kv_tiers_reach_the_engine_and_the_summary() -> None:
    from kiloserve.sim.cluster import backend_model

    spec = _cluster(_line("p", "prefill", kv_cpu_gib=2, kv_remote_gib=0.5), _line("d", "decode"))
    prefill, decode = (backend_model(line) for line in spec.backends)
    block_bytes = 16 * LLAMA_8B_KV_BYTES_PER_TOKEN
    assert prefill.engine_config.kv_cpu_blocks == 2 * 2**30 // block_bytes
    assert prefill.engine_config.kv_remote_blocks == 2**29 // block_bytes
    assert prefill.engine_config.role == "prefill" and decode.engine_config.role == "decode"
    assert decode.engine_config.kv_cpu_blocks == 0
    summary = simulate(spec, _one_request(1200, 4), "round_robin").summary
    tiers = summary["kv_tiers"]
    assert tiers["num_backends"] == 1
    assert {"cpu_hit_rate", "remote_hit_rate", "cpu_offloaded_blocks", "loaded_bytes"} <= set(tiers)


def test_no_decode_backend_left_runs_the_whole_request_elsewhere() -> None:
    """The only decode engine died before the gateway saw it: the decode leg's connect
    error leaves none, so the whole request runs on the `both` backend; nobody pulled
    the prefill engine's KV, which it frees at its hold timeout."""
    cluster = _cluster(_line("p", "prefill"), _line("d", "decode"), _line("b", "both"))
    fault = FaultEvent(time_s=0.001, backend="d", kind="die")
    result = simulate(
        cluster, _one_request(1500, 5), "round_robin", faults=[fault], keep_records=True,
        network_delay_s=DELAY_S,
    )  # fmt: skip
    (record,) = result.records
    assert record.is_ok and record.backend == "b"
    assert [b for _, b in result.routing] == ["p", "d", "b"]
    disagg = result.summary["disagg"]
    assert disagg == {"split": 0, "colocated": 0, "fallback": 1, "kv_releases": 1}
    assert result.summary["simulated_duration_s"] >= HOLD_TIMEOUT_S  # the timed-out hold


def test_decode_legs_of_overlapping_prefills_spread_over_the_decode_backends() -> None:
    """Four long requests arrive 1 ms apart, so their prefill legs overlap: each decode
    leg is ranked when its prefill answer is in (as the live gateway does), seeing the
    decode legs sent before it (in flight, then in the KV usage scraped); ranked at the
    arrival (every decode backend idle then) all four went to the first one."""
    cluster = _cluster(_line("p", "prefill"), _line("d1", "decode"), _line("d2", "decode"))
    workload = load_workload(
        "synthetic:input=2000,output=50", seed=0, rate=1000, num_requests=4, with_prompts=False
    )
    result = simulate(cluster, workload, "round_robin", network_delay_s=DELAY_S, keep_records=True)
    decode_legs = [backend for _, backend in result.routing if backend != "p"]
    assert len(decode_legs) == 4 and set(decode_legs) == {"d1", "d2"}
    assert result.summary["disagg"]["split"] == 4
