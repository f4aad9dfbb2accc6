"""Slow-node demotion and slow start (SPEC S3.2), pure: samples and time passed in.

Each backend keeps a rolling window of its recent TTFT and TPOT samples (at most
``max_num_samples``, none older than ``window_s``). ``evaluate`` compares the window's
median with

* absolute thresholds: ``max_tpot_ms`` (default 300 ms) and ``max_ttft_ms`` (off by
  default), and
* for TPOT only, the *other* backends of its pool (the ``pool_quantile``, 0.9, of their
  window medians; the others, so that one slow node in a pool of two still stands
  out): slow means above ``pool_factor`` (2.5) x that yardstick **and** at least
  ``min_excess_tpot_ms`` (10 ms) above it. The upper decile, not the median: under
  load a chunked long prefill stalls every decode scheduled beside it, so a healthy
  backend that just took long documents shows a window of stalled TPOTs well above
  the pool's median (1,024-GPU simulation, 90% load, chat + long documents: the
  median yardstick demoted 55 healthy H100 replicas in 24 s, the 0.9 quantile 11),
  while a failing GPU (5x slower) stands out of the whole spread. The margin is the
  floor: identical backends whose TPOTs are all near zero (a fake engine, a cached
  reply) differ by large ratios of nothing, and a zero median would make any sample
  "slow".

TTFT is not compared with the pool. A gateway-side TTFT is queueing plus prefill, and
the queue is what routing put there: on identical hardware the backend that got a burst
shows a TTFT several times its peers' and would be demoted for being popular. A slow
GPU slows every decode step, so TPOT shows it whatever the queue (batch size moves TPOT
far less than 2.5x). ``max_ttft_ms`` stays for an operator who wants a TTFT bound.

A slow backend is demoted to ``demoted_weight`` (default 0.2) of its weight instead of
being ejected, with a reason (``tpot_abs``, ``ttft_abs``, ``tpot_pool``); at most
``max_demoted_percent`` of a pool is demoted at once (at least one may be). When it is
clearly back under every threshold (``recover_ratio`` x each, hysteresis against
flapping; or its window has too few recent samples to tell) it ramps back linearly to
full weight over ``slow_start_s`` (slow start); a relapse during the ramp demotes it
again.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

# The demoter itself lives in slow_nodes.py, which the simulator's compiled build
# compiles with mypyc (a pydantic model cannot be a mypyc class); it is re-exported here.
from kiloserve.gateway.resilience.slow_nodes import DemotionEvent, SlowNodeDemoter

__all__ = ["DemotionConfig", "DemotionEvent", "SlowNodeDemoter"]


class DemotionConfig(BaseModel):
    """``demotion:`` section of the gateway config."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    max_tpot_ms: float | None = Field(default=300.0, gt=0.0)
    max_ttft_ms: float | None = Field(default=None, gt=0.0)
    pool_factor: float | None = Field(default=2.5, gt=1.0)
    min_excess_tpot_ms: float = Field(default=10.0, ge=0.0)
    demoted_weight: float = Field(default=0.2, gt=0.0, le=1.0)
    window_s: float = Field(default=30.0, gt=0.0)
    max_num_samples: int = Field(default=16, ge=1)
    min_num_samples: int = Field(default=5, ge=1)
    # the yardstick: this quantile of the other backends' TPOT medians (0.5: their median)
    pool_quantile: float = Field(default=0.9, ge=0.0, le=1.0)
    slow_start_s: float = Field(default=30.0, ge=0.0)
    recover_ratio: float = Field(default=0.8, gt=0.0, le=1.0)
    max_demoted_percent: float = Field(default=50.0, ge=0.0, le=100.0)
