"""``SimSequence``: the engine's ``Sequence`` with a faster chained block hash.

The engine hashes every full block with crc32 + adler32 over packed bytes
(``chain_block_hash``, ~7 us a block in CPython), so a 1,000-token prompt costs ~0.4
ms before it is even scheduled: most of a simulated request's budget. Block hashes are
opaque to the scheduler and block manager (only equality matters: equal chained
hashes mean equal prefixes), so the simulator chains Python's tuple hash instead,
which is deterministic for ints (``PYTHONHASHSEED`` only salts str and bytes) and
~10x faster. Everything else (scheduling, allocation, caching, eviction) is the
engine's unchanged code. Hash values differ from the twin's; the gateway's prefix
hashes in the simulator are taken from the same ``SimSequence``, so routing sees a
consistent equality structure.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiloserve.engine.sequence import Sequence

__all__ = ["SimSequence"]


@dataclass(slots=True, eq=False)
class SimSequence(Sequence):
    """A ``Sequence`` whose block hashes chain ``hash((prev, block_tokens_tuple))``."""

    def _hash_new_blocks(self) -> None:
        size = self.block_size
        if self.num_tokens < (len(self.block_hashes) + 1) * size:
            return  # no new full block (most calls, from fused decode runs)
        prompt, output = self.prompt_token_ids, self.output_token_ids
        num_prompt = len(prompt)
        hashes = self.block_hashes
        prev = hashes[-1] if hashes else 0
        begin = len(hashes) * size
        num_full_prompt = num_prompt - num_prompt % size
        if begin < num_full_prompt:  # whole prompt blocks: tuples built in C
            for block in zip(*[iter(prompt[begin:num_full_prompt])] * size, strict=False):
                prev = hash((prev, block))
                hashes.append(prev)
            begin = num_full_prompt
        last = self.num_tokens - size
        while begin <= last:
            end = begin + size
            if begin >= num_prompt:
                block = tuple(output[begin - num_prompt : end - num_prompt])
            else:
                block = (*prompt[begin:], *output[: end - num_prompt])
            prev = hash((prev, block))
            hashes.append(prev)
            begin = end
