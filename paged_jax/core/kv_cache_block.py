"""KVCacheBlock and FreeKVCacheBlockQueue: block metadata and the eviction-ordered free list.

The free queue is an intrusive doubly linked list threaded through the blocks themselves
(prev_free_block / next_free_block) between two sentinel blocks. A prefix-cache hit takes a
block out of the middle of the queue, which a deque cannot do in O(1). Imports no jax.
"""

from __future__ import annotations

from collections.abc import Iterable


class KVCacheBlock:
    """Metadata of one physical block (its page of K/V lives on the device).

    Attributes:
      block_id: index of the page in every layer's K/V buffer.
      ref_cnt: number of live requests whose block table holds this block.
      block_hash: chain hash of the full block's tokens while it is in the prefix cache,
        else None. Kept when ref_cnt drops to 0 (the block stays hit-able in the free queue)
        and dropped when the block is popped for reuse (eviction).
      prev_free_block / next_free_block: links in the free queue; both None when not in it.
      is_null: True only for block 0, the padding target that is never allocated.
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free_block", "next_free_block", "is_null")

    def __init__(
        self,
        block_id: int,
        ref_cnt: int = 0,
        block_hash: bytes | None = None,
        prev_free_block: KVCacheBlock | None = None,
        next_free_block: KVCacheBlock | None = None,
        is_null: bool = False,
    ):
        self.block_id = block_id
        self.ref_cnt = ref_cnt
        self.block_hash = block_hash
        self.prev_free_block = prev_free_block
        self.next_free_block = next_free_block
        self.is_null = is_null

    def __repr__(self) -> str:
        # Print neighbour ids only: printing the neighbours themselves would walk the queue.
        prev_id = self.prev_free_block.block_id if self.prev_free_block else None
        next_id = self.next_free_block.block_id if self.next_free_block else None
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return (
            f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, block_hash={h}, "
            f"prev_free_block={prev_id}, next_free_block={next_id})"
        )


class FreeKVCacheBlockQueue:
    """Every free block (ref_cnt == 0) in eviction order: head is taken first.

    Initial order is the given one (ascending block id). Sentinels at both ends mean no
    operation special-cases an empty queue or an end block.
    """

    __slots__ = ("num_free_blocks", "fake_free_list_head", "fake_free_list_tail")

    def __init__(self, blocks: list[KVCacheBlock]):
        self.num_free_blocks = len(blocks)
        head = self.fake_free_list_head = KVCacheBlock(block_id=-1)
        tail = self.fake_free_list_tail = KVCacheBlock(block_id=-1)
        prev = head
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = tail
        tail.prev_free_block = prev

    def popleft(self) -> KVCacheBlock:
        """Take the head block (ValueError when the queue is empty)."""
        block = self.fake_free_list_head.next_free_block
        if block is self.fake_free_list_tail:
            assert self.num_free_blocks == 0, "free queue is empty but num_free_blocks says otherwise"
            raise ValueError("no free blocks available")
        nxt = block.next_free_block
        self.fake_free_list_head.next_free_block = nxt
        nxt.prev_free_block = self.fake_free_list_head
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Take the n head blocks, head first (the caller checked that n are free)."""
        if n <= 0:
            return []
        assert n <= self.num_free_blocks, f"popleft_n({n}) with only {self.num_free_blocks} free blocks"
        self.num_free_blocks -= n
        ret = []
        block = self.fake_free_list_head.next_free_block
        for _ in range(n):
            ret.append(block)
            nxt = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            block = nxt
        self.fake_free_list_head.next_free_block = block
        block.prev_free_block = self.fake_free_list_head
        return ret

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink a block from anywhere in the queue in O(1) (a prefix-cache hit)."""
        prev, nxt = block.prev_free_block, block.next_free_block
        assert prev is not None and nxt is not None, f"remove() of a block not in the free queue: {block}"
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put a block at the tail (evicted last)."""
        tail = self.fake_free_list_tail
        last = tail.prev_free_block
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = tail
        tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Put blocks at the tail in the given order (the last one is evicted last)."""
        tail = self.fake_free_list_tail
        self._splice(tail.prev_free_block, tail, blocks)

    def prepend_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Put blocks at the head in the given order (the first one is evicted first)."""
        head = self.fake_free_list_head
        self._splice(head, head.next_free_block, blocks)

    def _splice(self, before: KVCacheBlock, after: KVCacheBlock, blocks: Iterable[KVCacheBlock]) -> None:
        """Link blocks, in order, between the adjacent nodes before and after."""
        prev = before
        n = 0
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
            n += 1
        prev.next_free_block = after
        after.prev_free_block = prev
        self.num_free_blocks += n

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """The queue head to tail (O(n); for tests and invariant checks)."""
        ret = []
        block = self.fake_free_list_head.next_free_block
        tail = self.fake_free_list_tail
        while block is not tail:
            ret.append(block)
            block = block.next_free_block
        return ret

    def __len__(self) -> int:
        return self.num_free_blocks
