"""PagedAllocator.free's two paths (a Python set for small frees, np.unique for large ones)
leave the same free list, over random frees of partial pages, repeated slots and both sizes."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import loom.runtime.kv_pages as kv_pages
from loom.runtime.kv_pages import PagedAllocator


def _run(page_size: int, small_free: int, monkeypatch) -> list[int]:
    monkeypatch.setattr(kv_pages, "SMALL_FREE", small_free)
    rng = random.Random(page_size)
    alloc = PagedAllocator(128 * page_size + page_size, page_size, "cpu")
    held: list[np.ndarray] = []
    for _ in range(400):
        if held and rng.random() < 0.5:
            slots = held.pop(rng.randrange(len(held)))
            if len(slots) > 1 and rng.random() < 0.3:  # a slot named twice in one call
                slots = np.concatenate([slots, slots[:1]])
            order = list(range(len(slots)))
            rng.shuffle(order)
            alloc.free(slots[order])
        else:
            got = alloc.alloc(rng.randint(1, 100))
            if got is not None:
                held.append(got)
    alloc.check_no_duplicates()
    return alloc.free_list().tolist()


@pytest.mark.parametrize("page_size", [1, 4])
def test_small_and_large_free_paths_agree(page_size, monkeypatch):
    small = _run(page_size, 64, monkeypatch)
    assert small == _run(page_size, 0, monkeypatch)
    assert len(small) < 128  # the run ends with pages held: the order was exercised


def test_small_free_refuses_the_padding_page():
    alloc = PagedAllocator(8, 2, "cpu")
    with pytest.raises(AssertionError, match="padding page"):
        alloc.free(np.array([5, 1]))


def test_free_reads_any_array_of_slots():
    """Slots are numpy; a list or a CPU tensor of them frees the same pages."""
    lists = []
    for kind in (np.array, list, torch.tensor):
        alloc = PagedAllocator(34, 2, "cpu")
        got = alloc.alloc(12)
        assert isinstance(got, np.ndarray) and got.dtype == np.int64
        alloc.free(kind(got[[9, 2, 3, 8]].tolist()))
        lists.append(alloc.free_list().tolist())
    assert lists[0] == lists[1] == lists[2] == list(range(7, 17)) + [2, 5]  # slots 11, 4, 5, 10
