"""KV-cache tiers behind the GPU prefix cache: host memory (CPU) and a remote store.

A tier holds block hashes, not blocks: the KV of a full, hashed block that left the
GPU. The block manager hands every hashed block it evicts to ``offload`` (least
recently used first); the CPU tier keeps the newest ``cpu_capacity_blocks`` and passes
its own evictions to the remote tier, which keeps the newest ``remote_capacity_blocks``
and drops the rest (no CPU tier: GPU evictions go straight to remote). A block lives
in one tier at a time: loading it back to the GPU takes it out, and offloading it to
the CPU tier takes it out of the remote one.

A waiting sequence's prefix lookup continues past its GPU hits, block by block, in
the CPU tier then the remote tier (``lookup``), stopping at the first block in
neither. Admitting it ``load``s those blocks: they count as computed and cost
``blocks x bytes_per_block / bandwidth`` seconds per tier, which the engine adds to
the step that schedules the sequence (``StepResult.load_s``).

Counters (all monotonic): tokens looked up and tokens hit per tier, blocks offloaded
into each tier, bytes loaded back and the seconds that took.

A plain class, like the block manager that calls it, so the simulator's compiled
build can compile it too.
"""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["KvTiers"]


class KvTiers:
    """The CPU and remote tiers of one engine (LRU block-hash stores)."""

    __slots__ = (
        "block_size",
        "bytes_per_block",
        "cpu",
        "cpu_bandwidth_bps",
        "cpu_capacity_blocks",
        "load_s_total",
        "loaded_bytes",
        "num_cpu_hit_tokens",
        "num_cpu_offloaded_blocks",
        "num_queries_tokens",
        "num_remote_hit_tokens",
        "num_remote_offloaded_blocks",
        "remote",
        "remote_bandwidth_bps",
        "remote_capacity_blocks",
    )

    def __init__(
        self,
        cpu_capacity_blocks: int,
        remote_capacity_blocks: int,
        bytes_per_block: int,
        block_size: int,
        cpu_bandwidth_bps: float,
        remote_bandwidth_bps: float,
    ) -> None:
        self.cpu_capacity_blocks = cpu_capacity_blocks
        self.remote_capacity_blocks = remote_capacity_blocks
        self.bytes_per_block = bytes_per_block
        self.block_size = block_size
        self.cpu_bandwidth_bps = cpu_bandwidth_bps
        self.remote_bandwidth_bps = remote_bandwidth_bps
        self.cpu: OrderedDict[int, None] = OrderedDict()  # least recently offloaded first
        self.remote: OrderedDict[int, None] = OrderedDict()
        self.num_queries_tokens = 0
        self.num_cpu_hit_tokens = 0
        self.num_remote_hit_tokens = 0
        self.num_cpu_offloaded_blocks = 0
        self.num_remote_offloaded_blocks = 0
        self.loaded_bytes = 0
        self.load_s_total = 0.0

    @property
    def num_cpu_blocks(self) -> int:
        """Blocks in the CPU tier now."""
        return len(self.cpu)

    @property
    def num_remote_blocks(self) -> int:
        """Blocks in the remote tier now."""
        return len(self.remote)

    def offload(self, block_hashes: list[int]) -> None:
        """Take blocks evicted from the GPU, least recently used first."""
        for block_hash in block_hashes:
            self._put_cpu(block_hash)

    def _put_cpu(self, block_hash: int) -> None:
        if self.cpu_capacity_blocks == 0:
            self._put_remote(block_hash)
            return
        cpu = self.cpu
        if block_hash in cpu:
            cpu.move_to_end(block_hash)
            return
        self.remote.pop(block_hash, None)
        cpu[block_hash] = None
        self.num_cpu_offloaded_blocks += 1
        if len(cpu) > self.cpu_capacity_blocks:
            self._put_remote(cpu.popitem(last=False)[0])

    def _put_remote(self, block_hash: int) -> None:
        if self.remote_capacity_blocks == 0:
            return  # dropped
        remote = self.remote
        if block_hash in remote:
            remote.move_to_end(block_hash)
            return
        remote[block_hash] = None
        self.num_remote_offloaded_blocks += 1
        if len(remote) > self.remote_capacity_blocks:
            remote.popitem(last=False)

    def lookup(self, block_hashes: list[int], begin: int, end: int) -> tuple[int, int]:
        """(CPU blocks, remote blocks) among the leading run of ``block_hashes[begin:end]``
        found in a tier (changes nothing)."""
        cpu, remote = self.cpu, self.remote
        num_cpu = num_remote = 0
        for block_hash in block_hashes[begin:end]:
            if block_hash in cpu:
                num_cpu += 1
            elif block_hash in remote:
                num_remote += 1
            else:
                break
        return num_cpu, num_remote

    def load(self, block_hashes: list[int], begin: int, num_blocks: int) -> float:
        """Take ``block_hashes[begin : begin + num_blocks]`` (a run ``lookup`` found) out
        of the tiers, count them; returns the seconds the loads take."""
        cpu, remote = self.cpu, self.remote
        num_cpu = 0
        for block_hash in block_hashes[begin : begin + num_blocks]:
            if block_hash in cpu:
                del cpu[block_hash]
                num_cpu += 1
            else:
                del remote[block_hash]
        num_remote = num_blocks - num_cpu
        self.num_cpu_hit_tokens += num_cpu * self.block_size
        self.num_remote_hit_tokens += num_remote * self.block_size
        self.loaded_bytes += num_blocks * self.bytes_per_block
        load_s = 0.0
        if num_cpu:
            load_s += num_cpu * self.bytes_per_block / self.cpu_bandwidth_bps
        if num_remote:
            load_s += num_remote * self.bytes_per_block / self.remote_bandwidth_bps
        self.load_s_total += load_s
        return load_s

    def clear(self) -> None:
        """Drop every tiered block (counters stay)."""
        self.cpu.clear()
        self.remote.clear()
