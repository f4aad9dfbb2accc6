"""``kiloserve engine``: run one engine twin (a vLLM-like server on a modelled GPU)."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os

from kiloserve.engine.config import ROLES
from kiloserve.engine.faults import FaultSet, ThermalFault
from kiloserve.engine.kv_holds import DEFAULT_HOLD_TIMEOUT_S
from kiloserve.engine.lora import LoraModule, parse_lora_module
from kiloserve.engine.transfer import LINK_KINDS
from kiloserve.engine.twin import TwinConfig
from kiloserve.errors import ConfigError, RequestError

__all__ = ["ADMIN_TOKEN_ENV", "add_arguments", "admin_token_from_args", "config_from_args", "run"]

logger = logging.getLogger(__name__)

ADMIN_TOKEN_ENV = "KILOSERVE_ADMIN_TOKEN"  # the gateway's admin token variable, too
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"  # as vLLM: the load/unload routes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``kiloserve engine`` (named like vLLM's where vLLM has them)."""
    parser.add_argument("--gpu", required=True, help="catalog GPU name, e.g. H100-SXM")
    parser.add_argument("--model", required=True, help="catalog model name, e.g. llama-3.1-8b")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default 1)")
    parser.add_argument("--quant", default="bf16", help="bf16|fp16|fp8|int8|int4 (default bf16)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, required=True, help="port; 0 picks a free one")
    parser.add_argument("--served-model-name", help="model id clients use (default: catalog)")
    parser.add_argument("--max-num-seqs", type=int, help="batch cap (default: vLLM's for GPU)")
    parser.add_argument("--max-num-batched-tokens", type=int, help="token budget per step")
    parser.add_argument("--max-model-len", type=int, help="context length (default: model's)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.92)
    parser.add_argument(
        "--num-gpu-blocks-override",
        type=int,
        metavar="N",
        help="KV blocks (null block included) instead of the memory ledger's, as vLLM",
    )
    parser.add_argument("--tokenizer", help="path to a tokenizer.json (default: approximation)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the fault RNG")
    parser.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="report usage.prompt_tokens_details.cached_tokens (prefix-cache hits), as vLLM",
    )
    parser.add_argument(
        "--admin-token",
        help=f"bearer token /admin/faults requires (default: ${ADMIN_TOKEN_ENV}; unset: none)",
    )
    parser.add_argument(
        "--admin-allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a Host name /admin/faults answers besides IPs, localhost and --host (repeatable)",
    )
    lora = parser.add_argument_group("LoRA adapters (as vLLM's; docs/engine-twin.md)")
    lora.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters")
    lora.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        type=_lora_module_arg,
        metavar="SPEC",
        help='adapters: name=path or \'{"name": ..., "path": ..., "base_model_name": ...}\'',
    )
    lora.add_argument("--max-loras", type=int, default=1, help="adapters in one batch")
    lora.add_argument("--max-cpu-loras", type=int, help="adapters in the CPU cache")
    kv = parser.add_argument_group("KV-cache events (vLLM's ZMQ format; docs/engine-twin.md)")
    kv.add_argument(
        "--kv-events-endpoint",
        metavar="ADDR",
        help="publish on a ZMQ PUB socket bound here, e.g. tcp://127.0.0.1:5557 (port 0: any)",
    )
    kv.add_argument(
        "--kv-events-replay-endpoint",
        metavar="ADDR",
        help="serve replays of missed batches on a ZMQ ROUTER socket bound here",
    )
    _add_pd_arguments(parser)
    parser.add_argument(
        "--otlp-traces-endpoint",
        metavar="URL",
        help="export a span per request (OTLP/HTTP), as vLLM; needs kiloserve[tracing]",
    )
    faults = parser.add_argument_group("faults (also settable at run time: POST /admin/faults)")
    faults.add_argument("--slowdown", type=float, default=1.0, help="step-time multiplier")
    faults.add_argument("--error-rate", type=float, default=0.0, help="share of failed requests")
    faults.add_argument("--error-status", type=int, default=500, help="status of failures")
    faults.add_argument("--hang", action="store_true", help="accept requests, never answer")
    faults.add_argument("--stall-after-tokens", type=int, help="streams stop after N tokens")
    faults.add_argument(
        "--thermal",
        type=_thermal_arg,
        metavar="JSON",
        help='thermal throttling, e.g. \'{"throttle_at_c": 80, "factor": 2}\' ({} = defaults)',
    )
    node = parser.add_argument_group("node faults (the node page, GET /node/metrics)")
    node.add_argument("--pcie-saturation", type=float, default=0.0, help="PCIe share taken")
    node.add_argument(
        "--nvlink-degrade-at-c", type=float, help="NVLink at half width at or above this (C)"
    )
    node.add_argument("--xid", type=int, default=0, help="the Xid the GPU reports (0: none)")
    node.add_argument("--ecc-dbe-errors", type=int, default=0, help="uncorrectable ECC errors")


def _add_pd_arguments(parser: argparse.ArgumentParser) -> None:
    pd = parser.add_argument_group(
        "disaggregated prefill/decode and KV tiers (docs/engine-twin.md)"
    )
    pd.add_argument(
        "--role",
        choices=ROLES,
        default="both",
        help="prefill legs, decode legs, or both (default; every role serves plain requests)",
    )
    pd.add_argument(
        "--kv-cpu-gib", type=_gib_arg, default=0.0, metavar="N", help="CPU KV tier (default 0)"
    )
    pd.add_argument(
        "--kv-remote-gib", type=_gib_arg, default=0.0, metavar="N", help="remote KV tier (0)"
    )
    pd.add_argument(
        "--kv-link",
        choices=LINK_KINDS,
        default="network",
        help="the link a decode leg pulls KV over (default network)",
    )
    pd.add_argument(
        "--kv-hold-timeout-s",
        type=_positive_seconds_arg,
        default=DEFAULT_HOLD_TIMEOUT_S,
        metavar="S",
        help="free a prefill leg's KV if no decode engine released it by then (default 480)",
    )


def _gib_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a number of GiB >= 0, got {text!r}")
    return value


def _positive_seconds_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}")
    return value


def _thermal_arg(text: str) -> ThermalFault:
    """``--thermal`` as ``POST /admin/faults``'s ``thermal`` object (argparse error if bad)."""
    try:
        return ThermalFault.from_json(json.loads(text))
    except (ValueError, RequestError) as exc:
        raise argparse.ArgumentTypeError(f"--thermal: {exc}") from exc


def _lora_module_arg(text: str) -> LoraModule:
    try:
        return parse_lora_module(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def config_from_args(args: argparse.Namespace) -> TwinConfig:
    """Build the twin's config; bad fault values raise ``RequestError`` (exit code 2)."""
    faults = FaultSet(
        slowdown=args.slowdown,
        error_rate=args.error_rate,
        error_status=args.error_status,
        is_hang=args.hang,
        stall_after_tokens=args.stall_after_tokens,
        thermal=args.thermal,
        pcie_saturation=args.pcie_saturation,
        nvlink_degrade_at_c=args.nvlink_degrade_at_c,
        xid=args.xid,
        ecc_dbe_errors=args.ecc_dbe_errors,
    )
    return TwinConfig(
        gpu=args.gpu,
        model=args.model,
        tp=args.tp,
        quant=args.quant,
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        tokenizer_path=args.tokenizer,
        faults=faults,
        seed=args.seed,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        kv_events_endpoint=args.kv_events_endpoint,
        kv_events_replay_endpoint=args.kv_events_replay_endpoint,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        enable_lora=args.enable_lora,
        lora_modules=tuple(args.lora_modules),
        max_loras=args.max_loras,
        max_cpu_loras=args.max_cpu_loras,
        allow_runtime_lora_updating=_env_true(RUNTIME_LORA_ENV),
        otlp_traces_endpoint=args.otlp_traces_endpoint,
        role=args.role,
        kv_cpu_gib=args.kv_cpu_gib,
        kv_remote_gib=args.kv_remote_gib,
        kv_link=args.kv_link,
        kv_hold_timeout_s=args.kv_hold_timeout_s,
    )


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true")


def admin_token_from_args(args: argparse.Namespace) -> str | None:
    """``--admin-token``, else ``$KILOSERVE_ADMIN_TOKEN``, else ``None`` (no token)."""
    return args.admin_token or os.environ.get(ADMIN_TOKEN_ENV) or None


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT / SIGTERM. A model that does not fit exits with code 2."""
    from kiloserve.engine.server import run_twin

    return run_twin(
        config_from_args(args),
        admin_token=admin_token_from_args(args),
        admin_allowed_hosts=args.admin_allowed_host,
    )
