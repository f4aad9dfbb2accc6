"""Live per-backend accounting shared by the gateway and the simulator.

Both keep a ``BackendState`` per backend and call these at the same moments of a
request's life, so the state a policy sees is built the same way live and simulated:

* ``note_dispatch``: the request was sent (in-flight, outstanding token work, and the
  prefill work queued ahead of it: outstanding prefill tokens plus its own input);
* ``note_first_token``: its first token arrived (prefill done; TTFT sample);
* ``note_complete``: it ended, well or not (TPOT sample, error streak).

A non-streamed request has no first token the gateway can see; for a success the
router estimates its TTFT with ``estimated_ttft_ms`` (E2E minus the decode of the
tokens after the first at the backend's EWMA TPOT) and notes it as a first token at
completion, so non-streamed traffic teaches the prefill speed too.

Learned speeds are EWMAs of samples taken at those moments (``note_dispatch``
returns its prefill-work sample); routers that share one view of the backends (the
gateway's workers, peered gateways) hand each other their samples and feed them in with
``note_sample``, so every router learns from all of the traffic (``SAMPLE_KINDS``).

Learned prefill speed: ``ewma_ttft_ms / ewma_prefill_work_tokens`` is the backend's
observed milliseconds of TTFT per token of prefill work queued at dispatch (a ratio of
EWMAs over the same requests). It captures GPU speed and engine overheads without
knowing the hardware, and ``prefill_ms_per_token`` exposes it to policies, once the
backend has ``MIN_TTFT_SAMPLES`` first tokens: one sample seeds the EWMA, and a first
request that met a cold connection or a short prompt whose TTFT is all fixed cost
(26 tokens in 51 ms reads 2 ms a token) made a GPU type look many times slower than
it is; nothing was sent there again, so nothing corrected it (issue 14, live: two H100
twins got 1 request each of 300 on multi-turn chats). Until then the backend's speed is
unknown and the ``ttft`` scorer takes its GPU type's learned speed, else a prior from
the catalog (``scorers._prefill_speeds``).
"""

from __future__ import annotations

from kiloserve.policies.base import BackendState, Outcome, RequestInfo

__all__ = [
    "EWMA_ALPHA",
    "MIN_TTFT_SAMPLES",
    "SAMPLE_KINDS",
    "SAMPLE_PREFILL_WORK",
    "SAMPLE_TPOT",
    "SAMPLE_TTFT",
    "estimated_ttft_ms",
    "ewma",
    "note_complete",
    "note_dispatch",
    "note_first_token",
    "note_sample",
    "prefill_ms_per_token",
]

EWMA_ALPHA = 0.2
MIN_TTFT_SAMPLES = 3  # first tokens before a backend's learned prefill speed is used
# the learned samples, by kind (the codes routers exchange): the prefill work queued
# at a dispatch, a first token's TTFT, a completion's TPOT
SAMPLE_PREFILL_WORK = 0
SAMPLE_TTFT = 1
SAMPLE_TPOT = 2
SAMPLE_KINDS = ("prefill_work", "ttft", "tpot")


def ewma(old: float | None, sample: float, alpha: float = EWMA_ALPHA) -> float:
    """Exponentially weighted moving average; the first sample seeds it."""
    return sample if old is None else old + alpha * (sample - old)


def prefill_tokens(info: RequestInfo) -> int:
    """The prompt tokens the backend must compute: those not expected cached there
    (``RequestInfo.cached_tokens``, from the engines' KV events or the prefix index)."""
    return max(0, info.input_tokens - info.cached_tokens)


def note_dispatch(s: BackendState, info: RequestInfo) -> float:
    """Count the dispatch; returns the prefill-work sample it learned from."""
    s.in_flight += 1
    new_tokens = prefill_tokens(info)
    work = float(s.outstanding_prefill_tokens + new_tokens)
    s.ewma_prefill_work_tokens = ewma(s.ewma_prefill_work_tokens, work)
    s.outstanding_prefill_tokens += new_tokens
    s.outstanding_decode_tokens += info.predicted_output_tokens
    return work


def note_first_token(s: BackendState, info: RequestInfo, ttft_ms: float) -> None:
    s.outstanding_prefill_tokens = max(0, s.outstanding_prefill_tokens - prefill_tokens(info))
    s.ewma_ttft_ms = ewma(s.ewma_ttft_ms, ttft_ms)
    s.num_ttft_samples += 1


def note_complete(
    s: BackendState, info: RequestInfo, outcome: Outcome, *, had_first_token: bool
) -> None:
    s.in_flight = max(0, s.in_flight - 1)
    if not had_first_token:
        s.outstanding_prefill_tokens = max(0, s.outstanding_prefill_tokens - prefill_tokens(info))
    s.outstanding_decode_tokens = max(0, s.outstanding_decode_tokens - info.predicted_output_tokens)
    if outcome.tpot_ms is not None:
        s.ewma_tpot_ms = ewma(s.ewma_tpot_ms, outcome.tpot_ms)
    s.consecutive_errors = 0 if outcome.ok else s.consecutive_errors + 1


def note_sample(s: BackendState, kind: int, value: float) -> None:
    """Learn from a sample another router took (``SAMPLE_*`` ``kind``), as if taken here."""
    if kind == SAMPLE_PREFILL_WORK:
        s.ewma_prefill_work_tokens = ewma(s.ewma_prefill_work_tokens, value)
    elif kind == SAMPLE_TTFT:
        s.ewma_ttft_ms = ewma(s.ewma_ttft_ms, value)
        s.num_ttft_samples += 1
    elif kind == SAMPLE_TPOT:
        s.ewma_tpot_ms = ewma(s.ewma_tpot_ms, value)


def estimated_ttft_ms(s: BackendState, e2e_ms: float, output_tokens: int) -> float | None:
    """TTFT of a non-streamed success, which the gateway does not see.

    ``e2e_ms - (output_tokens - 1) * ewma_tpot_ms``: what is left of the end-to-end
    time once the tokens after the first are decoded at the backend's usual pace (the
    EWMA of its streamed requests, decoded in the same batches). ``None`` (no sample)
    while the TPOT is unknown (nothing streamed has finished there), and when the rest
    is not positive (this request decoded faster than the average: the split is
    unknown, and a wrong sample is worse than none).
    """
    tpot_ms = s.ewma_tpot_ms
    if tpot_ms is None or output_tokens < 1:
        return None
    ttft_ms = e2e_ms - (output_tokens - 1) * tpot_ms
    return ttft_ms if ttft_ms > 0.0 else None


def prefill_ms_per_token(s: BackendState) -> float | None:
    """Observed TTFT per token of queued prefill work; None until both EWMAs exist and
    the backend has ``MIN_TTFT_SAMPLES`` first tokens."""
    work = s.ewma_prefill_work_tokens
    if s.ewma_ttft_ms is None or work is None or work <= 0.0:
        return None
    if s.num_ttft_samples < MIN_TTFT_SAMPLES:
        return None
    return s.ewma_ttft_ms / work
