"""KVCacheBlock and FreeKVCacheBlockQueue: exact orders, and a list model under random ops."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from paged_jax.core.kv_cache_block import FreeKVCacheBlockQueue, KVCacheBlock


def make(n):
    blocks = [KVCacheBlock(i) for i in range(n)]
    return blocks, FreeKVCacheBlockQueue(blocks)


def order(q):
    return [b.block_id for b in q.get_all_free_blocks()]


def test_block_is_slotted_and_repr_shows_neighbour_ids_only():
    b = KVCacheBlock(3, ref_cnt=2, block_hash=b"\x01" * 32)
    assert not hasattr(b, "__dict__")
    with pytest.raises(AttributeError):
        b.color = "red"
    blocks, q = make(3)
    assert "prev_free_block=0, next_free_block=2" in repr(blocks[1])


def test_initial_order_and_popleft():
    blocks, q = make(5)
    assert order(q) == [0, 1, 2, 3, 4] and q.num_free_blocks == 5 == len(q)
    first = q.popleft()
    assert first is blocks[0]
    assert first.prev_free_block is None and first.next_free_block is None
    assert order(q) == [1, 2, 3, 4]
    assert [b.block_id for b in q.popleft_n(3)] == [1, 2, 3]
    assert order(q) == [4] and q.num_free_blocks == 1
    assert q.popleft_n(0) == []
    q.popleft()
    with pytest.raises(ValueError, match="no free blocks"):
        q.popleft()
    assert q.fake_free_list_head.next_free_block is q.fake_free_list_tail


def test_remove_from_head_middle_and_tail():
    blocks, q = make(5)
    q.remove(blocks[2])
    q.remove(blocks[0])
    q.remove(blocks[4])
    assert order(q) == [1, 3] and q.num_free_blocks == 2
    assert blocks[2].prev_free_block is None and blocks[2].next_free_block is None
    with pytest.raises(AssertionError, match="not in the free queue"):
        q.remove(blocks[2])


def test_append_append_n_prepend_n_keep_given_order():
    blocks, q = make(8)
    taken = q.popleft_n(6)  # queue [6, 7]
    q.append(taken[0])
    assert order(q) == [6, 7, 0]
    q.append_n([taken[3], taken[1]])
    assert order(q) == [6, 7, 0, 3, 1]
    q.prepend_n([taken[5], taken[2], taken[4]])
    assert order(q) == [5, 2, 4, 6, 7, 0, 3, 1]
    assert q.num_free_blocks == 8
    q.append_n([])
    q.prepend_n([])
    assert q.num_free_blocks == 8


def test_prepend_and_append_into_an_empty_queue():
    blocks, q = make(3)
    taken = q.popleft_n(3)
    q.prepend_n([taken[1]])
    assert order(q) == [1]
    q.popleft()
    q.append_n(taken[::-1])
    assert order(q) == [2, 1, 0]
    # The walk backwards from the tail must agree with the forward one.
    back, b = [], q.fake_free_list_tail.prev_free_block
    while b is not q.fake_free_list_head:
        back.append(b.block_id)
        b = b.prev_free_block
    assert back == [0, 1, 2]


OPS = st.lists(
    st.tuples(st.sampled_from(["popleft", "popleft_n", "remove", "append", "append_n", "prepend_n"]),
              st.integers(0, 1000)),
    max_size=60,
)


@given(n=st.integers(1, 12), ops=OPS)
def test_queue_matches_a_python_list(n, ops):
    """Every operation against a plain list doing the same thing in O(n)."""
    blocks, q = make(n)
    model = list(range(n))
    out = []  # blocks not in the queue
    for op, x in ops:
        if op == "popleft" and model:
            assert q.popleft().block_id == model.pop(0)
        elif op == "popleft_n":
            k = x % (len(model) + 1)
            got = [b.block_id for b in q.popleft_n(k)]
            assert got == model[:k]
            del model[:k]
        elif op == "remove" and model:
            victim = model.pop(x % len(model))
            q.remove(blocks[victim])
        elif op in ("append", "append_n", "prepend_n") and out:
            k = 1 if op == "append" else 1 + x % len(out)
            chosen = [out[(x + 7 * i) % len(out)] for i in range(k)]
            chosen = list(dict.fromkeys(chosen))
            if op == "append":
                q.append(blocks[chosen[0]])
                model.append(chosen[0])
            elif op == "append_n":
                q.append_n([blocks[i] for i in chosen])
                model.extend(chosen)
            else:
                q.prepend_n([blocks[i] for i in chosen])
                model[:0] = chosen
        out = sorted(set(range(n)) - set(model))
        assert order(q) == model
        assert q.num_free_blocks == len(model)
        for i in out:
            assert blocks[i].prev_free_block is None and blocks[i].next_free_block is None
