"""Unit tests for the pure radix tree (simulated slot numbers, no model, no device)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from loom.radix.tree import MatchResult, RadixTree


def slots(*xs: int) -> np.ndarray:
    return np.array(xs, dtype=np.int64)


def span(start: int, n: int) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int64)


class Freed:
    """An on_free sink that records what the tree gave back."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def __call__(self, value: np.ndarray) -> None:
        self.calls.append(value.tolist())

    @property
    def all(self) -> list[int]:
        return sorted(s for call in self.calls for s in call)


def test_match_on_empty_tree():
    tree = RadixTree()
    m = tree.match_prefix([1, 2, 3])
    assert isinstance(m, MatchResult)
    assert isinstance(m.indices, np.ndarray) and m.indices.dtype == np.int64 and m.indices.size == 0
    assert m.last_node is tree.root
    indices, node = tree.match_prefix([])  # unpacks like a tuple
    assert indices.size == 0 and node is tree.root
    assert tree.total_size() == 0
    tree.check_integrity()


def test_exact_match_and_insert_returns_existing_prefix():
    tree = RadixTree()
    assert tree.insert([1, 2, 3, 4], slots(10, 11, 12, 13)) == 0
    m = tree.match_prefix([1, 2, 3, 4])
    assert m.indices.tolist() == [10, 11, 12, 13]
    assert m.last_node.key == [1, 2, 3, 4]
    # Re-inserting the same key reports it all as present and keeps the tree's slots.
    assert tree.insert([1, 2, 3, 4], slots(20, 21, 22, 23)) == 4
    assert tree.match_prefix([1, 2, 3, 4, 5]).indices.tolist() == [10, 11, 12, 13]
    # An extension reports the shared part and keeps only the new tail.
    assert tree.insert([1, 2, 3, 4, 5, 6], slots(30, 31, 32, 33, 34, 35)) == 4
    assert tree.match_prefix([1, 2, 3, 4, 5, 6]).indices.tolist() == [10, 11, 12, 13, 34, 35]
    assert tree.total_size() == 6 and tree.evictable_size() == 6
    tree.check_integrity()


def test_partial_match_splits_node():
    tree = RadixTree()
    tree.insert([1, 2, 3, 4, 5], span(100, 5))
    m = tree.match_prefix([1, 2, 3, 9])
    assert m.indices.tolist() == [100, 101, 102]
    assert m.last_node.key == [1, 2, 3]  # ends exactly at the match
    (child,) = m.last_node.children.values()
    assert child.key == [4, 5] and child.value.tolist() == [103, 104]
    assert tree.total_size() == 5
    tree.check_integrity()
    # Inserting a sibling branch under the split point shares the first three slots.
    assert tree.insert([1, 2, 3, 7, 8], span(200, 5)) == 3
    assert tree.match_prefix([1, 2, 3, 7, 8]).indices.tolist() == [100, 101, 102, 203, 204]
    assert tree.total_size() == 7
    tree.check_integrity()


def test_insert_splits_inside_a_node():
    tree = RadixTree()
    tree.insert([1, 2, 3, 4], span(0, 4))
    assert tree.insert([1, 2, 9], span(10, 3)) == 2
    assert tree.match_prefix([1, 2, 9]).indices.tolist() == [0, 1, 12]
    assert tree.match_prefix([1, 2, 3, 4]).indices.tolist() == [0, 1, 2, 3]
    tree.check_integrity()


def test_match_result_is_a_copy():
    tree = RadixTree()
    tree.insert([1, 2, 3], span(0, 3))
    m = tree.match_prefix([1, 2, 3])
    m.indices.fill(-1)
    assert tree.match_prefix([1, 2, 3]).indices.tolist() == [0, 1, 2]


def test_insert_copies_the_callers_tensor():
    tree = RadixTree()
    row = span(0, 4)
    tree.insert([1, 2, 3, 4], row)
    row.fill(99)  # the caller's req_to_token row gets reused
    assert tree.match_prefix([1, 2, 3, 4]).indices.tolist() == [0, 1, 2, 3]


def test_key_may_be_a_tensor_or_tuple():
    tree = RadixTree()
    tree.insert(torch.tensor([5, 6, 7]), span(0, 3))
    assert tree.match_prefix((5, 6)).indices.tolist() == [0, 1]
    tree.insert(np.array([5, 6, 8]), torch.arange(10, 13))  # a CPU tensor of slots reads too
    m = tree.match_prefix([5, 6, 8])
    assert m.indices.tolist() == [0, 1, 12] and m.last_node.value.dtype == np.int64


def test_eviction_is_lru_and_frees_parents_that_become_leaves():
    freed = Freed()
    tree = RadixTree(on_free=freed)
    tree.insert([1, 2, 3], span(0, 3))  # becomes [1,2] -> {[3], [4, 5]}
    tree.insert([1, 2, 4, 5], span(10, 4))
    tree.insert([7, 8], span(20, 2))
    tree.match_prefix([1, 2, 3])  # [1,2,3] is now the most recent; [1,2,4,5] the oldest leaf
    assert tree.evict(1) == 2
    assert freed.calls == [[12, 13]]
    assert tree.evict(1) == 2  # then [7, 8]
    assert freed.calls[-1] == [20, 21]
    # [3] goes, and its parent [1, 2] becomes an unlocked leaf and goes in the same call.
    assert tree.evict(3) == 3
    assert freed.all == [0, 1, 2, 12, 13, 20, 21]
    assert tree.total_size() == 0
    assert tree.evict(10) == 0
    tree.check_integrity()


def test_locked_nodes_are_never_evicted():
    freed = Freed()
    tree = RadixTree(on_free=freed)
    tree.insert([1, 2, 3, 4], span(0, 4))
    tree.insert([1, 2, 5], span(10, 3))
    node = tree.match_prefix([1, 2, 3, 4]).last_node
    assert tree.inc_lock_ref(node) == 4  # [1,2] and [3,4] become protected
    assert tree.protected_size() == 4 and tree.evictable_size() == 1
    assert tree.inc_lock_ref(node) == 0  # already protected
    assert tree.evict(100) == 1  # only [5]
    assert freed.all == [12]
    assert tree.match_prefix([1, 2, 3, 4]).indices.tolist() == [0, 1, 2, 3]
    assert tree.dec_lock_ref(node) == 0
    assert tree.dec_lock_ref(node) == -4
    assert tree.protected_size() == 0 and tree.evictable_size() == 4
    tree.check_integrity()
    assert tree.evict(100) == 4
    assert freed.all == [0, 1, 2, 3, 12]


def test_lock_survives_a_split_of_the_locked_node():
    tree = RadixTree()
    tree.insert([1, 2, 3, 4], span(0, 4))
    node = tree.match_prefix([1, 2, 3, 4]).last_node
    tree.inc_lock_ref(node)
    tree.match_prefix([1, 2, 9])  # splits the locked node
    tree.check_integrity()
    assert tree.protected_size() == 4
    assert tree.dec_lock_ref(node) == -4
    tree.check_integrity()
    assert tree.protected_size() == 0


def test_dec_lock_ref_on_unlocked_node_asserts():
    tree = RadixTree()
    tree.insert([1], span(0, 1))
    with pytest.raises(AssertionError):
        tree.dec_lock_ref(tree.match_prefix([1]).last_node)


def test_page_size_alignment():
    ps = 4
    tree = RadixTree(page_size=ps)
    # Keys are page-aligned on insert; slots of a page are one whole KV page.
    assert tree.insert([1, 2, 3, 4, 5, 6, 7, 8], span(8, 8)) == 0
    assert tree.match_prefix([1, 2, 3]).indices.size == 0  # less than a page
    assert tree.match_prefix([1, 2, 3, 4, 5, 6]).indices.tolist() == [8, 9, 10, 11]
    m = tree.match_prefix([1, 2, 3, 4, 5, 6, 7, 9])  # diverges inside page 2: split at 4
    assert m.indices.tolist() == [8, 9, 10, 11] and m.last_node.key == [1, 2, 3, 4]
    assert tree.insert([1, 2, 3, 4, 5, 6, 0, 0], span(20, 8)) == 4
    assert tree.match_prefix([1, 2, 3, 4, 5, 6, 0, 0, 1]).indices.tolist() == [
        8,
        9,
        10,
        11,
        24,
        25,
        26,
        27,
    ]
    tree.check_integrity()
    with pytest.raises(AssertionError, match="unaligned"):
        tree.insert([1, 2, 3], span(40, 3))


def test_integrity_catches_a_corrupted_tree():
    tree = RadixTree()
    tree.insert([1, 2, 3], span(0, 3))
    tree.insert([4, 5], span(2, 2))  # slot 2 is now in two nodes
    with pytest.raises(AssertionError, match="duplicate"):
        tree.check_integrity()
    tree = RadixTree()
    tree.insert([1, 2], span(0, 2))
    tree._evictable += 1
    with pytest.raises(AssertionError, match="evictable"):
        tree.check_integrity()
    tree = RadixTree(page_size=2)
    tree.insert([1, 2], slots(1, 2))  # not one whole page (page 0 is slots 0..1)
    with pytest.raises(AssertionError, match="page"):
        tree.check_integrity()


def test_extra_key_isolation():
    tree = RadixTree()
    tree.insert([1, 2, 3], span(0, 3), extra_key="lora-a")
    assert tree.match_prefix([1, 2, 3]).indices.size == 0
    assert tree.match_prefix([1, 2, 3], extra_key="lora-b").indices.size == 0
    assert tree.match_prefix([1, 2, 3], extra_key="lora-a").indices.tolist() == [0, 1, 2]
    assert tree.insert([1, 2, 3], span(10, 3)) == 0  # no sharing across namespaces
    assert tree.insert([1, 2, 3, 4], span(20, 4), extra_key="lora-a") == 3
    assert tree.match_prefix([1, 2, 3]).indices.tolist() == [10, 11, 12]
    assert tree.total_size() == 7
    tree.check_integrity()


def test_reset_drops_everything_without_freeing():
    freed = Freed()
    tree = RadixTree(on_free=freed)
    tree.insert([1, 2, 3], span(0, 3))
    tree.inc_lock_ref(tree.match_prefix([1, 2]).last_node)
    tree.reset()
    assert tree.total_size() == tree.evictable_size() == tree.protected_size() == 0
    assert tree.match_prefix([1, 2, 3]).indices.size == 0
    assert freed.calls == []
    tree.check_integrity()


def test_all_values_and_pretty_print():
    tree = RadixTree()
    tree.insert([1, 2, 3], span(0, 3))
    tree.insert([1, 2, 4], span(10, 3))
    assert sorted(tree.all_values().tolist()) == [0, 1, 2, 12]
    text = tree.pretty_print()
    assert "len=2" in text and "evictable=4" in text


def test_split_tail_keeps_its_old_lru_time():
    freed = Freed()
    tree = RadixTree(on_free=freed)
    tree.insert([1, 2, 3, 4], span(0, 4))
    tree.insert([5, 6], span(10, 2))
    tree.match_prefix([1, 2, 9])  # refreshes [1, 2] only; [3, 4] is still the oldest
    assert tree.evict(1) == 2
    assert freed.calls == [[2, 3]]
    tree.check_integrity()
