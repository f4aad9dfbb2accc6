"""vLLM's own ``vllm bench serve`` against the gateway in front of engine twins.

It runs without ``--model`` (so it reads the gateway's ``/v1/models`` card, ``root``
included), chat and completions, and its median TTFT / TPOT agree with
``kiloserve bench`` on the same requests (within 15%): 64-token prompts, 16 output
tokens, one at a time. The twin tokenizes with the tiny model's tokenizer, the one
``vllm bench serve`` builds its prompts with.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import RealEnv, free_port, http_text, wait_for

pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(420)]

NUM_REQUESTS = 16
INPUT_TOKENS = 64
OUTPUT_TOKENS = 16
TOLERANCE = 0.15
SLOWDOWN = "5"  # the twin's step times x5: milliseconds of box noise stay well under 15%
_VLLM_BENCH = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "parser = FlexibleArgumentParser()\n"
    "add_cli_args(parser)\n"
    "main(parser.parse_args(sys.argv[1:]))\n"
)  # `vllm bench serve` itself: its entry point needs a distribution named "vllm"


def _kiloserve(*args: str) -> list[str]:
    return [sys.executable, "-m", "kiloserve", *args]


def _is_up(url: str) -> bool:
    try:
        http_text(url, timeout_s=1.0)
    except OSError:
        return False
    return True


@pytest.fixture
def gateway_url(real_env: RealEnv, tmp_path: Path) -> Iterator[str]:
    """One twin (H100, Llama-3.1-8B, the tiny tokenizer) behind a gateway."""
    twin_port, gw_port = free_port(), free_port()
    tokenizer = str(Path(real_env.model_dir) / "tokenizer.json")
    twin_argv = _kiloserve("engine", "--gpu", "H100-SXM", "--model", "llama-3.1-8b")
    # modelled step times x SLOWDOWN: a ~30 ms TTFT moved 20% with a few ms of CI noise
    twin_argv += ["--port", str(twin_port), "--tokenizer", tokenizer, "--slowdown", SLOWDOWN]
    gw_argv = _kiloserve("gateway", "--backend", f"http://127.0.0.1:{twin_port}")
    gw_argv += ["--port", str(gw_port)]
    log = (tmp_path / "servers.log").open("w")
    procs = [subprocess.Popen(a, stdout=log, stderr=subprocess.STDOUT) for a in (twin_argv,)]
    try:
        wait_for(lambda: _is_up(f"http://127.0.0.1:{twin_port}/health"), 30, "twin")
        procs.append(subprocess.Popen(gw_argv, stdout=log, stderr=subprocess.STDOUT))
        url = f"http://127.0.0.1:{gw_port}"
        wait_for(lambda: _is_up(url + "/ready"), 30, "gateway")
        yield url
    finally:
        for proc in reversed(procs):
            proc.terminate()
            proc.wait(timeout=10)
        log.close()


def _vllm_bench(env: RealEnv, url: str, backend: str, out: Path) -> dict[str, float]:
    endpoint = "/v1/chat/completions" if backend == "openai-chat" else "/v1/completions"
    argv = [env.python, "-c", _VLLM_BENCH, "--backend", backend, "--base-url", url]
    argv += ["--endpoint", endpoint, "--tokenizer", env.model_dir, "--dataset-name", "random"]
    argv += ["--random-input-len", str(INPUT_TOKENS), "--random-output-len", str(OUTPUT_TOKENS)]
    argv += ["--num-prompts", str(NUM_REQUESTS), "--max-concurrency", "1", "--ignore-eos"]
    argv += ["--seed", "0", "--save-result", "--result-dir", str(out), "--result-filename"]
    argv += ["r.json", "--percentile-metrics", "ttft,tpot"]
    run_env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    run_env.update(DO_NOT_TRACK="1", TMPDIR=str(out))
    out.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=run_env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "r.json").read_text())
    assert result["completed"] == NUM_REQUESTS
    return {"ttft": result["median_ttft_ms"], "tpot": result["median_tpot_ms"]}


def _kiloserve_bench(url: str, endpoint: str, out: Path) -> dict[str, float]:
    workload = f"synthetic:input=fixed({INPUT_TOKENS}),output=fixed({OUTPUT_TOKENS})"
    argv = _kiloserve("bench", "--url", url, "--workload", workload, "--endpoint", endpoint)
    argv += ["--num-requests", str(NUM_REQUESTS), "--concurrency", "1", "--seed", "0"]
    argv += ["--out", str(out), "--no-plots", "--no-progress", "--model", "Llama-3.1-8B"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["requests_ok"] == NUM_REQUESTS
    return {"ttft": summary["ttft_ms"]["p50"], "tpot": summary["tpot_ms"]["p50"]}


@pytest.mark.parametrize(
    ("backend", "endpoint"), [("openai-chat", "chat"), ("openai", "completions")]
)
def test_vllm_bench_serve_agrees_with_kiloserve_bench(
    real_env: RealEnv, gateway_url: str, tmp_path: Path, backend: str, endpoint: str
) -> None:
    theirs = _vllm_bench(real_env, gateway_url, backend, tmp_path / "vllm")
    ours = _kiloserve_bench(gateway_url, endpoint, tmp_path / "kiloserve")
    print(f"{backend}: vllm bench serve {theirs}, kiloserve bench {ours}")
    for metric in ("ttft", "tpot"):
        assert ours[metric] > 0
        assert abs(theirs[metric] - ours[metric]) <= TOLERANCE * ours[metric], (
            metric,
            theirs,
            ours,
        )
