"""``SimSequence``: the engine's ``Sequence`` with cheaper chained block hashes.

The engine hashes every full block with crc32 + adler32 over packed bytes
(``chain_block_hash``, ~7 us a block in CPython), so a 1,000-token prompt costs ~0.4
ms before it is even scheduled: most of a simulated request's budget. Block hashes are
opaque to the scheduler and block manager (only equality matters: equal chained
hashes mean equal prefixes), so the simulator uses two cheaper rules that keep that
meaning:

* shared text: chain Python's tuple hash, ``hash((prev, block_tokens_tuple))``, which
  is deterministic for ints (``PYTHONHASHSEED`` only salts str and bytes) and ~10x
  faster;
* runs of text named by a key (``run_keys``: a Mooncake prompt's 512-token hash-id
  runs, ``sim.prompts``): a run's full blocks hash to ``base + j`` (block ``j`` of
  the run), ``base = hash((prev, run key))`` with its low ``RUN_INDEX_BITS`` bits
  clear and ``prev`` the hash of the block before the run (0 for the first). Equal
  keys mean equal text, so two such blocks are equal exactly when their whole
  prefixes are, as with the tuple hash (a clash has probability ~2^-54 per pair of
  runs); a run costs one hash and one ``range`` instead of 32 tuples and hashes. The
  block after a run (a partial run's last tokens, then output or other text) chains
  the tuple hash from the run's last block hash;
* text known to be this request's own (``unique_key`` set: every prompt token from
  ``unique_from`` on, and so every later block, belongs to this prompt alone; the
  engine keeps such blocks out of its hash index and never reads their hashes, so
  ``block_hashes`` stops before them and only the gateway's prefix hashes,
  ``prefix_hashes()``, spell them out):
  block ``b`` of such a prefix hashes to ``unique_key + b``, where the key is a
  64-bit hash of the request's text name with its low ``UNIQUE_INDEX_BITS`` bits
  clear. Two blocks get equal hashes only for the same key and index, i.e. the same
  prompt (a retry, or the sequence itself after a preemption), whose prefixes are
  equal (a clash with a tuple hash has probability ~2^-40 per pair of blocks); no
  tokens are read and a prompt's hashes are one ``range``.

Everything else (scheduling, allocation, caching, eviction) is the engine's unchanged
code. Hash values differ from the twin's; the gateway's prefix hashes in the simulator
are taken from the same ``SimSequence``, so routing sees a consistent equality
structure.
"""

from __future__ import annotations

from kiloserve.engine.sequence import Sequence
from kiloserve.workload.prompts import BLOCK_TOKENS

__all__ = ["BLOCK_SIZE", "RUN_INDEX_BITS", "RUN_TOKENS", "UNIQUE_INDEX_BITS", "SimSequence"]

BLOCK_SIZE = 16  # the simulator's sequences' block size (its engines must match: core.py)

UNIQUE_INDEX_BITS = 24  # block indices below 2^24 (268 M tokens at 16 per block)
RUN_TOKENS = BLOCK_TOKENS  # a keyed run's length (a Mooncake hash id's 512 tokens)
RUN_INDEX_BITS = 10  # block indices within a run: below 2^10 (block sizes >= 1)
# Output ids depend only on their index (no planned ids in the simulator), so the
# tuple of an output block is built once per (first output index, block size).
MAX_OUTPUT_BLOCKS = 1 << 16
_OUTPUT_BLOCKS: dict[tuple[int, int], tuple[int, ...]] = {}


class SimSequence(Sequence):
    """A ``Sequence`` with tuple-hash chains, key hashes for keyed runs and index
    hashes for unique text."""

    __slots__ = ("run_keys", "run_tokens", "tail_private_block", "unique_from", "unique_key")

    def __init__(
        self,
        seq_id: str,
        prompt_token_ids: list[int],
        max_tokens: int,
        arrival_s: float = 0.0,
        *,
        block_size: int = BLOCK_SIZE,
        unique_key: int | None = None,
        unique_from: int = 0,
        run_keys: tuple[int, ...] = (),
        run_tokens: int = 0,
        private_from: int | None = None,
    ) -> None:
        self.unique_key = unique_key  # set: tokens from unique_from on are this prompt's own
        self.unique_from = unique_from
        # the first run_tokens prompt tokens: runs of RUN_TOKENS named by run_keys
        self.run_keys = run_keys if RUN_TOKENS % block_size == 0 else ()
        self.run_tokens = run_tokens
        private = None if unique_key is None else unique_from // block_size
        self.tail_private_block = private  # where the unique tail's blocks start
        if private_from is not None and self.run_keys and private_from % block_size == 0:
            # a keyed run only this prompt has: private from there (its hashes stay)
            own = private_from // block_size
            private = own if private is None else min(private, own)
        super().__init__(
            seq_id,
            prompt_token_ids,
            max_tokens,
            arrival_s,
            block_size=block_size,
            private_from_block=private,  # the engine keeps these blocks out of its index
        )

    def keep_runs_shared(self) -> None:
        """Treat the keyed runs only this prompt has as shared blocks after all (an
        engine with KV tiers: its evicted blocks go to the tiers, where a preempted
        sequence finds its own again; private blocks are never tiered), so only the
        unique tail stays private."""
        self.private_from_block = self.tail_private_block

    def append_output_token(self) -> None:
        if self.unique_key is None:
            Sequence.append_output_token(self)
        else:  # output blocks are private: nobody reads their hashes (block_manager.py)
            self.num_output_tokens += 1
            self.num_tokens += 1

    def append_output_tokens(self, num_tokens: int) -> None:
        if self.unique_key is None:
            Sequence.append_output_tokens(self, num_tokens)
        else:
            self.num_output_tokens += num_tokens
            self.num_tokens += num_tokens

    def _hash_new_blocks(self) -> None:
        size = self.block_size
        begin, end = len(self.block_hashes), self.num_tokens // size
        if end <= begin:
            return  # no new full block (most calls, from fused decode runs)
        if begin == 0 and self.run_keys:
            self._hash_runs()  # within the prompt and before its unique text
            begin = len(self.block_hashes)
            if end <= begin:
                return
        key = self.unique_key
        if key is None:
            self._hash_tokens(begin, end)
            return
        first_unique = self.unique_from // size  # the first block holding a unique token
        if begin < first_unique:
            self._hash_tokens(begin, min(end, first_unique))
        # Blocks from first_unique on would hash to key + index: nobody reads them from
        # here (the engine never looks private blocks up; see prefix_hashes), so they
        # are not stored and block_hashes stops at the shared blocks.

    def prefix_hashes(self, num_blocks: int) -> tuple[int, ...]:
        """The first ``num_blocks`` hashes of the prompt's full blocks, the private ones
        (``unique_key + index``) included: what the gateway's profile hashes."""
        shared = self.block_hashes[:num_blocks]
        key = self.unique_key
        if key is None or len(shared) >= num_blocks:
            return tuple(shared)
        size = self.block_size
        end = min(num_blocks, self.num_prompt_tokens // size)
        private = tuple(range(key + self.unique_from // size, key + end))  # built in C
        return tuple(shared) + private if shared else private

    def _hash_runs(self) -> None:
        """The keyed runs' full blocks: ``base + j`` per run (module docstring)."""
        size = self.block_size
        per_run = RUN_TOKENS // size
        hashes = self.block_hashes
        prev = 0
        left = min(self.run_tokens, self.num_prompt_tokens)
        for key in self.run_keys:
            num_blocks = min(per_run, left // size)
            if num_blocks <= 0:
                break
            base = hash((prev, key)) >> RUN_INDEX_BITS << RUN_INDEX_BITS
            hashes += range(base, base + num_blocks)
            prev = base + num_blocks - 1
            if num_blocks < per_run:
                break  # a partial run ends the keyed part
            left -= RUN_TOKENS

    def _hash_tokens(self, begin_block: int, end_block: int) -> None:
        """Chain the tuple hash over blocks ``begin_block .. end_block - 1``."""
        size = self.block_size
        prompt = self.prompt_token_ids
        num_prompt = len(prompt)
        hashes = self.block_hashes
        prev = hashes[-1] if hashes else 0
        begin, stop = begin_block * size, end_block * size
        num_full_prompt = min(stop, num_prompt - num_prompt % size)
        if begin < num_full_prompt:  # whole prompt blocks: tuples built in C
            for block in zip(*[iter(prompt[begin:num_full_prompt])] * size, strict=False):
                prev = hash((prev, block))
                hashes.append(prev)
            begin = num_full_prompt
        is_planned = self.planned_output_token_ids is not None
        while begin < stop:
            end = begin + size
            if begin >= num_prompt:
                start = begin - num_prompt
                cached = None if is_planned else _OUTPUT_BLOCKS.get((start, size))
                if cached is None:
                    cached = tuple(self._next_token_ids(start, start + size))
                    if not is_planned and len(_OUTPUT_BLOCKS) < MAX_OUTPUT_BLOCKS:
                        _OUTPUT_BLOCKS[start, size] = cached
                block = cached
            else:
                block = (*prompt[begin:], *self._next_token_ids(0, end - num_prompt))
            prev = hash((prev, block))
            hashes.append(prev)
            begin = end
