#!/usr/bin/env bash
# Install the Rust routers that benchmarks/gateway_overhead.py measures beside the gateway
# (SGLang's model gateway and vLLM's router, both PyPI wheels) into their own venv:
#   $KILOSERVE_CACHE/peer-routers (default ${XDG_CACHE_HOME:-~/.cache}/kiloserve/peer-routers)
# They are benchmark references, not kiloserve dependencies. Idempotent (a stamp per pin
# set) and never fails the build: without them the benchmark and its test skip them,
# saying so. The pins match PINS in benchmarks/peer_routers.py.
set -uo pipefail

CACHE="${KILOSERVE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kiloserve}"
VENV="$CACHE/peer-routers"
PINS=("sglang-router==0.3.2" "vllm-router==0.1.17")
STAMP="$VENV/.installed-$(echo "${PINS[*]}" | tr ' =' '_-')"
PY="${PY:-python3}"

[ -f "$STAMP" ] && exit 0
mkdir -p "$CACHE/logs"
LOG="$CACHE/logs/peer-routers.log"
echo "peer_routers: installing ${PINS[*]} into $VENV (log: $LOG)" >&2
rm -rf "$VENV"
if "$PY" -m venv "$VENV" >"$LOG" 2>&1 &&
    "$VENV/bin/python" -m pip install -q "${PINS[@]}" >>"$LOG" 2>&1; then
    touch "$STAMP"
else
    echo "peer_routers: could not install them (see $LOG); the benchmark skips them" >&2
    rm -rf "$VENV"
fi
exit 0
