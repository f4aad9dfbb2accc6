"""Request profiling speed (S1.1: a profile in well under 5 ms).

    .venv/bin/python benchmarks/profile_speed.py

Profiles chat requests of 1k, 8k and 32k tokens with the gateway's ``Profiler`` (token
estimate, session key, chained prefix hashes) and prints the best-of-5 mean time per
profile against the 5 ms target.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kiloserve.gateway.config import parse_gateway_config
from kiloserve.gateway.profile import Profiler
from kiloserve.tokens import filler_text

TARGET_MS = 5.0


def best_ms(prof: Profiler, body: dict[str, object], rounds: int = 5, per_round: int = 20) -> float:
    prof.profile("warm", body, {})
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        for i in range(per_round):
            prof.profile(str(i), body, {"x-session-id": "s"})
        best = min(best, (time.perf_counter() - started) / per_round * 1000)
    return best


def main() -> int:
    prof = Profiler(parse_gateway_config({}))
    print(f"{'prompt tokens':>14} {'ms / profile':>13}  target <= {TARGET_MS} ms")
    for num_tokens in (1000, 8000, 32000):
        body = {"model": "m", "messages": [{"role": "user", "content": filler_text(num_tokens)}]}
        ms = best_ms(prof, body)
        verdict = "met" if ms <= TARGET_MS else "NOT met"
        print(f"{num_tokens:>14} {ms:>13.3f}  {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
