"""Block manager: exact block ids, reference counts, prefix-cache hits and LRU free order."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from workers.block_manager import NO_HASH, BlockManager, chain_hash, salt_hash


@dataclass(eq=False)
class Seq:
    tokens: list[int]
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_hashed_blocks: int = 0
    cache_salt: int = NO_HASH
    shared_blocks: int = 0
    prefix_cached: bool = True

    @property
    def token_ids(self) -> list[int]:
        return self.tokens


def computed(bm: BlockManager, seq: Seq) -> Seq:
    """Allocate `seq` and pretend the model computed every token of it."""
    bm.allocate(seq)
    seq.num_computed_tokens = len(seq.tokens)
    bm.register_computed(seq)
    return seq


def test_allocation_takes_blocks_in_order_and_free_returns_them_last_first():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = Seq(list(range(10)))  # 3 blocks
    bm.allocate(a)
    assert a.block_table == [0, 1, 2]
    assert [bm.blocks[i].ref_count for i in range(4)] == [1, 1, 1, 0]
    assert (bm.num_used, bm.num_free) == (3, 5)
    bm.free(a)
    assert list(bm.free_ids) == [3, 4, 5, 6, 7, 2, 1, 0]
    assert a.block_table == [] and bm.num_used == 0


def test_a_repeated_prompt_reuses_computed_full_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = computed(bm, Seq(list(range(10))))
    assert [bm.blocks[i].hash != NO_HASH for i in a.block_table] == [True, True, False]
    b = Seq([*range(10), 99])
    assert bm.can_allocate(b)
    bm.allocate(b)
    assert b.block_table[:2] == [0, 1]  # shared
    assert b.block_table[2] == 3  # fresh: block 2 is a's partial block
    assert b.num_computed_tokens == 8
    assert [bm.blocks[i].ref_count for i in (0, 1, 2, 3)] == [2, 2, 1, 1]
    assert (bm.prefix_hits, bm.prefix_queries) == (8, 10 + 11)


def test_prompts_of_other_salts_share_no_block_and_the_same_salt_shares_them():
    bm = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(9))
    acme = salt_hash("tenant-acme")
    computed(bm, Seq(prompt, cache_salt=acme))
    other = Seq(prompt, cache_salt=salt_hash("tenant-globex"))
    bm.allocate(other)
    unsalted = Seq(prompt)
    bm.allocate(unsalted)
    same = Seq(prompt, cache_salt=acme)
    bm.allocate(same)
    assert (other.num_computed_tokens, unsalted.num_computed_tokens) == (0, 0)
    assert same.num_computed_tokens == 8  # its tenant's two full blocks
    assert bm.prefix_hits == 8


# a declared shared system prompt of two whole blocks (size 4), then each tenant's own tokens
SHARED = [50, 51, 52, 53, 54, 55, 56, 57]
ACME, GLOBEX = salt_hash("tenant-acme"), salt_hash("tenant-globex")


def test_shared_blocks_hit_under_every_salt_and_the_block_after_them_does_not():
    bm = BlockManager(num_blocks=16, block_size=4)
    prompt = [*SHARED, 1, 2, 3, 4, 5]  # blocks: shared, shared, acme's own, partial
    acme = computed(bm, Seq(prompt, cache_salt=ACME, shared_blocks=2))
    globex = Seq(prompt, cache_salt=GLOBEX, shared_blocks=2)  # even the very same prompt
    bm.allocate(globex)
    assert globex.block_table[:2] == acme.block_table[:2] == [0, 1]
    assert globex.num_computed_tokens == 8  # the shared blocks, not acme's third
    assert globex.block_table[2] not in acme.block_table
    again = Seq(prompt, cache_salt=ACME, shared_blocks=2)
    bm.allocate(again)
    assert again.block_table[:3] == [0, 1, 2]  # its own third block too
    assert again.num_computed_tokens == 12
    assert bm.prefix_hits == 8 + 12


def test_a_prompt_not_declared_shared_gets_no_public_hash_and_finds_none():
    bm = BlockManager(num_blocks=16, block_size=4)
    prompt = [*SHARED, 1, 2, 3, 4, 5]
    computed(bm, Seq(prompt, cache_salt=ACME))  # the same tokens, not declared shared
    declared = Seq(prompt, cache_salt=GLOBEX, shared_blocks=2)
    bm.allocate(declared)
    assert declared.num_computed_tokens == 0
    bm.free(declared)
    computed(bm, Seq(prompt, cache_salt=ACME, shared_blocks=2))  # now declared, by acme
    undeclared = Seq(prompt, cache_salt=GLOBEX)
    bm.allocate(undeclared)
    assert undeclared.num_computed_tokens == 0


def test_without_shared_blocks_the_hashes_are_what_they_always_were():
    bm = BlockManager(num_blocks=16, block_size=4)
    prompt = [*SHARED, 1, 2, 3, 4, 5]
    salted = computed(bm, Seq(prompt, cache_salt=ACME))
    first = chain_hash(ACME, tuple(SHARED[:4]))
    second = chain_hash(first, tuple(SHARED[4:]))
    third = chain_hash(second, (1, 2, 3, 4))
    assert [bm.blocks[i].hash for i in salted.block_table] == [first, second, third, NO_HASH]
    # unsalted (tenants that share their cache): a declared prompt's chain is apart from theirs,
    # so an isolated tenant cannot learn from it that one of them sent the prompt
    plain = computed(bm, Seq(prompt))
    declared = Seq(prompt, shared_blocks=2)
    bm.allocate(declared)
    assert declared.num_computed_tokens == 0  # nothing of the unsalted chain is taken
    declared.num_computed_tokens = len(prompt)
    bm.register_computed(declared)
    again = Seq(prompt, shared_blocks=2)
    bm.allocate(again)  # another sharing tenant's declared prompt: all three whole blocks
    assert again.block_table[:3] == declared.block_table[:3] != plain.block_table[:3]
    assert again.num_computed_tokens == 12


def test_hashing_in_chunks_across_the_shared_boundary_agrees_with_the_lookup():
    bm = BlockManager(num_blocks=16, block_size=4)
    prompt = [*SHARED, 1, 2, 3, 4, 5]
    seq = Seq(prompt, cache_salt=ACME, shared_blocks=2)
    bm.allocate(seq)
    for done in (6, 8, 10, 13):  # a chunked prefill, then the rest
        seq.num_computed_tokens = done
        bm.register_computed(seq)
    bm.free(seq)  # as a preemption does; it finds its blocks again when it comes back
    bm.allocate(seq)
    assert seq.block_table[:3] == [0, 1, 2]
    assert seq.num_computed_tokens == 12


def test_the_last_token_is_always_computed_even_when_every_block_is_cached():
    bm = BlockManager(num_blocks=8, block_size=4)
    computed(bm, Seq(list(range(8))))  # exactly two full blocks
    b = Seq(list(range(8)))
    bm.allocate(b)
    assert b.num_computed_tokens == 4  # the second block is recomputed for the logits
    assert b.block_table[0] == 0 and b.block_table[1] != 1


def test_freed_cached_blocks_are_found_again_until_reused_lru():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = computed(bm, Seq([1, 2, 3, 4, 5]))  # blocks 0,1 full, 2 partial
    bm.free(a)
    assert list(bm.free_ids) == [3, 2, 1, 0]
    b = Seq([1, 2, 3, 4, 9])
    bm.allocate(b)  # hits 0 and 1 while they sit on the free list
    assert b.block_table == [0, 1, 3]
    assert list(bm.free_ids) == [2]
    bm.free(b)
    c = Seq([7, 7, 7, 7, 7, 7, 7])  # 4 blocks: takes 2 first, then evicts LRU 3, 1, 0
    bm.allocate(c)
    assert c.block_table == [2, 3, 1, 0]
    assert bm.hash_to_block == {}
    assert not bm.can_allocate(Seq([1, 2, 3]))


def test_hash_collision_is_caught_by_comparing_tokens(monkeypatch):
    monkeypatch.setattr("workers.block_manager.chain_hash", lambda prefix, tokens: 42)
    bm = BlockManager(num_blocks=8, block_size=2)
    computed(bm, Seq([1, 2, 3]))
    b = Seq([5, 6, 7])  # same (fake) hash, other tokens
    bm.allocate(b)
    assert b.num_computed_tokens == 0
    assert b.block_table == [2, 3]


def test_fork_shares_full_blocks_and_gives_the_child_its_own_tail():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = computed(bm, Seq(list(range(6))))
    child = Seq(list(range(6)))
    assert bm.can_fork(parent)
    partial = bm.fork(parent, child)
    assert partial == 1
    assert child.block_table == [0, 2]
    assert child.num_computed_tokens == 6
    assert [bm.blocks[i].ref_count for i in (0, 1, 2)] == [2, 1, 1]
    bm.free(parent)
    bm.free(child)
    assert bm.num_used == 0
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_grow_adds_blocks_only_at_block_boundaries():
    bm = BlockManager(num_blocks=4, block_size=4)
    seq = Seq([1, 2, 3, 4])
    bm.allocate(seq)
    bm.grow(seq, 4)
    assert seq.block_table == [0]
    assert bm.can_grow(seq, 5)
    bm.grow(seq, 5)
    assert seq.block_table == [0, 1]
    assert not bm.can_grow(seq, 17)


def test_double_free_is_caught():
    bm = BlockManager(num_blocks=2, block_size=2)
    a = Seq([1])
    bm.allocate(a)
    table = list(a.block_table)
    bm.free(a)
    a.block_table = table
    with pytest.raises(AssertionError):
        bm.free(a)
