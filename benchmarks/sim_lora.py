"""LoRA adapters in the simulator: median TTFT as the per-backend adapter budget varies.

    .venv/bin/python benchmarks/sim_lora.py      # ~20 s on the shared 2-core box

``examples/cluster-tiny.yaml`` (H100 + A100, Llama-3.1-8B), policy ``default``, 400
synthetic requests at 20 req/s (input uniform 64-400, output uniform 8-40 tokens),
seed 0; every request asks for one of 8 adapters (uniform), engines with
``max_loras`` 1 and ``max_cpu_loras`` 4 (``sim/lora.py``; swap constants in
``engine/lora.py``). Prints, per row: median TTFT (ms), gateway loads / unloads, and the
step time spent swapping (s).
"""

from __future__ import annotations

from pathlib import Path

from kiloserve.launch.config import load_cluster_config
from kiloserve.sim import simulate
from kiloserve.sim.lora import SimLoraSpec
from kiloserve.workload import load_workload

CLUSTER = Path(__file__).resolve().parents[1] / "examples" / "cluster-tiny.yaml"
WORKLOAD = "synthetic:input=uniform(64,400),output=uniform(8,40)"
BASE = "Llama-3.1-8B"


def _row(label: str, spec: SimLoraSpec | None) -> None:
    workload = load_workload(WORKLOAD, seed=0, rate=20, num_requests=400, with_prompts=False)
    summary = simulate(load_cluster_config(CLUSTER), workload, "default", lora=spec).summary
    lora = summary.get("lora") or {"loads": 0, "unloads": 0, "swap_s": 0.0}
    print(
        f"{label:<28} ttft_p50_ms={summary['ttft_ms']['p50']:7.1f} loads={lora['loads']:4d}"
        f" unloads={lora['unloads']:4d} swap_s={lora['swap_s']:6.2f}"
    )


def main() -> None:
    _row("no adapters", None)
    adapters = {f"a{i}": BASE for i in range(8)}
    for budget in (1, 2, 4):
        spec = SimLoraSpec(adapters, max_adapters_per_backend=budget, max_loras=1, max_cpu_loras=4)
        _row(f"8 adapters, budget {budget}", spec)


if __name__ == "__main__":
    main()
