"""Disaggregated prefill/decode on two real vLLMs (CPU build) with real KV connectors.

Two connectors run on vLLM 0.32's CPU build (docs/real-engines.md, "Disaggregation and
KV offloading on CPU vLLM", has what else was tried and failed):

- ``NixlConnector`` (vLLM's P/D connector; needs ``nixl`` + ``nixl-cu12``, which
  ``make real-engines`` installs and which runs over UCX on CPU): the prefill vLLM
  answers with ``kv_transfer_params`` (engine id, block ids, side-channel host and port)
  and the decode vLLM pulls those blocks over NIXL. The gateway's P/D flow runs in front
  of this pair (cluster YAML ``role: prefill`` / ``role: decode``).
- ``ExampleConnector`` (no extra install): each instance writes the KV of a new prompt's
  whole blocks to ``shared_storage_path`` (one safetensors file per layer, in a folder
  named by a hash of the prompt's first ``align(n - 1)`` tokens) and loads them for a
  later request with the same prompt; it returns no ``kv_transfer_params`` (``null``).

The legs follow vLLM's disaggregated-serving proxy: the prefill leg with ``max_tokens:
1`` and ``kv_transfer_params: {"do_remote_decode": true, ...}``, the decode leg with the
``kv_transfer_params`` the prefill answered. Each decode vLLM runs with
``--no-enable-prefix-caching``, so a request there is computed or loaded afresh, never
served from its own prefix cache: the colocated reference (the same request sent whole
to the decode vLLM, greedy) is computed in full and every decode leg loads its KV.
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from conftest import (
    SERVED_MODEL,
    START_TIMEOUT_S,
    RealEnv,
    admin_backends,
    http_json,
    http_text,
    metric_sum,
    vllm_backend,
    wait_for,
)
from kiloserve.gateway.headers import BACKEND_HEADER
from kiloserve.launch.cluster import LocalCluster
from kiloserve.launch.config import parse_cluster_config
from kiloserve.launch.engines import reserved_port
from kiloserve.tokens import filler_text

pytestmark = [pytest.mark.real_engine, pytest.mark.slow, pytest.mark.timeout(600)]

MAX_TOKENS = 32
NUM_LAYERS = 2  # the tiny model's (scripts/make_tiny_model.py)
KV_BYTES_PER_TOKEN_LAYER = 2 * 2 * 64 * 2  # K and V, 2 KV heads of 64, bf16
# A prefill leg as vLLM's proxy (and the gateway) sends it.
REMOTE_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
BY_SOURCE = "vllm:prompt_tokens_by_source_total"
# vLLM's CPU build renders /metrics slowly while the cores are busy (seen > 10 s).
METRICS_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class PdPair:
    """A running prefill/decode pair (``store``: the ExampleConnector folder)."""

    prefill_url: str
    decode_url: str
    store: Path | None = None
    side_channel_port: int = 0
    gateway_url: str | None = None


def _kv_config(connector: str, kv_role: str, **extra: Any) -> list[str]:
    config: dict[str, Any] = {"kv_connector": connector, "kv_role": kv_role}
    if extra:
        config["kv_connector_extra_config"] = extra
    return ["--kv-transfer-config", json.dumps(config)]


def _complete(url: str, body: dict[str, Any], request_id: str) -> dict[str, Any]:
    """POST /v1/completions with an ``X-Request-Id`` (the same on both legs)."""
    req = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json", "X-Request-Id": request_id},
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            out: dict[str, Any] = json.load(resp)
            out["_backend"] = resp.headers.get(BACKEND_HEADER)
    except urllib.error.HTTPError as exc:  # say what the engine answered
        raise AssertionError(f"{url}: HTTP {exc.code}: {exc.read()[:2000]!r}") from exc
    return out


def _request(seed: int) -> dict[str, Any]:
    """A greedy completion of a ~420-token prompt (3+ of vLLM's 128-token CPU blocks)."""
    return {
        "model": SERVED_MODEL,
        "prompt": filler_text(300, seed=seed),
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }


def _prompt_tokens(url: str, prompt: str) -> int:
    return len(http_json(url + "/tokenize", {"model": SERVED_MODEL, "prompt": prompt})["tokens"])


def _counters(url: str) -> dict[str, float]:
    text = http_text(url + "/metrics", timeout_s=METRICS_TIMEOUT_S)
    return {
        "external_hits": metric_sum(text, "vllm:external_prefix_cache_hits_total"),
        "external_source": metric_sum(text, BY_SOURCE, source="external_kv_transfer"),
        "local_compute": metric_sum(text, BY_SOURCE, source="local_compute"),
        "local_hits": metric_sum(text, "vllm:prefix_cache_hits_total"),
        "generated": metric_sum(text, "vllm:generation_tokens_total"),
        "nixl_transfers": metric_sum(text, "vllm:nixl_xfer_time_seconds_count"),
        "nixl_bytes": metric_sum(text, "vllm:nixl_bytes_transferred_sum"),
        "nixl_failed": metric_sum(text, "vllm:nixl_num_failed_transfers_total"),
    }


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in before}


def _block_size(url: str) -> int:
    for line in http_text(url + "/metrics", timeout_s=METRICS_TIMEOUT_S).splitlines():
        if line.startswith("vllm:cache_config_info{"):
            labels = dict(kv.split("=", 1) for kv in line.split("{")[1].split("}")[0].split(","))
            return int(labels["block_size"].strip('"'))
    raise AssertionError("vllm:cache_config_info not exported")


def _token_ids(response: dict[str, Any]) -> list[int]:
    ids: list[int] = response["choices"][0]["token_ids"]
    return ids


def _colocated_reference(pair: PdPair, body: dict[str, Any], prompt_tokens: int) -> list[int]:
    """The request run whole on the decode vLLM, computed there in full."""
    before = _counters(pair.decode_url)
    reference = _complete(pair.decode_url, body, "reference")
    delta = _delta(before, _counters(pair.decode_url))
    assert delta["local_compute"] == prompt_tokens
    assert delta["external_hits"] == delta["local_hits"] == delta["nixl_transfers"] == 0
    assert len(_token_ids(reference)) == MAX_TOKENS
    return _token_ids(reference)


def _prefill_leg(pair: PdPair, body: dict[str, Any], request_id: str) -> dict[str, Any]:
    prefill = _complete(
        pair.prefill_url, body | {"max_tokens": 1, "kv_transfer_params": REMOTE_DECODE}, request_id
    )
    assert prefill["usage"]["completion_tokens"] == 1
    return prefill


# --- ExampleConnector: KV through a shared folder --------------------------------------


def _stored_files(store: Path) -> list[Path]:
    return sorted(store.glob("*/*.safetensors"))


def _clear(store: Path) -> None:
    for folder in store.iterdir():
        shutil.rmtree(folder)


def _zero_tensors(path: Path) -> None:
    """Overwrite a safetensors file's tensor bytes with zeros (header kept)."""
    with path.open("r+b") as fh:
        (header_len,) = struct.unpack("<Q", fh.read(8))
        fh.seek(8 + header_len)
        fh.write(bytes(path.stat().st_size - 8 - header_len))


@pytest.fixture(scope="class")
def disk_pair(real_env: RealEnv, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PdPair]:
    """Prefill vLLM (core 0, kv_producer), decode vLLM (core 1, kv_consumer)."""
    if real_env.vllm_skip:
        pytest.skip(f"real vLLM unavailable: {real_env.vllm_skip}")
    store = tmp_path_factory.mktemp("kv-store")
    prefill = vllm_backend("disk-prefill", real_env, 0)
    prefill["extra_args"] += _kv_config(
        "ExampleConnector", "kv_producer", shared_storage_path=str(store)
    )
    decode = vllm_backend("disk-decode", real_env, 1)
    decode["extra_args"] += _kv_config(
        "ExampleConnector", "kv_consumer", shared_storage_path=str(store)
    )
    decode["extra_args"].append("--no-enable-prefix-caching")
    cfg = parse_cluster_config({"name": "real-disk-pd", "backends": [prefill, decode]})
    run_dir = tmp_path_factory.mktemp("disk-cluster")
    with LocalCluster(
        cfg, gateway=False, run_dir=run_dir, start_timeout_s=START_TIMEOUT_S
    ) as cluster:
        urls = {b.name: b.url for b in cluster.backends}
        yield PdPair(urls["disk-prefill"], urls["disk-decode"], store=store)


class TestExampleConnector:
    """Its own pair (class scope: stopped before the NIXL pair starts)."""

    def test_decode_leg_continues_the_prefill_legs_kv(self, disk_pair: PdPair) -> None:
        assert disk_pair.store is not None
        body = _request(seed=21)
        n = _prompt_tokens(disk_pair.decode_url, body["prompt"])
        # Whole blocks of the first n - 1 tokens (ExampleConnector's align_to_block_size).
        block_size = _block_size(disk_pair.decode_url)
        loadable = (n - 2) // block_size * block_size
        assert loadable >= 2 * block_size
        reference = _colocated_reference(disk_pair, body, n)
        _clear(disk_pair.store)  # the reference stored its KV too: the prefill leg redoes it

        prefill = _prefill_leg(disk_pair, body, "disk-1")
        assert prefill["kv_transfer_params"] is None  # ExampleConnector hands over no params
        assert _token_ids(prefill) == reference[:1]
        files = _stored_files(disk_pair.store)
        assert len(files) == NUM_LAYERS and len({f.parent for f in files}) == 1

        before = _counters(disk_pair.decode_url)
        follow = body | {"kv_transfer_params": prefill["kv_transfer_params"]}
        decode = _complete(disk_pair.decode_url, follow, "disk-1")
        delta = _delta(before, _counters(disk_pair.decode_url))
        assert delta["external_hits"] == delta["external_source"] == loadable
        assert delta["local_compute"] == n - loadable and delta["local_hits"] == 0
        assert _token_ids(decode) == reference

    def test_decode_output_comes_from_the_stored_kv(self, disk_pair: PdPair) -> None:
        """The equality above is no coincidence: with the stored KV zeroed, the decode
        vLLM still loads it (and counts the hits) but continues differently."""
        assert disk_pair.store is not None
        body = _request(seed=22)
        _clear(disk_pair.store)
        prefill = _prefill_leg(disk_pair, body, "disk-2")
        follow = body | {"kv_transfer_params": prefill["kv_transfer_params"]}
        intact = _token_ids(_complete(disk_pair.decode_url, follow, "disk-2"))
        assert intact[:1] == _token_ids(prefill)
        files = _stored_files(disk_pair.store)
        assert len(files) == NUM_LAYERS
        for path in files:
            _zero_tensors(path)
        before = _counters(disk_pair.decode_url)
        zeroed = _token_ids(_complete(disk_pair.decode_url, follow, "disk-3"))
        delta = _delta(before, _counters(disk_pair.decode_url))
        assert delta["external_hits"] > 0 and delta["local_hits"] == 0
        assert len(zeroed) == MAX_TOKENS and zeroed != intact


# --- NixlConnector: vLLM's own P/D path, with the gateway in front --------------------


def _nixl_missing(python: str) -> str:
    probe = subprocess.run([python, "-c", "import nixl._api"], capture_output=True, text=True)
    if probe.returncode == 0:
        return ""
    last = (probe.stderr.strip().splitlines() or ["?"])[-1]
    return f"nixl not importable in the real-engine venv ({last}): run `make real-engines`"


@pytest.fixture(scope="module")
def nixl_pair(real_env: RealEnv, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PdPair]:
    """``role: prefill`` vLLM (core 0, NIXL kv_producer), ``role: decode`` vLLM (core 1,
    kv_consumer), each with its own NIXL side-channel port, and the gateway."""
    if real_env.vllm_skip:
        pytest.skip(f"real vLLM unavailable: {real_env.vllm_skip}")
    if reason := _nixl_missing(real_env.python):
        pytest.skip(reason)
    lines, side_ports = [], {}
    for name, core, role, kv_role in (
        ("nixl-prefill", 0, "prefill", "kv_producer"),
        ("nixl-decode", 1, "decode", "kv_consumer"),
    ):
        line = vllm_backend(name, real_env, core)
        line["role"] = role
        line["extra_args"] += _kv_config("NixlConnector", kv_role)
        if role == "decode":
            line["extra_args"].append("--no-enable-prefix-caching")
        side_ports[name] = reserved_port("127.0.0.1")
        # The side channel binds VLLM_NIXL_SIDE_CHANNEL_PORT (default 5600): one per instance.
        line["env"] |= {
            "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_ports[name]),
        }
        lines.append(line)
    cfg = parse_cluster_config({"name": "real-nixl", "gateway": {"port": 0}, "backends": lines})
    cluster = LocalCluster(
        cfg,
        run_dir=tmp_path_factory.mktemp("nixl-cluster"),
        start_timeout_s=START_TIMEOUT_S,
        gateway_options={
            "scrape_interval_s": 0.1,
            # A scrape that times out counts as a failed one, and failed scrapes mark a
            # backend down: with 3 s, a starved CI box marked the prefill vLLM down (its
            # /metrics took longer) and the gateway served the request whole on decode.
            "scrape_timeout_s": METRICS_TIMEOUT_S,
            "stale_after_s": 2 * METRICS_TIMEOUT_S,
            # vLLM's CPU build can take over the probes' default 1 s to answer /health
            # while its core computes: the gateway then marked the decode vLLM down and
            # served a request whole on the prefill vLLM (seen once, under load).
            "health": {"completion_probe": False, "timeout_s": 30.0},
        },
    )
    with cluster:
        urls = {b.name: b.url for b in cluster.backends}
        gateway_url = cluster.gateway_url
        assert gateway_url is not None
        _wait_both_routable(gateway_url)
        _first_handshake(urls["nixl-prefill"], urls["nixl-decode"], cluster.log_path("nixl-decode"))
        yield PdPair(
            urls["nixl-prefill"],
            urls["nixl-decode"],
            side_channel_port=side_ports["nixl-prefill"],
            gateway_url=gateway_url,
        )


def _wait_both_routable(gateway_url: str) -> None:
    """The gateway splits only over healthy, scraped prefill and decode backends."""
    wait_for(
        lambda: all(
            row["healthy"] and row["num_running"] is not None
            for row in admin_backends(gateway_url).values()
        ),
        60,
        "the gateway to see both backends healthy",
        poll_s=0.2,
    )


HANDSHAKE_ATTEMPTS = 3


def _first_handshake(prefill_url: str, decode_url: str, decode_log: Path) -> None:
    """One split request, so that the decode vLLM holds the NIXL handshake with the
    prefill vLLM before the tests count anything.

    The decode vLLM makes the handshake when the first decode leg names the prefill
    engine, and gives up after 5 s without a reply (vLLM 0.32: ``RCVTIMEO`` on the
    side channel); with ``kv_load_failure_policy: fail`` (its default) that request
    then ends in a 500. On a starved CI box the prefill vLLM's side-channel thread
    missed those 5 s once (CI, stop 27). A failed handshake is retried by the next
    request that names the engine, and a made one is kept (``engine_ttl``, 1 h), so
    up to HANDSHAKE_ATTEMPTS requests are tried here; one must complete, else the
    fixture fails with the decode vLLM's log tail."""
    answers = []
    for attempt in range(HANDSHAKE_ATTEMPTS):
        body = _request(seed=30 + 100 * attempt) | {"max_tokens": 2}
        prefill = _complete(
            prefill_url,
            body | {"max_tokens": 1, "kv_transfer_params": REMOTE_DECODE},
            f"handshake-{attempt}",
        )
        follow = body | {"kv_transfer_params": prefill["kv_transfer_params"]}
        try:
            _complete(decode_url, follow, f"handshake-{attempt}")
            return
        except AssertionError as exc:
            answers.append(str(exc))
            time.sleep(1.0)
    tail = decode_log.read_text(errors="replace").splitlines()[-40:]
    raise AssertionError(f"no split request completed: {answers}\n" + "\n".join(tail))


def _nixl_bytes(loaded_tokens: int, block_size: int) -> int:
    """NIXL moves whole blocks, the partly filled last one included."""
    blocks = -(-loaded_tokens // block_size)
    return blocks * block_size * NUM_LAYERS * KV_BYTES_PER_TOKEN_LAYER


def test_nixl_decode_pulls_the_prefill_kv(nixl_pair: PdPair) -> None:
    body = _request(seed=31)
    n = _prompt_tokens(nixl_pair.decode_url, body["prompt"])
    reference = _colocated_reference(nixl_pair, body, n)

    prefill = _prefill_leg(nixl_pair, body, "nixl-1")
    params = prefill["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_host"] == "127.0.0.1"
    assert params["remote_port"] == nixl_pair.side_channel_port
    assert isinstance(params["remote_engine_id"], str) and params["remote_block_ids"]
    assert _token_ids(prefill) == reference[:1]

    before = _counters(nixl_pair.decode_url)
    decode = _complete(nixl_pair.decode_url, body | {"kv_transfer_params": params}, "nixl-1")
    delta = _delta(before, _counters(nixl_pair.decode_url))
    # vLLM 0.32 counts every prompt token as arrived over NIXL (none computed on the
    # decode side), in one transfer of whole blocks.
    assert delta == {
        "external_hits": n,
        "external_source": n,
        "local_compute": 0,
        "local_hits": 0,
        "generated": MAX_TOKENS,
        "nixl_transfers": 1,
        "nixl_bytes": _nixl_bytes(n, _block_size(nixl_pair.decode_url)),
        "nixl_failed": 0,
    }
    assert _token_ids(decode) == reference


SPLIT_ATTEMPTS = 3


def _split_modes(before: str, after: str) -> dict[str, float]:
    split = "kiloserve_gateway_disagg_requests_total"
    return {
        mode: metric_sum(after, split, mode=mode) - metric_sum(before, split, mode=mode)
        for mode in ("split", "colocated", "fallback")
    }


def test_gateway_splits_over_the_real_nixl_pair(nixl_pair: PdPair) -> None:
    """Each attempt waits for both backends routable, then sends one request. A starved
    CPU vLLM can miss a health probe between that wait and the request (seen in CI: the
    gateway then rightly serves the request whole, ``fallback``), so up to
    SPLIT_ATTEMPTS requests (each with a prompt of its own) are made; one of them must
    split, and that one is checked in full. A gateway that never splits fails every attempt."""
    url = nixl_pair.gateway_url
    assert url is not None
    tried: list[tuple[dict[str, float], Any]] = []
    for attempt in range(SPLIT_ATTEMPTS):
        # A fresh prompt per attempt: one served whole may have left its prefix cached.
        body = _request(seed=32 + 100 * attempt)
        n = _prompt_tokens(nixl_pair.decode_url, body["prompt"])
        reference = _colocated_reference(nixl_pair, body, n)
        _wait_both_routable(url)
        gw_before = http_text(url + "/metrics", timeout_s=METRICS_TIMEOUT_S)
        prefill_before = _counters(nixl_pair.prefill_url)
        decode_before = _counters(nixl_pair.decode_url)
        out = _complete(url, body, f"gw-nixl-{attempt + 1}")
        modes = _split_modes(gw_before, http_text(url + "/metrics", timeout_s=METRICS_TIMEOUT_S))
        assert sum(modes.values()) == 1, modes  # one request, one mode
        assert _token_ids(out) == reference  # whole or split, the same tokens
        if modes["split"] == 1:
            break
        tried.append((modes, admin_backends(url)))
    assert modes == {"split": 1, "colocated": 0, "fallback": 0}, tried
    assert out["usage"]["prompt_tokens"] == n
    assert out["usage"]["completion_tokens"] == MAX_TOKENS
    assert out["_backend"] == "nixl-decode"
    prefill_delta = _delta(prefill_before, _counters(nixl_pair.prefill_url))
    assert prefill_delta["generated"] == 1 and prefill_delta["local_compute"] == n
    decode_delta = _delta(decode_before, _counters(nixl_pair.decode_url))
    assert decode_delta["nixl_transfers"] == 1 and decode_delta["external_hits"] == n
    assert decode_delta["local_compute"] == 0 and decode_delta["generated"] == MAX_TOKENS


def _stream_token_ids(url: str, body: dict[str, Any]) -> tuple[list[int], dict[str, Any]]:
    """Stream a completion (SSE); the token ids of its chunks and its usage chunk."""
    stream_body = body | {"stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(stream_body).encode(),
        headers={"content-type": "application/json"},
    )
    ids: list[int] = []
    usage: dict[str, Any] = {}
    with urllib.request.urlopen(req, timeout=120) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            for choice in chunk.get("choices") or []:
                ids += choice.get("token_ids") or []
            usage = chunk.get("usage") or usage
    return ids, usage


def test_gateway_streams_a_split_request(nixl_pair: PdPair) -> None:
    """The decode leg streams through the gateway; the prefill leg ran unstreamed."""
    assert nixl_pair.gateway_url is not None
    body = _request(seed=33)
    n = _prompt_tokens(nixl_pair.decode_url, body["prompt"])
    reference = _colocated_reference(nixl_pair, body, n)
    _wait_both_routable(nixl_pair.gateway_url)
    decode_before = _counters(nixl_pair.decode_url)
    ids, usage = _stream_token_ids(nixl_pair.gateway_url, body)
    assert ids == reference
    assert usage["prompt_tokens"] == n and usage["completion_tokens"] == MAX_TOKENS
    decode_delta = _delta(decode_before, _counters(nixl_pair.decode_url))
    assert decode_delta["nixl_transfers"] == 1 and decode_delta["external_hits"] == n
