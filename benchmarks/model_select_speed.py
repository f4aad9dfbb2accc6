"""Cost of model selection per request (issue 17, S1.1): ``ModelPicker.pick`` with a
verified HS256 JWT claim, and with the header alone.

    .venv/bin/python benchmarks/model_select_speed.py

Prints microseconds per request (the mean of 20,000 calls, in this process).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
import timeit

import orjson

from kiloserve.gateway.model_select import ModelFromConfig, ModelPicker

NUM_CALLS = 20_000
SECRET = "bench-secret"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _token() -> str:
    head = _b64(orjson.dumps({"alg": "HS256", "typ": "JWT"}))
    body = _b64(orjson.dumps({"sub": "u1", "model": "b", "exp": time.time() + 3600}))
    sig = hmac.new(SECRET.encode(), f"{head}.{body}".encode(), hashlib.sha256).digest()
    return f"{head}.{body}.{_b64(sig)}"


def main() -> None:
    cfg = ModelFromConfig(
        header="x-kiloserve-model", jwt_claim="model", jwt_secret_env="BENCH_JWT_SECRET"
    )
    picker = ModelPicker(cfg, env={"BENCH_JWT_SECRET": SECRET})
    cases = {
        "verified JWT claim": {"authorization": "Bearer " + _token(), "x-kiloserve-model": "a"},
        "header only": {"x-kiloserve-model": "a"},
    }
    for name, headers in cases.items():
        total_s = timeit.timeit(
            lambda h=headers: picker.pick({"model": "m", "prompt": "hi"}, h), number=NUM_CALLS
        )
        print(f"{name}: {total_s / NUM_CALLS * 1e6:.1f} us per request")


if __name__ == "__main__":
    main()
