"""Owns the KV blocks: allocation, reference counts and the prefix cache.

The cache is a pool of fixed-size blocks; each sequence holds a block table (block ids in token
order). NOTE on prefix caching: a block that is full *and computed* gets a chained hash (its
tokens plus the previous block's hash), so a block id found by hash stands for the whole prefix
up to and including it. The token ids are kept on the block and compared on a hit, so a hash
collision can never hand out the wrong KV. Freed blocks keep their hash and stay findable until
the block is handed out again; the free list is LRU (freed blocks go to the back, allocation takes
from the front) and a sequence frees its blocks last-first, so shared prefixes stay cached
longest.

NOTE on salts: a sequence's chain starts from its salt (design §6: one tenant's cache is its
own), except for its `shared_blocks` leading blocks, which lie wholly inside a system prompt the
gateway declared shared: those chain from NO_HASH, as an unsalted prompt's do, so every tenant
finds them, and the salt joins the chain at the first block after them (`chain_parent`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Protocol

NO_HASH = -1


@dataclass(slots=True, eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int = NO_HASH
    token_ids: tuple[int, ...] = ()

    def reset(self) -> None:
        self.ref_count = 1
        self.hash = NO_HASH
        self.token_ids = ()


class BlockOwner(Protocol):
    """What the block manager needs from a sequence."""

    block_table: list[int]
    num_computed_tokens: int
    num_hashed_blocks: int
    cache_salt: int  # where its prefix-hash chain starts: sequences of other salts share no block
    shared_blocks: int  # leading blocks of a declared shared system prompt, hashed unsalted

    @property
    def prefix_cached(self) -> bool: ...  # False: neither takes nor leaves cached blocks

    @property
    def token_ids(self) -> Seq[int]: ...


def chain_hash(prefix_hash: int, token_ids: tuple[int, ...]) -> int:
    return hash((prefix_hash, token_ids))


def salt_hash(salt: str | None) -> int:
    """Where a request's prefix-hash chain starts (design §6: prefix caches are per tenant)."""
    return NO_HASH if salt is None else hash(("cache_salt", salt))


SHARED_PROMPT_START = hash(("shared_system_prompt",))


def chain_parent(seq: BlockOwner, index: int, previous: int) -> int:
    """The hash block `index` of `seq` chains on; `previous` is block `index - 1`'s hash.

    Without shared blocks the chain starts from the salt, as it always has. With them it starts
    from a constant of its own (not the unsalted chain of tenants that share their cache, which
    would tell an isolated tenant that one of them sent the prompt) and takes the salt in after
    the last shared block, so what follows a shared system prompt is as private as a whole
    prompt of the tenant's own.
    """
    if index == 0:
        return SHARED_PROMPT_START if seq.shared_blocks else seq.cache_salt
    if index == seq.shared_blocks and seq.cache_salt != NO_HASH:
        return hash(("cache_salt", previous, seq.cache_salt))
    return previous


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be at least 1")
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # NOTE: an ordered dict as the LRU free list: take the oldest, take a given one (a
        # prefix-cache hit on a freed block) and free, all O(1).
        self.free_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.prefix_hits = 0
        self.prefix_queries = 0

    # -- accounting -----------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    @property
    def num_used(self) -> int:
        return len(self.blocks) - len(self.free_ids)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- allocation -----------------------------------------------------------------------------

    def _take(self, block_id: int | None = None) -> int:
        """A free block (the least recently freed, or a specific one), no longer findable."""
        if block_id is None:
            block_id, _ = self.free_ids.popitem(last=False)
        else:
            del self.free_ids[block_id]
        block = self.blocks[block_id]
        if block.hash != NO_HASH and self.hash_to_block.get(block.hash) == block_id:
            del self.hash_to_block[block.hash]
        block.reset()
        return block_id

    def _cached_prefix(self, seq: BlockOwner) -> list[int]:
        """Block ids whose computed KV covers a prefix of `seq`'s tokens (never all of them),
        cached under its salt (its shared blocks under none)."""
        if not (self.prefix_caching and seq.prefix_cached):
            return []
        token_ids = seq.token_ids
        hits: list[int] = []
        prefix_hash = NO_HASH
        # NOTE: at least one token must be computed to get logits, so the last block that would
        # cover the final token is never taken from the cache.
        full_blocks = (len(token_ids) - 1) // self.block_size
        for i in range(full_blocks):
            tokens = tuple(token_ids[i * self.block_size : (i + 1) * self.block_size])
            prefix_hash = chain_hash(chain_parent(seq, i, prefix_hash), tokens)
            block_id = self.hash_to_block.get(prefix_hash)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hits.append(block_id)
        return hits

    def can_allocate(self, seq: BlockOwner) -> bool:
        """Whether `seq` (not yet holding blocks) fits: its tokens, less cached blocks."""
        hits = self._cached_prefix(seq)
        reused_free = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        needed = self.blocks_for(len(seq.token_ids)) - len(hits) + reused_free
        return needed <= self.num_free

    def allocate(self, seq: BlockOwner) -> None:
        """Give `seq` blocks for all its tokens, reusing cached prefix blocks."""
        assert not seq.block_table, "sequence already holds blocks"
        hits = self._cached_prefix(seq)
        self.prefix_queries += len(seq.token_ids)
        self.prefix_hits += len(hits) * self.block_size
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_ids[block_id]  # back from the free list, hash kept
            block.ref_count += 1
        seq.block_table = hits + [
            self._take() for _ in range(self.blocks_for(len(seq.token_ids)) - len(hits))
        ]
        seq.num_computed_tokens = len(hits) * self.block_size
        seq.num_hashed_blocks = len(hits)

    def can_grow(self, seq: BlockOwner, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) - len(seq.block_table) <= self.num_free

    def grow(self, seq: BlockOwner, num_tokens: int) -> None:
        """Make `seq`'s block table cover `num_tokens` tokens."""
        while len(seq.block_table) < self.blocks_for(num_tokens):
            seq.block_table.append(self._take())

    def fork(self, parent: BlockOwner, child: BlockOwner) -> int | None:
        """Share `parent`'s full blocks with `child`; returns the parent's partial last block, for
        which the child got a fresh block (its id is the child's last entry) that the caller must
        fill with a copy of the KV. None when every block is shared."""
        full = parent.num_computed_tokens // self.block_size
        shared = parent.block_table[:full]
        for block_id in shared:
            self.blocks[block_id].ref_count += 1
        child.block_table = list(shared)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_hashed_blocks = min(parent.num_hashed_blocks, full)
        if full == len(parent.block_table):
            return None
        child.block_table.append(self._take())
        return parent.block_table[full]

    def can_fork(self, parent: BlockOwner) -> bool:
        full = parent.num_computed_tokens // self.block_size
        return len(parent.block_table) - full <= self.num_free

    def free(self, seq: BlockOwner) -> None:
        """Release `seq`'s blocks, last first; cached ones stay findable until reused."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                self.free_ids[block_id] = None
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_hashed_blocks = 0

    def register_computed(self, seq: BlockOwner) -> None:
        """Make `seq`'s newly full, computed blocks findable by their prefix hash."""
        if not (self.prefix_caching and seq.prefix_cached):
            return
        full = min(seq.num_computed_tokens, len(seq.token_ids)) // self.block_size
        tokens = seq.token_ids
        prefix_hash = (
            self.blocks[seq.block_table[seq.num_hashed_blocks - 1]].hash
            if seq.num_hashed_blocks
            else NO_HASH
        )
        for i in range(seq.num_hashed_blocks, full):
            block = self.blocks[seq.block_table[i]]
            block_tokens = tuple(tokens[i * self.block_size : (i + 1) * self.block_size])
            prefix_hash = chain_hash(chain_parent(seq, i, prefix_hash), block_tokens)
            block.hash = prefix_hash
            block.token_ids = block_tokens
            self.hash_to_block.setdefault(prefix_hash, block.block_id)
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, full)
