"""Scorers for the ``scored`` policy: each maps every candidate to a score in [0, 1].

Higher is better. Every scorer sees one ``ScoringContext`` (the request, the
candidates in snapshot order, and the per-request lookups some scorers need). Load
scorers divide load by ``weight * effective_weight``, so slow-node demotion (S3.2)
lowers them; unknown scraped state scores 0 (saturated), never 1.

* ``queue``: ``1 - min(1, num_requests / capacity_weight / cap)``; cap is the backend's
  ``max_num_seqs``, else the pool's largest known load (at least 1).
* ``tokens``: ``1 - min(1, outstanding tokens incl. this request / capacity_weight /
  cap)``; cap is ``kv_capacity_tokens``, else the pool's largest (at least 1).
* ``kv``: free KV fraction; stale or unknown is 0.
* ``prefix``: matched leading blocks / request blocks, from the policy's prefix index;
  0 below ``min_prompt_tokens``.
* ``latency``: ``min_latency / latency`` over the pool, latency being EWMA TTFT (or
  TPOT) divided by capacity weight; unknown latency takes the pool mean.
* ``session``: 1 for the backends of the group the session key hashes to, else 0.
* ``weight``: ``weight * effective_weight`` / the pool's largest.
* ``ttft``: ``min_pred / pred`` over the pool, ``pred`` being the predicted time to
  first token: the backend's learned prefill speed (``accounting.prefill_ms_per_token``,
  the median of its GPU type's; see ``_prefill_speeds``) times the prefill work it
  would have (outstanding prefill tokens plus this request's tokens not already cached
  there, from the prefix index), divided by capacity weight. While a backend's type
  has learned nothing (young), its speed is a prior from the catalog: the learned
  types' speeds scaled by the ratio of the replicas' ``prefill_capability`` (GPU
  TFLOPS x prefill MFU x TP; geometric mean over the learned types); without a
  capability, the pool median of the learned speeds. Long prompts go to fast, idle
  prefills. A backend at or past ``SATURATED_SHARE`` (0.9) of ``max_num_seqs``, or of
  its KV cache while it is queueing (see ``_saturations``; unknown counts as
  saturated), gets no prefix credit and its work is divided by ``1 - saturation`` (it
  will queue or preempt).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal, cast

from kiloserve.policies.accounting import MIN_TTFT_SAMPLES
from kiloserve.policies.base import BackendState, RequestInfo
from kiloserve.policies.hash_ring import group_name
from kiloserve.policies.signals import (
    capacity_weight,
    kv_free_fractions,
    token_loads,
)

__all__ = ["SCORERS", "ScorerName", "ScoringContext"]

_INF = float("inf")
ScorerName = Literal["queue", "tokens", "kv", "prefix", "latency", "session", "weight", "ttft"]


@dataclass(slots=True)
class ScoringContext:
    request: RequestInfo
    pool: list[BackendState]
    prefix_depths: Mapping[str, int] = field(default_factory=dict)
    num_prefix_blocks: int = 0
    session_group: str | None = None
    latency_metric: Literal["ttft", "tpot"] = "ttft"
    block_size: int = 16


def _headroom(loads: list[float], caps: list[int | None]) -> list[float]:
    """``1 - min(1, load / cap)``; a missing cap is the largest finite load (>= 1)."""
    pool_cap = max([x for x in loads if x < _INF], default=1.0)
    pool_cap = pool_cap if pool_cap > 1.0 else 1.0
    return [
        0.0 if (ratio := load / (cap or pool_cap)) >= 1.0 else 1.0 - ratio
        for load, cap in zip(loads, caps, strict=True)
    ]


def _queue_load(b: BackendState) -> float:
    running, waiting = b.num_running, b.num_waiting
    if b.scrape_stale or running is None or waiting is None:
        return _INF
    queued = running + waiting
    return (b.in_flight if b.in_flight > queued else queued) / (b.weight * b.effective_weight)


def queue_score(ctx: ScoringContext) -> list[float]:
    loads = [_queue_load(b) for b in ctx.pool]
    return _headroom(loads, [b.max_num_seqs for b in ctx.pool])


def tokens_score(ctx: ScoringContext) -> list[float]:
    new_tokens = ctx.request.input_tokens + ctx.request.predicted_output_tokens
    loads = token_loads(ctx.pool, new_tokens)
    return _headroom(loads, [b.kv_capacity_tokens for b in ctx.pool])


def kv_score(ctx: ScoringContext) -> list[float]:
    return kv_free_fractions(ctx.pool)


def prefix_score(ctx: ScoringContext) -> list[float]:
    if not ctx.prefix_depths or ctx.num_prefix_blocks == 0:
        return [0.0] * len(ctx.pool)
    depths, n = ctx.prefix_depths, ctx.num_prefix_blocks
    return [depths.get(b.backend_id, 0) / n for b in ctx.pool]


def latency_score(ctx: ScoringContext) -> list[float]:
    is_ttft = ctx.latency_metric == "ttft"
    raw = [b.ewma_ttft_ms if is_ttft else b.ewma_tpot_ms for b in ctx.pool]
    known = [x for x in raw if x is not None]
    if not known:
        return [1.0] * len(ctx.pool)
    fill = sum(known) / len(known)
    latencies = [
        (fill if x is None else x) / capacity_weight(b) for b, x in zip(ctx.pool, raw, strict=True)
    ]
    best = min(latencies)
    return [1.0 if x <= 0.0 else best / x for x in latencies]


def session_score(ctx: ScoringContext) -> list[float]:
    group = ctx.session_group
    return [1.0 if group is not None and group_name(b) == group else 0.0 for b in ctx.pool]


def weight_score(ctx: ScoringContext) -> list[float]:
    weights = [capacity_weight(b) for b in ctx.pool]
    top = max(weights)
    return [w / top for w in weights]


SATURATED_SHARE = 0.9
WAITING_PENALTY = 0.5  # each foreign waiting request adds half the work again
MIN_FOREIGN_WAITING = 3  # fewer can be scrape lag (requests finished since the scrape)


def _saturations(pool: list[BackendState]) -> list[float]:
    """Per backend, the larger of queue share (of ``max_num_seqs``, requests counted as
    ``signals.num_requests``) and KV usage; unknown is 1. One pass (hot path).

    KV usage counts only while the engine queues (``num_waiting`` > 0, or not reported).
    A high reading alone is no saturation: an engine that counts blocks kept as prefix
    cache reads 0.9-1.0 while healthy, and the one that served most (often the fastest)
    reads highest, so ``1 / (1 - usage)`` sent work to the slowest backend. No usage
    threshold tells a cache full of reusable prefixes from one full of live requests;
    a queue does: an engine that cannot fit a new request makes it wait, and the next
    scrape shows ``num_waiting``.
    """
    out: list[float] = []
    for b in pool:
        usage, waiting = b.kv_usage, b.num_waiting
        if b.scrape_stale or usage is None:
            out.append(1.0)
            continue
        if waiting is not None and waiting <= 0:
            usage = 0.0  # not queueing: its KV usage is no saturation
        max_num_seqs = b.max_num_seqs
        if not max_num_seqs:
            share = 0.0
        elif b.num_running is None or waiting is None:
            share = b.in_flight / max_num_seqs
        else:
            share = max(b.in_flight, b.num_running + waiting) / max_num_seqs
        out.append(usage if usage > share else share)  # max(share, usage)
    return out


def _median(values: list[float]) -> float:
    values.sort()
    return values[len(values) // 2]


def _group_speeds(pool: list[BackendState]) -> tuple[list[float | None], dict[str, float]]:
    """Learned prefill speed per backend, pooled over backends of the same GPU type.

    Backends on the same hardware run at the same speed; one backend's EWMA is noisy,
    and with hundreds of backends the luckiest estimate would draw every request
    (herding). The median of the group's estimates is both steadier and truer. Where
    the backends carry a ``prefill_capability`` (the table fills it from the catalog,
    TP included), the group pools ``speed x capability`` and each backend takes that
    median divided by its own capability: a TP2 and a TP4 replica of one GPU type
    share what they learned, each at its own speed. Backends without a GPU label are
    shrunk halfway (geometric mean) towards the median of the unlabelled ones. Returns
    the speeds (None: the type learned nothing yet) and the medians by GPU label.
    (``accounting.prefill_ms_per_token`` is inlined.)
    """
    own: list[float | None] = [
        ttft_ms / work
        if (ttft_ms := b.ewma_ttft_ms) is not None
        and (work := b.ewma_prefill_work_tokens) is not None
        and not work <= 0.0  # (not "> 0.0": a NaN work divides, as in accounting)
        and b.num_ttft_samples >= MIN_TTFT_SAMPLES
        else None
        for b in pool
    ]
    groups: dict[str, list[float]] = {}
    for b, speed in zip(pool, own, strict=True):
        if speed is not None:
            gpu, cap = b.gpu, b.prefill_capability
            if gpu and cap:
                speed *= cap  # ms per token x TFLOPS: the same for any TP of this GPU
            group = groups.get(gpu)
            if group is None:
                groups[gpu] = [speed]
            else:
                group.append(speed)
    if not groups:
        return own, {}  # every speed unknown: all None either way
    medians = {gpu: _median(v) for gpu, v in groups.items()}
    speeds = [
        None
        if (median := medians.get(gpu := b.gpu)) is None
        else (median / cap if (cap := b.prefill_capability) else median)
        if gpu
        else None
        if speed is None
        else math.sqrt(speed * median)
        for b, speed in zip(pool, own, strict=True)
    ]
    return speeds, medians


def _prefill_speeds(pool: list[BackendState]) -> list[float]:
    """Every backend's prefill speed (ms per token of queued prefill work) for ``ttft``.

    The learned group speed (``_group_speeds``); for a backend whose GPU type has
    learned nothing yet, the prior from its ``prefill_capability`` and the learned
    types (``_fill_from_capability``); without a capability, the median of the learned
    speeds. While no type has learned anything, every speed is 1, as before the prior
    (there is no learned speed to scale; see docs/policies.md for what ranking by
    capability alone then did in the simulator).
    """
    speeds, medians = _group_speeds(pool)
    if None not in speeds:
        return cast("list[float]", speeds)  # the hot path: every type learned
    if not medians:
        return [1.0] * len(speeds)  # nothing learned anywhere: no speed to scale
    known = sorted(x for x in speeds if x is not None)
    fill = known[len(known) // 2]
    _fill_from_capability(pool, speeds, medians)
    return [fill if x is None else x for x in speeds]


def _fill_from_capability(
    pool: list[BackendState], speeds: list[float | None], medians: Mapping[str, float]
) -> None:
    """The prior for a backend whose GPU type has learned nothing yet (in place).

    A learned type's median of ``speed x capability`` (``_group_speeds``) is the speed
    of a capability of 1 as that type measured it; the geometric mean over the learned
    labelled types with a capability, divided by the backend's own capability, is its
    prior. So a young A100 next to learned H100s predicts ``H100 median x H100
    capability / A100 capability``, not the H100s' speed. A backend without a
    capability, or a pool where no learned type has one, keeps ``None`` (the pool
    median, as before).
    """
    with_cap = {b.gpu for b in pool if b.gpu and b.prefill_capability}
    log_sum, num = 0.0, 0
    for gpu, median in medians.items():
        if gpu in with_cap and median > 0.0:  # (NaN fails "> 0.0")
            log_sum += math.log(median)
            num += 1
    if num == 0:
        return
    unit = math.exp(log_sum / num)
    for i, b in enumerate(pool):
        cap = b.prefill_capability
        if speeds[i] is None and cap is not None and cap > 0.0:
            speeds[i] = unit / cap


def ttft_score(ctx: ScoringContext) -> list[float]:
    speeds = _prefill_speeds(ctx.pool)
    tokens, depths, bs = ctx.request.input_tokens, ctx.prefix_depths, ctx.block_size
    preds = []
    for b, speed, sat in zip(ctx.pool, speeds, _saturations(ctx.pool), strict=True):
        new_tokens = tokens
        if depths and sat < SATURATED_SHARE:
            new_tokens = max(1, tokens - depths.get(b.backend_id, 0) * bs)
        work = (b.outstanding_prefill_tokens + new_tokens) / (b.weight * b.effective_weight)
        if sat >= SATURATED_SHARE:  # it will queue or preempt: cached blocks may be gone
            work /= max(0.02, 1.0 - sat)
        if b.num_waiting and not b.scrape_stale:
            # Waiting requests this gateway did not send (other gateways, direct clients):
            # its own queued ones are already in outstanding_prefill_tokens.
            own_queued = b.in_flight - (b.num_running or 0)
            foreign = b.num_waiting - (own_queued if own_queued > 0 else 0)
            if foreign >= MIN_FOREIGN_WAITING:
                work *= 1.0 + WAITING_PENALTY * foreign
        preds.append(speed * work)
    best = min(preds)
    return [1.0 if p <= 0.0 else best / p for p in preds]


SCORERS: Mapping[str, Callable[[ScoringContext], list[float]]] = MappingProxyType(
    {
        "queue": queue_score,
        "tokens": tokens_score,
        "kv": kv_score,
        "prefix": prefix_score,
        "latency": latency_score,
        "session": session_score,
        "weight": weight_score,
        "ttft": ttft_score,
    }
)
