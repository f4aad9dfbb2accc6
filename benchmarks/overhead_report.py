"""The summary lines of ``benchmarks/gateway_overhead.py``: every target as met or not,
and the gateway's ratios to the references measured in the same run."""

from __future__ import annotations

__all__ = ["report", "verdict"]


def _cpu_ratios(gw: dict[str, float], ref: dict[str, float]) -> tuple[float, float]:
    """The gateway's CPU as a multiple of ``ref``'s: per request (saturated), per chunk."""
    per_request = gw["cpu_us_saturated"] / max(ref["cpu_us_saturated"], 1e-9)
    return per_request, gw["cpu_us_per_chunk"] / max(ref["cpu_us_per_chunk"], 1e-9)


def verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


def report(results: dict[str, dict[str, float]]) -> None:
    direct = results["direct"]
    print(
        f"\n{'target':<14}{'p50 ms':>9}{'p99 ms':>9}{'max req/s':>11}{'CPU us/req mod':>16}"
        f"{'CPU us/req sat':>16}{'CPU us/chunk':>14}{'errors':>8}"
    )
    for name, r in results.items():
        print(
            f"{name:<14}{r['p50_ms']:>9.3f}{r['p99_ms']:>9.3f}{r['max_rps']:>11.0f}"
            f"{r.get('cpu_us_moderate', float('nan')):>16.1f}"
            f"{r.get('cpu_us_saturated', float('nan')):>16.1f}"
            f"{r.get('cpu_us_per_chunk', float('nan')):>14.2f}{r['errors']:>8.0f}"
        )
    gw = results["gateway"]
    added_p50 = gw["p50_ms"] - direct["p50_ms"]
    added_p99 = gw["p99_ms"] - direct["p99_ms"]
    print()
    print(
        f"gateway CPU per request (saturated): {gw['cpu_us_saturated']:.1f} us "
        f"(target <= 150 us: {verdict(gw['cpu_us_saturated'] <= 150)}); "
        f"at moderate load {gw['cpu_us_moderate']:.1f} us "
        f"({verdict(gw['cpu_us_moderate'] <= 150)})"
    )
    print(
        f"gateway CPU per relayed chunk: {gw['cpu_us_per_chunk']:.2f} us "
        f"(target <= 10 us: {verdict(gw['cpu_us_per_chunk'] <= 10)})"
    )
    print(
        f"added latency at moderate load: p50 {added_p50:.3f} ms "
        f"(target <= 1 ms: {verdict(added_p50 <= 1.0)}), p99 {added_p99:.3f} ms"
    )
    print(f"max requests/s: gateway {gw['max_rps']:.0f} vs direct {direct['max_rps']:.0f}")
    print(
        f"gateway CPU per request, default policy (issue 16: <= 100 us): "
        f"{gw['cpu_us_saturated']:.1f} us ({verdict(gw['cpu_us_saturated'] <= 100)})"
    )
    base = results.get("gw-asyncio")
    if base is not None:
        ratio = gw["cpu_us_saturated"] / base["cpu_us_saturated"]
        print(
            f"event loop: default {gw['cpu_us_saturated']:.1f} us/req vs asyncio's "
            f"{base['cpu_us_saturated']:.1f} ({ratio:.2f}x)"
            f", {gw['cpu_us_per_chunk']:.2f} vs {base['cpu_us_per_chunk']:.2f} us/chunk, "
            f"{gw['max_rps']:.0f} vs {base['max_rps']:.0f} req/s "
            f"({gw['max_rps'] / base['max_rps']:.2f}x)"
        )
    for name, r in results.items():
        if name.startswith("gw-") and name.endswith("w"):
            speedup = r["max_rps"] / gw["max_rps"]
            cpu = r["cpu_us_saturated"] / gw["cpu_us_saturated"]
            print(
                f"{name}: {r['max_rps']:.0f} req/s vs one worker's {gw['max_rps']:.0f} "
                f"({speedup:.2f}x, issue 16 target >= 1.3x: {verdict(speedup >= 1.3)}); CPU "
                f"per request {r['cpu_us_saturated']:.1f} vs {gw['cpu_us_saturated']:.1f} us "
                f"({cpu:.2f}x, target within 10%: {verdict(cpu <= 1.10)})"
            )
    for name in ("nginx", "sglang-router", "vllm-router"):
        if name not in results:
            continue
        ref = results[name]
        ratio, chunk_ratio = _cpu_ratios(gw, ref)
        print(
            f"{name} reference: CPU {ref['cpu_us_saturated']:.1f} us/req, "
            f"{ref['cpu_us_per_chunk']:.2f} us/chunk, added p50 "
            f"{ref['p50_ms'] - direct['p50_ms']:.3f} ms, {ref['max_rps']:.0f} req/s; "
            f"gateway/{name} CPU ratio {ratio:.2f}x per request, {chunk_ratio:.2f}x per chunk"
        )
    if "vllm-router" in results:  # issue 16's 100 us is the figure vllm-router reached
        ratio = gw["cpu_us_saturated"] / max(results["vllm-router"]["cpu_us_saturated"], 1e-9)
        print(
            f"issue 16, same run: gateway CPU per request {ratio:.2f}x vllm-router's "
            f"(the 100 us target is vllm-router's figure: <= 1.00x {verdict(ratio <= 1.0)})"
        )
    before = results.get("gw-before")
    if before is not None:  # --before-src: the same gateway config, an older source tree
        ratio, chunk_ratio = _cpu_ratios(gw, before)
        print(
            f"against --before-src, same run: CPU per request {ratio:.2f}x, per relayed chunk "
            f"{chunk_ratio:.2f}x (issue 16: per chunk no worse than before, <= 1.00x "
            f"{verdict(chunk_ratio <= 1.0)})"
        )
