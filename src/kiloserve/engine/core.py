"""EngineCore: the scheduler plus a step-time model, stepped by its caller.

The engine twin calls ``step()`` in real time; the simulator calls
``max_fast_forward_steps()`` and ``advance(k)`` to jump over runs of identical
decode steps. ``advance(k)`` leaves exactly the state ``k`` calls of ``step()``
would, and its duration is the timer's ``decode_steps_time_s`` for the batch.

Timing contract (``StepTimer``): a prefill entry is ``(num_new_tokens,
num_computed_tokens)`` (T new tokens over P already in the KV cache); a decode
context is the number of tokens the decoded token attends to, including itself
(``num_computed_tokens + 1``). ``decode_steps_time_s(len(contexts), sum(contexts), k)``
must equal the sum of ``step_time_s([], [c + j for c in contexts])`` for ``j`` in
``0..k-1`` (a decode run's time depends on the batch only through its size and its
total context, so a fused run is timed in O(1)).

KV tiers: a step that admits a sequence with KV-tier hits lasts the timer's time plus
the loads' (``StepResult.load_s``). A fused run admits nothing, so it never loads and
its timing is unchanged (the blocks it evicts are offloaded in single-step order).
Held blocks (``hold_on_finish``) count as used until ``release``.
"""

from __future__ import annotations

import collections.abc as cabc
from typing import Protocol

from kiloserve.engine.config import EngineConfig
from kiloserve.engine.scheduler import ScheduledBatch, Scheduler
from kiloserve.engine.sequence import Sequence
from kiloserve.errors import KiloserveError, RequestError

__all__ = ["EngineCore", "StepResult", "StepTimer"]


class StepTimer(Protocol):
    """Modelled GPU time of engine steps (see the module docstring for the contract)."""

    def step_time_s(
        self, prefill: cabc.Sequence[tuple[int, int]], decode_contexts: cabc.Sequence[int]
    ) -> float: ...

    def decode_steps_time_s(self, num_seqs: int, context_tokens: int, num_steps: int) -> float: ...


class StepResult:
    """What one step (or ``num_steps`` fused decode steps) did.

    ``started``: the sequences this step scheduled for the first time (their queue
    time, vLLM's ``vllm:request_queue_time_seconds``, ends when the step starts).
    ``load_s``: seconds of ``duration_s`` spent loading KV-tier blocks back to the GPU
    (0 without tiers, and always 0 for fused decode steps).
    A plain class, not a dataclass: the compiled build (mypyc) runs a dataclass's
    generated ``__init__`` as interpreted code, and one of these is made per step.
    """

    __slots__ = (
        "duration_s",
        "finished",
        "load_s",
        "new_tokens",
        "num_decode_tokens",
        "num_preempted",
        "num_prefill_tokens",
        "num_steps",
        "started",
    )

    def __init__(
        self,
        duration_s: float,
        num_steps: int,
        new_tokens: dict[str, int] | None = None,
        finished: list[Sequence] | None = None,
        num_preempted: int = 0,
        num_prefill_tokens: int = 0,
        num_decode_tokens: int = 0,
        started: list[Sequence] | None = None,
        load_s: float = 0.0,
    ) -> None:
        self.duration_s = duration_s
        self.load_s = load_s
        self.num_steps = num_steps
        self.new_tokens: dict[str, int] = {} if new_tokens is None else new_tokens
        self.finished: list[Sequence] = [] if finished is None else finished
        self.num_preempted = num_preempted
        self.num_prefill_tokens = num_prefill_tokens
        self.num_decode_tokens = num_decode_tokens
        self.started: list[Sequence] = [] if started is None else started

    def _key(self) -> tuple[object, ...]:
        return (
            self.duration_s,
            self.num_steps,
            self.new_tokens,
            [id(seq) for seq in self.finished],
            self.num_preempted,
            self.num_prefill_tokens,
            self.num_decode_tokens,
            [id(seq) for seq in self.started],
            self.load_s,
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StepResult) and self._key() == other._key()

    __hash__ = None  # type: ignore[assignment]  # mutable, like the dataclass it replaced

    def __repr__(self) -> str:
        finished = [seq.seq_id for seq in self.finished]
        started = [seq.seq_id for seq in self.started]
        return (
            f"StepResult(duration_s={self.duration_s!r}, num_steps={self.num_steps}, "
            f"new_tokens={self.new_tokens!r}, finished={finished!r}, "
            f"num_preempted={self.num_preempted}, num_prefill_tokens="
            f"{self.num_prefill_tokens}, num_decode_tokens={self.num_decode_tokens}, "
            f"started={started!r}, load_s={self.load_s!r})"
        )


class EngineCore:
    """One modelled engine: add sequences, step it, read its stats."""

    def __init__(self, config: EngineConfig, timer: StepTimer) -> None:
        self.config = config
        self.timer = timer
        self.scheduler = Scheduler(config)
        self._seqs: dict[str, Sequence] = {}  # unfinished sequences by id
        self._max_fast_forward_steps: int | None = None  # cached until the state changes
        self._context_tokens: int | None = None  # sum of decode contexts, cached likewise

    def _invalidate(self) -> None:
        self._max_fast_forward_steps = None
        self._context_tokens = None

    def add(self, seq: Sequence) -> None:
        """Queue ``seq``; raises RequestError if it is invalid or could never fit."""
        self._check_request(seq)
        self._seqs[seq.seq_id] = seq
        self.scheduler.add(seq)
        self._invalidate()

    def _check_request(self, seq: Sequence) -> None:
        cfg = self.config
        if seq.seq_id in self._seqs:
            raise RequestError(f"duplicate request id {seq.seq_id!r}")
        if seq.block_size != cfg.block_size:
            raise RequestError(f"sequence block_size {seq.block_size} != engine {cfg.block_size}")
        if not seq.prompt_token_ids:
            raise RequestError("prompt must not be empty", param="prompt")
        if seq.max_tokens < 1:
            raise RequestError("max_tokens must be at least 1", param="max_tokens")
        if seq.num_output_tokens or seq.num_computed_tokens or seq.block_table:
            raise RequestError(f"sequence {seq.seq_id!r} was already run")
        num_transferred = seq.num_transferred_tokens
        if not 0 <= num_transferred < seq.num_prompt_tokens:
            raise RequestError(
                f"num_transferred_tokens must be in [0, {seq.num_prompt_tokens - 1}] (the "
                f"last prompt token is always computed), got {num_transferred}",
                param="kv_transfer_params",
            )
        num_tokens = seq.num_prompt_tokens + seq.max_tokens
        if num_tokens > cfg.max_model_len:
            raise RequestError(
                f"This model's maximum context length is {cfg.max_model_len} tokens; the "
                f"request asks for {num_tokens} ({seq.num_prompt_tokens} prompt + "
                f"{seq.max_tokens} output)",
                param="max_tokens",
                code="context_length_exceeded",
            )
        # The last output token is never fed back, so its KV slot is never needed.
        num_blocks = -(-(num_tokens - 1) // cfg.block_size)
        if num_blocks > cfg.num_usable_blocks:
            raise RequestError(
                f"request needs {num_blocks} KV blocks but the engine has {cfg.num_usable_blocks}",
                param="max_tokens",
            )

    def abort(self, seq_id: str) -> Sequence | None:
        """Stop an unfinished sequence now and free its blocks (finish_reason "abort")."""
        seq = self._seqs.pop(seq_id, None)
        if seq is not None:
            self.scheduler.abort(seq)
            self._invalidate()
        return seq

    def release(self, seq_id: str) -> bool:
        """Free the blocks a finished ``hold_on_finish`` sequence kept (False: none
        held under ``seq_id``, e.g. already released)."""
        if self.scheduler.release(seq_id) is None:
            return False
        self._invalidate()  # more free blocks: a waiting sequence may now fit
        return True

    def get_held(self, seq_id: str) -> Sequence | None:
        """A finished sequence whose blocks are held (its ``block_table`` is intact)."""
        return self.scheduler.held.get(seq_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_seq(self, seq_id: str) -> Sequence | None:
        """An unfinished sequence by id (finished ones are handed out by ``step``)."""
        return self._seqs.get(seq_id)

    def step(self) -> StepResult:
        """Run one scheduler step; an idle engine returns a zero-length result."""
        self._invalidate()
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return StepResult(duration_s=0.0, num_steps=0, num_preempted=batch.num_preempted)
        prefill, decode_contexts = _split_batch(batch)
        duration_s = self.timer.step_time_s(prefill, decode_contexts)
        if batch.load_s:
            duration_s += batch.load_s
        new_tokens = {
            seq.seq_id: 1
            for seq, num_new in zip(batch.seqs, batch.num_new_tokens, strict=True)
            if seq.num_computed_tokens + num_new == seq.num_tokens
        }
        finished = self.scheduler.postprocess(batch)
        self._forget(finished)
        return StepResult(
            duration_s=duration_s,
            num_steps=1,
            new_tokens=new_tokens,
            finished=finished,
            num_preempted=batch.num_preempted,
            num_prefill_tokens=sum(num_new for num_new, _ in prefill),
            num_decode_tokens=len(decode_contexts),
            started=batch.started,
            load_s=batch.load_s,
        )

    def max_fast_forward_steps(self) -> int:
        """Steps that can be fused by ``advance`` (0: call ``step`` instead)."""
        if self._max_fast_forward_steps is None:
            self._max_fast_forward_steps = self.scheduler.max_decode_steps()
        return self._max_fast_forward_steps

    def fast_forward_steps_within(self, max_duration_s: float) -> int:
        """Most fusable steps whose total modelled time is at most ``max_duration_s``.

        Lets a simulator stop a fast-forward before its next event. Steps only grow
        (contexts grow), so the first ``m`` steps average at most the whole run's mean
        step: ``max_duration_s`` over that mean is a lower bound, usually the answer
        (one more evaluation confirms it); otherwise a binary search closes the gap.
        """
        max_steps = self.max_fast_forward_steps()
        if max_steps == 0:
            return 0
        total_s = self.fast_forward_time_s(max_steps)
        if total_s <= max_duration_s:
            return max_steps
        estimate = max_duration_s * max_steps / total_s
        low = int(estimate)
        if estimate - low < 1e-9:  # at an integer: float rounding may have pushed it up
            low -= 1
        low = min(max_steps - 1, max(0, low))
        high = max_steps - 1  # invariant: T(low) <= max_duration_s < T(high + 1)
        while low < high:
            if self.fast_forward_time_s(low + 1) > max_duration_s:
                return low
            low += 1
            mid = (low + high + 1) // 2  # then halve what is left
            if self.fast_forward_time_s(mid) <= max_duration_s:
                low = mid
            else:
                high = mid - 1
        return low

    def fast_forward_time_s(self, num_steps: int) -> float:
        """Modelled time of the next ``num_steps`` fused decode steps (changes nothing)."""
        if self._context_tokens is None:
            running = self.scheduler.running
            self._context_tokens = sum(seq.num_computed_tokens for seq in running) + len(running)
        num_seqs = len(self.scheduler.running)
        return self.timer.decode_steps_time_s(num_seqs, self._context_tokens, num_steps)

    def advance(self, num_steps: int) -> StepResult:
        """Run ``num_steps`` pure decode steps at once; same state and time as single steps."""
        max_steps = self.max_fast_forward_steps()
        if not 1 <= num_steps <= max_steps:
            raise KiloserveError(f"cannot fuse {num_steps} steps now (at most {max_steps})")
        running = self.scheduler.running
        new_tokens = dict.fromkeys([seq.seq_id for seq in running], num_steps)
        duration_s = self.fast_forward_time_s(num_steps)
        self._invalidate()
        finished = self.scheduler.advance_decodes(num_steps)
        self._forget(finished)
        return StepResult(
            duration_s=duration_s,
            num_steps=num_steps,
            new_tokens=new_tokens,
            finished=finished,
            num_decode_tokens=num_steps * len(running),
        )

    def _forget(self, finished: list[Sequence]) -> None:
        for seq in finished:
            del self._seqs[seq.seq_id]

    # --- stats for /metrics -------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def kv_usage(self) -> float:
        return self.scheduler.block_manager.kv_usage

    @property
    def num_preemptions_total(self) -> int:
        return self.scheduler.num_preemptions_total

    @property
    def prefix_cache_queries_tokens(self) -> int:
        return self.scheduler.block_manager.prefix_cache_queries_tokens

    @property
    def prefix_cache_hits_tokens(self) -> int:
        return self.scheduler.block_manager.prefix_cache_hits_tokens

    @property
    def num_blocks(self) -> int:
        return self.config.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.scheduler.block_manager.num_free_blocks

    # --- KV tiers (all 0 without tiers) --------------------------------------------
    @property
    def kv_tier_queries_tokens(self) -> int:
        """Tokens of admitted sequences whose prefix was looked up in the tiers."""
        tiers = self.scheduler.block_manager.tiers
        return 0 if tiers is None else tiers.num_queries_tokens

    @property
    def kv_cpu_hit_tokens(self) -> int:
        """Tokens loaded back from the CPU tier."""
        tiers = self.scheduler.block_manager.tiers
        return 0 if tiers is None else tiers.num_cpu_hit_tokens

    @property
    def kv_remote_hit_tokens(self) -> int:
        """Tokens loaded back from the remote tier."""
        tiers = self.scheduler.block_manager.tiers
        return 0 if tiers is None else tiers.num_remote_hit_tokens

    @property
    def kv_cpu_offloaded_blocks(self) -> int:
        """Blocks offloaded into the CPU tier (evicted from the GPU)."""
        tiers = self.scheduler.block_manager.tiers
        return 0 if tiers is None else tiers.num_cpu_offloaded_blocks

    @property
    def kv_remote_offloaded_blocks(self) -> int:
        """Blocks offloaded into the remote tier (from the CPU tier, or the GPU)."""
        tiers = self.scheduler.block_manager.tiers
        return 0 if tiers is None else tiers.num_remote_offloaded_blocks

    @property
    def kv_loaded_bytes(self) -> int:
        """KV bytes (per GPU) loaded back from the tiers."""
        tiers = self.scheduler.block_manager.tiers
        return 0 if tiers is None else tiers.loaded_bytes

    @property
    def kv_load_s_total(self) -> float:
        """Seconds of step time spent loading from the tiers."""
        tiers = self.scheduler.block_manager.tiers
        return 0.0 if tiers is None else tiers.load_s_total

    @property
    def kv_cpu_blocks_used(self) -> int:
        """Blocks in the CPU tier now (of ``config.kv_cpu_blocks``)."""
        tiers = self.scheduler.block_manager.tiers
        return 0 if tiers is None else tiers.num_cpu_blocks

    @property
    def kv_remote_blocks_used(self) -> int:
        """Blocks in the remote tier now (of ``config.kv_remote_blocks``)."""
        tiers = self.scheduler.block_manager.tiers
        return 0 if tiers is None else tiers.num_remote_blocks

    @property
    def num_held_blocks(self) -> int:
        """Blocks kept by finished ``hold_on_finish`` sequences until ``release``."""
        return self.scheduler.num_held_blocks

    @property
    def num_held_seqs(self) -> int:
        """Finished sequences whose blocks are held."""
        return len(self.scheduler.held)


def _split_batch(batch: ScheduledBatch) -> tuple[list[tuple[int, int]], list[int]]:
    """Prefill entries ``(new, computed)`` and decode contexts, before postprocess."""
    prefill: list[tuple[int, int]] = []
    decode_contexts: list[int] = []
    for seq, num_new in zip(batch.seqs, batch.num_new_tokens, strict=True):
        if num_new == 1 and seq.is_decoding:
            decode_contexts.append(seq.num_computed_tokens + 1)
        else:
            prefill.append((num_new, seq.num_computed_tokens))
    return prefill, decode_contexts
