"""PagedAllocator.check_no_duplicates: exact (a counted duplicate, not a sampled one) at any
fill of the pool, against sorting the free pages as the reference."""

from __future__ import annotations

import random
import sys

import numpy as np
import pytest
import torch

from loom.runtime.kv_pages import PagedAllocator


def _reference_ok(alloc: PagedAllocator) -> bool:
    free = alloc.free_list()
    return len(np.unique(free)) == len(free)


@pytest.mark.parametrize("page_size", [1, 4])
def test_agrees_with_sorting_over_random_alloc_and_free(page_size):
    rng = random.Random(page_size)
    alloc = PagedAllocator(64 * page_size + page_size, page_size, "cpu")
    held: list[np.ndarray] = []
    for _ in range(300):
        if held and rng.random() < 0.45:
            alloc.free(held.pop(rng.randrange(len(held))))
        else:
            got = alloc.alloc(rng.randint(1, 3 * page_size))
            if got is not None:
                held.append(got)
        assert _reference_ok(alloc)
        alloc.check_no_duplicates()  # passes exactly when the reference does
    while held:
        alloc.free(held.pop())
    alloc.check_no_duplicates()
    assert alloc.available_size() == alloc.size


def test_a_page_freed_twice_is_caught_even_in_a_full_pool():
    alloc = PagedAllocator(9, 1, "cpu")
    slots = alloc.alloc(8)
    assert alloc.available_size() == 0
    alloc.check_no_duplicates()  # nothing free: nothing to count
    alloc.free(slots[:3])
    alloc.free(slots[2:3])  # slot 3 again
    assert not _reference_ok(alloc)
    with pytest.raises(AssertionError, match="freed twice"):
        alloc.check_no_duplicates()


@pytest.mark.parametrize("page_size", [1, 4])
def test_pages_go_out_first_in_first_out_across_the_ring_wrap(page_size):
    # the reference: a plain list, fresh pages 1..N in order, each free's pages (sorted,
    # unique) appended at the end, each take from the front; many wraps of the ring
    from collections import deque

    rng = random.Random(7 + page_size)
    pages = 16
    alloc = PagedAllocator((pages + 1) * page_size, page_size, "cpu")
    ref = deque(range(1, pages + 1))
    held: list[np.ndarray] = []
    for _ in range(500):
        if held and rng.random() < 0.5:
            slots = held.pop(rng.randrange(len(held)))
            alloc.free(slots[np.random.default_rng(len(held)).permutation(len(slots))])
            ref.extend(sorted({int(s) // page_size for s in slots}))
        else:
            n = rng.randint(1, 5 * page_size)
            got = alloc.alloc(n)
            need = -(-n // page_size)
            if need > len(ref):
                assert got is None
                continue
            want = [ref.popleft() for _ in range(need)]
            assert sorted({int(s) // page_size for s in got}) == sorted(want)
            assert [int(s) // page_size for s in got[::page_size]] == want  # in ring order
            held.append(got)
        assert alloc.free_list().tolist() == list(ref)
        assert alloc.available_size() == len(ref) * page_size


def _resident_pages(t: torch.Tensor) -> int:
    """How many of the tensor's memory pages are resident (mincore(2), Linux)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    start = t.data_ptr() // page * page
    length = t.data_ptr() + t.numel() * t.element_size() - start
    vec = (ctypes.c_ubyte * ((length + page - 1) // page))()
    rc = libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec)
    assert rc == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec)


@pytest.mark.skipif(sys.platform != "linux", reason="mincore(2) as Linux reports it")
def test_request_rows_are_zero_but_not_resident_until_written():
    """The request-row table of a default Gemma 3 server (257 rows x 32,769 columns, int64:
    67 MB) reads as zeros but takes no memory at start-up (torch.zeros wrote every page);
    a written row costs the pages it touches."""
    from loom.runtime.memory_pool import ReqToTokenPool

    pool = ReqToTokenPool(257, 32769, "cpu")
    table = pool.req_to_token
    assert table.shape == (257, 32769) and table.dtype == torch.int64
    assert _resident_pages(table) == 0
    assert int(table[7].abs().sum()) == 0 and int(table[-1, -3:].abs().sum()) == 0
    table[5, :1000] = torch.arange(1000)
    assert table[5, 999] == 999 and int(table[4].abs().sum()) == 0
    assert 0 < _resident_pages(table) < table.numel() * 8 // 4096 // 4
