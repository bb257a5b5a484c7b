"""Paged KV-cache block accounting with prefix caching (vLLM's PagedAttention, SOSP 2023).

Blocks are fixed-size pages of the KV pool. A sequence owns a block table; full blocks are
content-hashed with a chained sha256 (parent hash, token ids, and a root key carrying the adapter
identity and the tenant's salt), so identical prefixes under the same adapter and tenant share blocks,
and nothing is shared across adapters or tenants. Free blocks keep their contents and hash until they
are reused (LRU), which is what makes a later prefix hit possible.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from base_engine.sequence import Sequence


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None


def prefix_root(seq: Sequence) -> bytes:
    """Root of the hash chain: adapter identity (id + content hash), the tenant's salt, whether the
    blocks were computed batch-invariant (a deterministic request reuses only such blocks) and with
    LongRoPE's long factors (other K/V for the same tokens)."""
    adapter = seq.adapter
    ident = "" if adapter is None else f"{adapter.id}\x00{adapter.sha256}"
    mode = b"\x02invariant" if seq.deterministic else b""
    rope = b"\x03long-rope" if seq.is_long_rope else b""
    return hashlib.sha256(ident.encode() + b"\x01" + seq.cache_salt + mode + rope).digest()


def chain_hash(parent: bytes, token_ids: list[int]) -> bytes:
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Blocks with ref_count 0, least recently freed first; contents stay valid until reused.
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[bytes, int] = {}
        # Blocks handed to a new owner since the last `take_fresh_blocks`: their previous contents (any
        # bits: another tenant's, NaN) must be cleared before a step reads past the owner's tokens.
        self.fresh_blocks: list[int] = []
        self.num_prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.num_prefix_hits = 0  # of those, tokens found

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by live sequences; cached blocks nobody holds count as free (as in vLLM)."""
        return len(self.blocks) - len(self.free)

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_blocks_needed(seq, num_new_tokens) <= len(self.free)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow seq's block table to hold num_computed_tokens + num_new_tokens (caller checked can_)."""
        for _ in range(self.num_blocks_needed(seq, num_new_tokens)):
            seq.block_table.append(self._take_free_block())

    def _take_free_block(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            # Reused for new content: its old prefix can no longer be found.
            if self.hash_to_block.get(block.block_hash) == block_id:
                del self.hash_to_block[block.block_hash]
            block.block_hash = None
        block.ref_count = 1
        self.fresh_blocks.append(block_id)
        return block_id

    def take_fresh_blocks(self) -> list[int]:
        fresh, self.fresh_blocks = self.fresh_blocks, []
        return fresh

    def match_prefix(self, seq: Sequence) -> int:
        """Attach cached blocks for seq's prompt prefix; returns the number of tokens found.

        Called once, when a sequence without computed tokens is admitted. At least one prompt token
        is always left to compute, so the step produces logits for it. A request that asks for prompt
        logprobs computes every position (base_engine/prompt_logprobs.py); its blocks are still published.
        """
        if not self.enable_prefix_caching or seq.block_table or seq.params.prompt_logprobs is not None:
            return 0
        num_full = (seq.num_tokens - 1) // self.block_size
        parent = prefix_root(seq)
        for i in range(num_full):
            block_hash = chain_hash(parent, seq.token_ids(i * self.block_size, (i + 1) * self.block_size))
            block_id = self.hash_to_block.get(block_hash)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
            seq.block_hashes.append(block_hash)
            parent = block_hash
        num_hit = len(seq.block_table) * self.block_size
        queries, hits = self._lookup_counts(seq)
        self.num_prefix_queries += queries
        self.num_prefix_hits += hits
        return num_hit

    def _lookup_counts(self, seq: Sequence) -> tuple[int, int]:
        """(prompt tokens looked up, of those found) for seq's attached prefix. A preempted request
        also matches its output tokens (recomputed like a prompt): those are not prompt tokens."""
        num_prompt = len(seq.prompt_token_ids)
        return num_prompt, min(len(seq.block_table) * self.block_size, num_prompt)

    def unmatch_prefix(self, seq: Sequence) -> None:
        """Give back what `match_prefix` attached to a request that could not start after all; the
        lookup is not counted twice when the request tries again."""
        if self.enable_prefix_caching:
            queries, hits = self._lookup_counts(seq)
            self.num_prefix_queries -= queries
            self.num_prefix_hits -= hits
        if seq.block_table:
            self.free_sequence(seq)

    def commit_full_blocks(self, seq: Sequence) -> None:
        """Hash the blocks that became full (by computed tokens) so later requests can reuse them."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        parent = seq.block_hashes[-1] if seq.block_hashes else prefix_root(seq)
        for i in range(len(seq.block_hashes), num_full):
            block_hash = chain_hash(parent, seq.token_ids(i * self.block_size, (i + 1) * self.block_size))
            block = self.blocks[seq.block_table[i]]
            if block.block_hash is None and block_hash not in self.hash_to_block:
                block.block_hash = block_hash
                self.hash_to_block[block_hash] = block.block_id
            seq.block_hashes.append(block_hash)
            parent = block_hash

    def free_sequence(self, seq: Sequence) -> None:
        """Release seq's blocks; the tail goes to the free list first so it is evicted first."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"double free of KV block {block_id} by request {seq.request_id}")
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is None:
                    # Uncached content is useless: hand it out before blocks that may give prefix hits.
                    self.free[block_id] = None
                    self.free.move_to_end(block_id, last=False)
                else:
                    self.free[block_id] = None
        seq.block_table.clear()
        seq.block_hashes.clear()

    def trim(self, seq: Sequence) -> None:
        """Release the blocks past seq's computed tokens (rejected speculative drafts' K/V): never
        hashed, held only by seq, so they go back first to the free list, unpublished."""
        keep = -(-seq.num_computed_tokens // self.block_size)
        while len(seq.block_table) > keep:
            block = self.blocks[seq.block_table.pop()]
            if block.ref_count != 1 or block.block_hash is not None:
                raise RuntimeError(
                    f"KV block {block.block_id} past request {seq.request_id}'s tokens is shared"
                )
            block.ref_count = 0
            self.free[block.block_id] = None
            self.free.move_to_end(block.block_id, last=False)
