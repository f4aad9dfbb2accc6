"""Split requests live vs simulated: TTFT and E2E on ``examples/cluster-pd.yaml``.

    .venv/bin/python benchmarks/sim_pd_parity.py      # ~40 s on the shared 2-core box

Starts the example P/D cluster (2 prefill + 2 decode + 1 ``both`` L40S twins of
Llama-3.1-8B and the gateway, as ``kiloserve up`` does), sends one streamed request at
a time (prompts of 1,200 to 6,000 tokens, all split; 8 output tokens, ``ignore_eos``),
3 per length, and simulates each length alone on the same YAML (``network_delay_s``
0.5 ms). Prints, per length: live median TTFT and E2E (ms, first and last SSE chunk at
the client), the simulated ones, their ratios and the decode backends chosen.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

from kiloserve.launch.cluster import LocalCluster
from kiloserve.launch.config import ClusterConfig, load_cluster_config
from kiloserve.sim import simulate
from kiloserve.tokens import filler_text
from kiloserve.workload import load_workload

CLUSTER = Path(__file__).resolve().parents[1] / "examples" / "cluster-pd.yaml"
PROMPT_TOKENS = (1200, 2500, 4000, 6000)
OUTPUT_TOKENS = 8
REPEATS = 3


def _live_one(gateway_url: str, num_tokens: int, seed: int) -> tuple[float, float, str]:
    """(TTFT s, E2E s, answering backend) of one streamed completion."""
    body = {
        "model": "Llama-3.1-8B",
        "prompt": filler_text(num_tokens, seed=seed),
        "max_tokens": OUTPUT_TOKENS,
        "stream": True,
        "ignore_eos": True,
    }
    req = urllib.request.Request(
        gateway_url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    started = time.perf_counter()
    first_s: float | None = None
    with urllib.request.urlopen(req, timeout=60) as resp:
        backend = str(resp.headers.get("x-kiloserve-backend", ""))
        for line in resp:
            if first_s is None and line.startswith(b"data: {"):
                first_s = time.perf_counter() - started
    end_s = time.perf_counter() - started
    return (first_s if first_s is not None else end_s), end_s, backend


def _simulated(cfg: ClusterConfig, num_tokens: int) -> tuple[float, float, str]:
    spec = f"synthetic:input={num_tokens},output={OUTPUT_TOKENS}"
    workload = load_workload(spec, seed=0, rate=1, num_requests=1, with_prompts=False)
    result = simulate(cfg, workload, "default", keep_records=True, network_delay_s=0.0005)
    (record,) = result.records
    return record.ttft_s or 0.0, record.e2e_s or 0.0, record.backend or ""


def main() -> None:
    cfg = load_cluster_config(CLUSTER)
    live: dict[int, list[tuple[float, float, str]]] = {}
    with (
        tempfile.TemporaryDirectory(prefix="pd-parity-") as run_dir,
        # one gateway process (--workers 1): the simulator models one router
        LocalCluster(
            cfg, gateway=True, gateway_port=0, run_dir=Path(run_dir), gateway_options={"workers": 1}
        ) as cluster,
    ):
        url = cluster.gateway_url or ""
        for n in PROMPT_TOKENS:
            live[n] = []
            for rep in range(REPEATS):
                live[n].append(_live_one(url, n, seed=100 * n + rep))
                time.sleep(0.3)  # the prefill engine frees its held KV meanwhile
    print("| prompt tokens | live TTFT (ms) | sim TTFT (ms) | live / sim TTFT | live / sim E2E |"
          " live decode | sim decode |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for n in PROMPT_TOKENS:
        ttft_s = statistics.median(s[0] for s in live[n])
        e2e_s = statistics.median(s[1] for s in live[n])
        sim_ttft_s, sim_e2e_s, sim_backend = _simulated(cfg, n)
        backends = ",".join(sorted({s[2] for s in live[n]}))
        print(
            f"| {n:,} | {ttft_s * 1000:.1f} | {sim_ttft_s * 1000:.1f} | "
            f"{ttft_s / sim_ttft_s:.3f} | {e2e_s / sim_e2e_s:.3f} | {backends} | {sim_backend} |"
        )


if __name__ == "__main__":
    main()
