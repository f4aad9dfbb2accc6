"""Engine-twin calibration: every measured point of data/calibration.md vs the model.

Run:  .venv/bin/python benchmarks/twin_calibration.py [--no-sweep] [--max-concurrency N]

Single-step points (SplitwiseSim) call ``StepTimeModel.step_time_s`` directly. Throughput
and latency points run a closed loop through the real scheduler (``EngineCore``: chunked
prefill, paged KV from the memory ledger, preemption) timed by ``StepTimeModel``: C
clients each send a request (1024 in / 128 out unless the source says otherwise), wait
for it to finish and send the next; the request reaches the engine after the model's
per-request API overhead. All clients start together, as benchmark tools do.

Setups outside the catalog are defined here from public figures (A100-40GB, L4,
Llama2-70B, Qwen2.5-0.5B). The seed-002 "27B INT4 on a domestic accelerator" names no
chip, so its spec is FITTED to two of its figures (TPOT at 1 request, the flat
throughput); only its other figures test the model. Rows say "fit" or "predict".
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import itertools
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kiloserve.catalog import GpuSpec, ModelSpec, get_gpu, get_model, list_gpus, list_models
from kiloserve.catalog.memory import plan_memory, smallest_fitting
from kiloserve.engine.config import EngineConfig
from kiloserve.engine.core import EngineCore
from kiloserve.engine.sequence import Sequence as EngineSequence
from kiloserve.engine.timing import StepTimeModel
from kiloserve.errors import DoesNotFitError

TOLERANCE = 0.25

# --- setups outside the catalog (public spec sheets / config.json) --------------------
A100_40G = dataclasses.replace(
    get_gpu("A100"), name="A100-40GB", aliases=(), bandwidth_tbs=1.555, memory_gb=40
)
L4 = dataclasses.replace(
    get_gpu("L40S"),
    name="L4",
    aliases=(),
    tflops_bf16=121,
    tflops_fp8=242,
    bandwidth_tbs=0.300,
    memory_gb=24,
    cost_per_hour=0.8,
)
# Seed 002 names no chip: bandwidth fitted to TPOT 22 ms at 1 request, decode MFU to the
# flat ~110 tok/s (INT4 weight-only kernels dequantise on the fly, so decode is
# compute-heavy); peak and prefill MFU are those of a 910B-class card.
DOMESTIC = GpuSpec(
    name="domestic-accelerator (seed 002, fitted)",
    aliases=(),
    tflops_bf16=320,
    tflops_fp8=None,
    bandwidth_tbs=0.93,
    memory_gb=64,
    prefill_mfu=0.32,
    decode_mfu=0.026,
    cost_per_hour=1.5,
    max_num_batched_tokens=2048,
    max_num_seqs=256,
    link_bandwidth_gbs=56,
)
LLAMA2_70B = ModelSpec("Llama2-70B", (), 80, 8192, 64, 8, 128, 28672, 32000, 68_976_648_192, 8192)
QWEN25_05B = ModelSpec("Qwen2.5-0.5B", (), 24, 896, 14, 2, 64, 4864, 151936, 494_032_768, 32768)
# A 27B dense model: Gemma-2-27B's config.json (46 layers, 32/16 heads, FFN 36864).
DENSE_27B = ModelSpec(
    "27B (Gemma-2-27B)", (), 46, 4608, 32, 16, 128, 36864, 256000, 27_227_128_320, 8192
)


@dataclass(frozen=True, slots=True)
class LoadResult:
    """One closed-loop run at ``concurrency`` clients."""

    concurrency: int
    output_tok_s: float
    ttft_p50_s: float
    tpot_p50_s: float
    itl_p50_s: float
    num_preemptions: int


@dataclass(frozen=True, slots=True)
class Point:
    setup: str
    figure: str
    measured: float
    twin: float
    unit: str
    kind: str = "predict"

    @property
    def ratio(self) -> float:
        return self.twin / self.measured

    @property
    def is_within(self) -> bool:
        return abs(self.ratio - 1.0) <= TOLERANCE


@dataclass(frozen=True, slots=True)
class Setup:
    gpu: GpuSpec
    model: ModelSpec
    tp: int = 1
    quant: str = "bf16"
    num_input_tokens: int = 1024
    num_output_tokens: int = 128

    def timing(self) -> StepTimeModel:
        return StepTimeModel(self.gpu, self.model, self.tp, self.quant)

    def engine(self, timing: StepTimeModel) -> EngineCore:
        max_len = self.num_input_tokens + self.num_output_tokens
        ledger = plan_memory(self.gpu, self.model, self.tp, self.quant, max_model_len=max_len)
        config = EngineConfig(
            num_blocks=ledger.num_kv_blocks,
            max_num_seqs=self.gpu.max_num_seqs,
            max_num_batched_tokens=self.gpu.max_num_batched_tokens,
            max_model_len=max_len,
            enable_prefix_caching=False,
        )
        return EngineCore(config, timing)


class _ClosedLoop:
    """C clients against one modelled engine, in modelled time."""

    def __init__(self, setup: Setup, concurrency: int, num_rounds: int) -> None:
        self.setup, self.concurrency, self.num_rounds = setup, concurrency, num_rounds
        self.timing = setup.timing()
        self.core = setup.engine(self.timing)
        self.now_s = 0.0
        self.arrivals: list[tuple[float, int]] = []  # (engine arrival time, request no)
        self.submit_s: dict[str, float] = {}
        self.token_times: dict[str, list[float]] = {}
        self.num_sent = 0
        self.num_output_tokens = 0
        self.num_preemptions = 0
        self.finished: list[list[float]] = []
        self.ttfts: list[float] = []

    def _send(self) -> None:
        """A client sends its next request now; the engine sees it after the API overhead."""
        arrival_s = self.now_s + self.timing.per_request_api_overhead_s
        heapq.heappush(self.arrivals, (arrival_s, self.num_sent))
        self.submit_s[f"r{self.num_sent}"] = self.now_s
        self.num_sent += 1

    def _admit(self) -> None:
        while self.arrivals and self.arrivals[0][0] <= self.now_s:
            _, seq_no = heapq.heappop(self.arrivals)
            prompt = [(seq_no * 7919 + i) % 50_000 for i in range(self.setup.num_input_tokens)]
            seq = EngineSequence(f"r{seq_no}", prompt, self.setup.num_output_tokens)
            self.core.add(seq)
            self.token_times[seq.seq_id] = []

    def _step(self) -> None:
        result = self.core.step()
        if result.num_steps == 0:
            raise RuntimeError("engine made no progress")
        self.now_s += result.duration_s
        self.num_preemptions += result.num_preempted
        for seq_id in result.new_tokens:
            self.token_times[seq_id].append(self.now_s)
        for seq in result.finished:
            times = self.token_times.pop(seq.seq_id)
            self.ttfts.append(times[0] - self.submit_s.pop(seq.seq_id))
            self.finished.append(times)
            self.num_output_tokens += len(times)
            if self.num_sent < self.concurrency * self.num_rounds:
                self._send()  # the client that got this answer sends again

    def run(self) -> LoadResult:
        for _ in range(self.concurrency):
            self._send()
        while len(self.finished) < self.concurrency * self.num_rounds:
            self._admit()
            if self.core.has_unfinished():
                self._step()
            else:
                self.now_s = self.arrivals[0][0]
        return self._result()

    def _result(self) -> LoadResult:
        tpots = [(t[-1] - t[0]) / (len(t) - 1) for t in self.finished if len(t) > 1]
        itls = [b - a for t in self.finished for a, b in itertools.pairwise(t)]
        return LoadResult(
            concurrency=self.concurrency,
            output_tok_s=self.num_output_tokens / self.now_s,
            ttft_p50_s=statistics.median(self.ttfts),
            tpot_p50_s=statistics.median(tpots),
            itl_p50_s=statistics.median(itls),
            num_preemptions=self.num_preemptions,
        )


def closed_loop(setup: Setup, concurrency: int, num_rounds: int = 3) -> LoadResult:
    """Run ``concurrency`` closed-loop clients for ``num_rounds`` requests each."""
    return _ClosedLoop(setup, concurrency, num_rounds).run()


def sweep(setup: Setup, concurrencies: Sequence[int]) -> list[LoadResult]:
    return [closed_loop(setup, c) for c in concurrencies]


def powers_of_two(max_value: int) -> list[int]:
    return [1 << i for i in range(max_value.bit_length()) if 1 << i <= max_value]


def knee(results: Sequence[LoadResult], min_gain: float = 1.15) -> int:
    """First concurrency after which doubling the clients adds < 15% throughput."""
    for prev, nxt in itertools.pairwise(results):
        if nxt.output_tok_s < min_gain * prev.output_tok_s:
            return prev.concurrency
    return results[-1].concurrency


# --- the measured points ---------------------------------------------------------------
def points_llama8b_a100_40g() -> list[Point]:
    setup, name = Setup(A100_40G, get_model("llama-3.1-8b")), "Llama-3.1-8B A100-40GB 1024/128"
    c1, c8 = closed_loop(setup, 1), closed_loop(setup, 8)
    return [
        Point(name, "output tok/s at C=1", 75, c1.output_tok_s, "tok/s"),
        Point(name, "throughput C=8 / C=1", 6.6, c8.output_tok_s / c1.output_tok_s, "x"),
    ]


def saturation(setup: Setup, max_concurrency: int) -> list[LoadResult]:
    return sweep(setup, powers_of_two(min(max_concurrency, setup.gpu.max_num_seqs)))


def points_h100_8b(max_concurrency: int) -> list[Point]:
    model, h100 = get_model("llama-3.1-8b"), get_gpu("H100")
    bf16 = saturation(Setup(h100, model), max_concurrency)
    fp8 = saturation(Setup(h100, model, quant="fp8"), max_concurrency)
    # MLPerf server: the best throughput with TTFT p50 <= 2 s and TPOT p50 <= 100 ms
    server = [r for r in fp8 if r.ttft_p50_s <= 2.0 and r.tpot_p50_s <= 0.1]
    best = max(bf16, key=lambda r: r.output_tok_s)
    best_fp8 = max(fp8, key=lambda r: r.output_tok_s)
    best_server = max(server, key=lambda r: r.output_tok_s)
    return [
        Point(f"Llama-3.1-8B H100 bf16 1024/128 (C={best.concurrency})",
              "saturation output tok/s", 5333, best.output_tok_s, "tok/s"),
        Point(f"Llama-3.1-8B H100 fp8 1024/128 (C={best_fp8.concurrency})",
              "MLPerf offline tok/s", 5777, best_fp8.output_tok_s, "tok/s"),
        Point(f"Llama-3.1-8B H100 fp8 1024/128 (C={best_server.concurrency})",
              "MLPerf server tok/s", 5103, best_server.output_tok_s, "tok/s"),
    ]  # fmt: skip


def points_splitwise() -> list[Point]:
    h100, a100 = get_gpu("H100"), get_gpu("A100")
    tp2_h, tp2_a = StepTimeModel(h100, LLAMA2_70B, 2), StepTimeModel(a100, LLAMA2_70B, 2)
    tp4_h = StepTimeModel(h100, LLAMA2_70B, 4)
    name = "Llama2-70B"
    ms = 1e3
    return [
        Point(f"{name} H100 TP2 8k prompt", "prefill ms", 1340,
              tp2_h.step_time_s([(8192, 0)], []) * ms, "ms"),
        Point(f"{name} H100 TP2 8k prompt", "decode ms/token b=1", 37.8,
              tp2_h.step_time_s([], [8192 + 64]) * ms, "ms"),
        Point(f"{name} A100 TP2 8k prompt", "prefill ms", 2990,
              tp2_a.step_time_s([(8192, 0)], []) * ms, "ms"),
        Point(f"{name} A100 TP2 8k prompt", "decode ms/token b=1", 57.3,
              tp2_a.step_time_s([], [8192 + 64]) * ms, "ms"),
        Point(f"{name} H100 TP4 8k prompt", "decode ms/token b=1", 29.4,
              tp4_h.step_time_s([], [8192 + 64]) * ms, "ms"),
        Point(f"{name} H100 TP4 512 prompt", "decode ms/token b=64", 52.4,
              tp4_h.step_time_s([], [512 + 64] * 64) * ms, "ms"),
    ]  # fmt: skip


def points_qwen05b_l4() -> list[Point]:
    setup = Setup(L4, QWEN25_05B, num_input_tokens=256)
    c1, c32 = closed_loop(setup, 1, num_rounds=4), closed_loop(setup, 32, num_rounds=4)
    name = "Qwen2.5-0.5B L4 256/128"
    return [
        Point(name, "ITL p50 ms C=1", 5.1, c1.itl_p50_s * 1e3, "ms"),
        Point(name, "ITL p50 ms C=32", 7.1, c32.itl_p50_s * 1e3, "ms"),
        Point(name, "TTFT p50 ms C=1", 27, c1.ttft_p50_s * 1e3, "ms"),
        Point(name, "TTFT p50 ms C=32", 135, c32.ttft_p50_s * 1e3, "ms"),
    ]


def points_seed002() -> list[Point]:
    setup = Setup(DOMESTIC, DENSE_27B, quant="int4")
    runs = {c: closed_loop(setup, c) for c in (1, 4, 8, 16)}
    name = "27B INT4 domestic accel 1024/128"
    return [
        Point(name, "TPOT p50 ms C=1", 22, runs[1].tpot_p50_s * 1e3, "ms", "fit"),
        Point(name, "TPOT p50 ms C=4", 35, runs[4].tpot_p50_s * 1e3, "ms"),
        Point(name, "TPOT p50 ms C=8", 70, runs[8].tpot_p50_s * 1e3, "ms"),
        Point(name, "output tok/s C=1", 45, runs[1].output_tok_s, "tok/s"),
        Point(name, "output tok/s C=8", 110, runs[8].output_tok_s, "tok/s", "fit"),
        Point(name, "tok/s C=16 / C=8 (flat)", 1.0,
              runs[16].output_tok_s / runs[8].output_tok_s, "x"),
    ]  # fmt: skip


def print_points(points: Sequence[Point]) -> None:
    header = f"{'setup':<44} {'figure':<26} {'measured':>9} {'twin':>9} {'ratio':>6}  within 25%"
    print(header)
    print("-" * len(header))
    for p in points:
        verdict = "yes" if p.is_within else "NO"
        print(
            f"{p.setup:<44} {p.figure:<26} {p.measured:>9.1f} {p.twin:>9.1f} "
            f"{p.ratio:>6.2f}  {verdict}{' (fitted)' if p.kind == 'fit' else ''}"
        )
    predicted = [p for p in points if p.kind == "predict"]
    num_within = sum(p.is_within for p in predicted)
    print(f"\npredicted points within 25%: {num_within}/{len(predicted)}")


# --- catalog sweep ---------------------------------------------------------------------
def catalog_setups() -> list[Setup]:
    setups = []
    for gpu in list_gpus():
        for model in list_models():
            tp = smallest_fitting(gpu, model, max_model_len=1152).tp
            if tp is not None:
                setups.append(Setup(gpu, model, tp))
    return setups


def print_sweep(setup: Setup, results: Sequence[LoadResult]) -> None:
    title = f"{setup.model.name} on {setup.tp} x {setup.gpu.name} ({setup.quant}, 1024/128)"
    print(f"\n{title}: knee at C={knee(results)}")
    print(f"  {'C':>5} {'out tok/s':>10} {'TTFT p50 ms':>12} {'TPOT p50 ms':>12} {'preempt':>8}")
    for r in results:
        print(
            f"  {r.concurrency:>5} {r.output_tok_s:>10.0f} {r.ttft_p50_s * 1e3:>12.1f} "
            f"{r.tpot_p50_s * 1e3:>12.2f} {r.num_preemptions:>8}"
        )


def run_catalog_sweep(max_concurrency: int) -> None:
    print("\n=== Concurrency sweep per catalog setup (smallest power-of-two TP, bf16) ===")
    for setup in catalog_setups():
        try:
            results = sweep(setup, powers_of_two(min(max_concurrency, setup.gpu.max_num_seqs)))
        except DoesNotFitError as exc:
            print(f"\n{setup.model.name} on {setup.gpu.name}: {exc}")
            continue
        print_sweep(setup, results)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-sweep", action="store_true", help="skip the catalog sweep")
    parser.add_argument("--max-concurrency", type=int, default=512)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    sections: list[Callable[[], list[Point]]] = [
        points_llama8b_a100_40g,
        lambda: points_h100_8b(args.max_concurrency),
        points_splitwise,
        points_qwen05b_l4,
        points_seed002,
    ]
    points = [p for section in sections for p in section()]
    print_points(points)
    if not args.no_sweep:
        run_catalog_sweep(min(args.max_concurrency, 256))
    print(f"\n(took {time.perf_counter() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
