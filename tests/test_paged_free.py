"""PagedAllocator.free's two paths (a Python set for small frees, torch.unique for large ones)
leave the same free list, over random frees of partial pages, repeated slots and both sizes."""

from __future__ import annotations

import random

import pytest
import torch

import loom.runtime.memory_pool as memory_pool
from loom.runtime.memory_pool import PagedAllocator


def _run(page_size: int, small_free: int, monkeypatch) -> list[int]:
    monkeypatch.setattr(memory_pool, "SMALL_FREE", small_free)
    rng = random.Random(page_size)
    alloc = PagedAllocator(128 * page_size + page_size, page_size, "cpu")
    held: list[torch.Tensor] = []
    for _ in range(400):
        if held and rng.random() < 0.5:
            slots = held.pop(rng.randrange(len(held)))
            if len(slots) > 1 and rng.random() < 0.3:  # a slot named twice in one call
                slots = torch.cat([slots, slots[:1]])
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
        alloc.free(torch.tensor([5, 1]))
