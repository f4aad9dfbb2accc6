"""A twin's part in disaggregated serving: its role, engine id, KV link and held prefills.

Built once by ``build_twin`` from ``TwinConfig`` (``--role``, ``--kv-link``,
``--kv-hold-timeout-s``) and read by the HTTP side (``engine/disagg_routes.py``).
The decode side's transfer time is ``engine.transfer.kv_transfer_time_s`` of the
transferred tokens, one GPU's KV bytes per token and the ``--kv-link`` link of this
twin's GPU: TP ranks move their shards in parallel, each over its own link.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass

from kiloserve.catalog import GpuSpec
from kiloserve.engine.config import ROLES
from kiloserve.engine.kv_holds import KvHolds
from kiloserve.engine.transfer import LINK_KINDS, KvLink, kv_transfer_time_s, link_for
from kiloserve.errors import ConfigError

__all__ = ["TwinPd", "check_pd_options", "twin_pd_for"]


@dataclass(slots=True, eq=False)
class TwinPd:
    """What the twin's HTTP side needs for P/D legs."""

    role: str
    engine_id: str  # this twin's ``remote_engine_id`` (new at every start, as vLLM's)
    link: KvLink  # the link a decode leg pulls KV over
    kv_bytes_per_token_per_gpu: int
    tp: int
    holds: KvHolds

    def transfer_time_s(self, num_tokens: int) -> float:
        """Modelled seconds to pull ``num_tokens`` tokens of KV over ``link``."""
        return kv_transfer_time_s(num_tokens, self.kv_bytes_per_token_per_gpu, self.link)

    def transfer_bytes(self, num_tokens: int) -> int:
        """KV bytes ``num_tokens`` tokens are, over every TP rank."""
        return num_tokens * self.kv_bytes_per_token_per_gpu * self.tp


def check_pd_options(
    role: str, kv_link: str, kv_hold_timeout_s: float, kv_cpu_gib: float, kv_remote_gib: float
) -> None:
    """``ConfigError`` naming the flag when a P/D or tier option is invalid."""
    if role not in ROLES:
        raise ConfigError(f"--role must be one of {', '.join(ROLES)}, got {role!r}")
    if kv_link not in LINK_KINDS:
        raise ConfigError(f"--kv-link must be one of {', '.join(LINK_KINDS)}, got {kv_link!r}")
    if not (math.isfinite(kv_hold_timeout_s) and kv_hold_timeout_s > 0):
        raise ConfigError(f"--kv-hold-timeout-s must be > 0, got {kv_hold_timeout_s}")
    for flag, gib in (("--kv-cpu-gib", kv_cpu_gib), ("--kv-remote-gib", kv_remote_gib)):
        if not (math.isfinite(gib) and gib >= 0):
            raise ConfigError(f"{flag} must be a number >= 0, got {gib}")


def twin_pd_for(
    gpu: GpuSpec,
    *,
    role: str,
    kv_link: str,
    kv_bytes_per_token_per_gpu: int,
    tp: int,
    holds: KvHolds,
) -> TwinPd:
    """The twin's P/D part (a fresh engine id)."""
    return TwinPd(
        role=role,
        engine_id=str(uuid.uuid4()),
        link=link_for(gpu, kv_link),
        kv_bytes_per_token_per_gpu=kv_bytes_per_token_per_gpu,
        tp=tp,
        holds=holds,
    )
