"""The agent-era APIs (issue 18) against two real vLLM (CPU) instances behind the
gateway: the Responses API (stream and not) and Anthropic Messages pass through with
vLLM's own shapes, and ``/v1/embeddings``, which vLLM registers only for pooling
models, comes back as the gateway's JSON 404 naming the path."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import openai
import pytest

from conftest import SERVED_MODEL, http_json
from kiloserve.launch.cluster import LocalCluster

pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(300)]


def _gateway(cluster: LocalCluster) -> str:
    assert cluster.gateway_url is not None
    return cluster.gateway_url


def _post_status(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_responses_api_through_gateway(vllm_cluster: LocalCluster) -> None:
    with openai.OpenAI(base_url=_gateway(vllm_cluster) + "/v1", api_key="none") as client:
        raw = client.responses.with_raw_response.create(
            model=SERVED_MODEL, input="Split the string on whitespace.", max_output_tokens=8
        )
        assert raw.headers["x-kiloserve-backend"] in ("vllm-a", "vllm-b")
        done = raw.parse()
        assert done.id.startswith("resp_") and done.usage is not None
        assert 0 < done.usage.output_tokens <= 8
        stream = client.responses.create(
            model=SERVED_MODEL, input="Split the string.", max_output_tokens=6, stream=True
        )
        names = [event.type for event in stream]
    assert names[0] == "response.created" and names[-1] == "response.completed"
    assert "response.output_text.delta" in names


def test_anthropic_messages_through_gateway(vllm_cluster: LocalCluster) -> None:
    body = {
        "model": SERVED_MODEL,
        "max_tokens": 6,
        "messages": [{"role": "user", "content": "Split the string on whitespace."}],
    }
    reply = http_json(_gateway(vllm_cluster) + "/v1/messages", body)
    assert reply["type"] == "message" and reply["role"] == "assistant"
    assert 0 < reply["usage"]["output_tokens"] <= 6


def test_embeddings_on_a_generative_vllm_is_the_gateways_404(vllm_cluster: LocalCluster) -> None:
    status, body = _post_status(
        _gateway(vllm_cluster) + "/v1/embeddings", {"model": SERVED_MODEL, "input": "a cat"}
    )
    assert status == 404
    assert body["error"]["code"] == "unsupported_api"
    assert "/v1/embeddings" in body["error"]["message"]
