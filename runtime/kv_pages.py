"""The KV page allocator: which slots of the KV pool are free, handed out page by page.

Torch-free (issue 32's port: the scheduler's bookkeeping in numpy, so a process whose forward
needs no torch need not import it): slots are 1-D numpy int64 arrays on the host, whatever the
pool's device, and the runner takes a step's slots with `torch.from_numpy`. Slot 0 ..
page_size-1 form a reserved padding page (runtime/memory_pool.py), never handed out.
"""

from __future__ import annotations

import numpy as np

SMALL_FREE = 64  # slots freed without np.unique (see `PagedAllocator.free`)


class PagedAllocator:
    """Free list of KV pages. Slots are handed out page by page; `size` excludes the padding page.

    Slots are 1-D numpy int64 arrays on the host, whatever the pool's device (the scheduler's
    bookkeeping never needs torch; the runner takes a batch's slots with `torch.from_numpy`).

    Contract: a request's slots occupy whole pages it owns, except pages shared through the
    radix cache (always full). `alloc_extend` fills the request's last partial page first.
    """

    def __init__(self, num_slots: int, page_size: int, device: str):
        assert num_slots % page_size == 0 and num_slots > page_size
        self.page_size = page_size
        self.device = device
        self.num_pages = num_slots // page_size - 1  # page 0 is padding
        self.size = self.num_pages * page_size
        self.clear()

    def clear(self) -> None:
        # The free pages as a FIFO ring (_ring[_head], ... the next _count entries, wrapping):
        # taking n pages reads n entries at the head, freeing n writes n at the tail, so a
        # verify step freeing its rejected drafts' slots touches those few entries, not the
        # whole list (a free list re-concatenated on every free copied 2 MB on the bundled
        # model). FIFO, not a stack: fresh pages go out in order 1, 2, 3, ... before any freed
        # page comes back, so a prefill's pages stay contiguous while fresh ones last. Handing
        # out the most recently freed pages first (a stack) gave every prefill after a
        # flush_cache the evicted requests' scattered decode slots: batch-64 decode then ran
        # 1.10x llama.cpp against 1.28x (bench_engine_room, idle, alternating builds).
        self._ring = np.arange(1, self.num_pages + 1, dtype=np.int64)
        self._head = 0
        self._count = self.num_pages

    def _ring_read(self, n: int) -> np.ndarray:
        """A copy of the n ring entries from the head, wrapping (the ring's entries are reused)."""
        end = self._head + n
        if end <= self.num_pages:
            return self._ring[self._head : end].copy()
        return np.concatenate([self._ring[self._head :], self._ring[: end - self.num_pages]])

    def free_list(self) -> np.ndarray:
        """The free pages in the order they will be handed out (a copy)."""
        return self._ring_read(self._count)

    def available_size(self) -> int:
        return self._count * self.page_size

    def _take_pages(self, n: int) -> np.ndarray | None:
        if n > self._count:
            return None
        pages = self._ring_read(n)
        self._head = (self._head + n) % self.num_pages
        self._count -= n
        return pages

    def alloc(self, num_tokens: int) -> np.ndarray | None:
        """Fresh page-aligned slots for `num_tokens` tokens (page size 1: any slots)."""
        pages = self._take_pages(-(-num_tokens // self.page_size))
        if pages is None or self.page_size == 1:  # page size 1: a page is its one slot
            return pages
        offsets = np.arange(self.page_size, dtype=np.int64)
        slots = (pages[:, None] * self.page_size + offsets).reshape(-1)
        return slots[:num_tokens]

    def alloc_decode(self, prev_lens: np.ndarray, last_slots: np.ndarray) -> np.ndarray | None:
        """One slot for each of B requests at positions prev_lens: the slot after last_slots
        inside a partly filled page, else the first slot of a fresh page."""
        if self.page_size == 1:
            return self.alloc(len(prev_lens))
        fresh = np.asarray(prev_lens) % self.page_size == 0
        pages = self._take_pages(int(fresh.sum()))
        if pages is None:
            return None
        slots = np.asarray(last_slots, dtype=np.int64) + 1
        slots[fresh] = pages * self.page_size
        return slots

    def alloc_extend(self, prev_len: int, last_slot: int, num_tokens: int) -> np.ndarray | None:
        """Slots for positions prev_len .. prev_len+num_tokens-1 of one request, continuing the
        partially filled page that ends at `last_slot` (ignored when prev_len is page-aligned)."""
        in_page = prev_len % self.page_size
        fill = 0 if in_page == 0 else min(self.page_size - in_page, num_tokens)
        head = np.arange(last_slot + 1, last_slot + 1 + fill, dtype=np.int64)
        if fill == num_tokens:
            return head
        rest = self.alloc(num_tokens - fill)
        if rest is None:
            return None
        return np.concatenate([head, rest]) if fill else rest

    def pages_needed(self, prev_len: int, num_tokens: int) -> int:
        in_page = prev_len % self.page_size
        fill = 0 if in_page == 0 else min(self.page_size - in_page, num_tokens)
        return -(-(num_tokens - fill) // self.page_size)

    def free(self, slots) -> None:
        """Return slots (a numpy array, a list, or a CPU tensor: anything `np.asarray` reads);
        with page_size > 1 frees the unique pages `slots // page_size`."""
        if hasattr(slots, "cpu"):  # a tensor: through its own numpy view
            slots = slots.cpu().numpy()
        slots = np.asarray(slots, dtype=np.int64).reshape(-1)
        count = slots.size
        if count == 0:
            return
        if count <= SMALL_FREE:
            # a verify step's rejected draft slots: a set of a few ints, not a sort
            # (these frees come on most verify steps at batch 1)
            ps = self.page_size
            asc = sorted({s // ps for s in slots.tolist()})
            lowest, pages = asc[0], np.array(asc, dtype=np.int64)
        else:
            pages = np.unique(slots // self.page_size)
            lowest = int(pages[0])
        assert lowest >= 1, "padding page must never be freed"
        n = len(pages)
        assert self._count + n <= self.num_pages, "more pages freed than the pool holds"
        tail = (self._head + self._count) % self.num_pages
        first = min(n, self.num_pages - tail)
        self._ring[tail : tail + first] = pages[:first]
        if first < n:
            self._ring[: n - first] = pages[first:]
        self._count += n

    def check_no_duplicates(self) -> None:
        # a count per page, O(pages): sorting them took ~20 ms on the bundled model's 262,144
        # pages, on every idle scheduler step (a request arriving waited)
        free = self.free_list()
        if len(free):
            counts = np.bincount(free, minlength=self.num_pages + 1)
            assert int(counts.max()) == 1, "page freed twice"


# a host pool's size when --max-total-tokens is unset: a 2 GB budget, at most 2^18 tokens
CPU_KV_BUDGET_BYTES = 2 << 30
MAX_DEFAULT_TOKENS = 1 << 18


def pool_tokens(
    max_total_tokens: int | None, page: int, per_token: int, device_tokens: int | None = None
) -> int:
    """Tokens a KV pool holds, in whole pages (at least two): --max-total-tokens, else what a
    device's free memory allows (`device_tokens`, CUDA), else the host budget. Both runners
    size their pools here, so they hand the scheduler the same slots."""
    if max_total_tokens is not None:
        total = max_total_tokens
    elif device_tokens is not None:
        total = device_tokens
    else:
        total = min(CPU_KV_BUDGET_BYTES // per_token, MAX_DEFAULT_TOKENS)
    return max(page * 2, total // page * page)


class RequestRows:
    """[max requests x max context] slot indices; a row is a running request's KV map, handed
    out and freed here. The table is the forward's: a numpy int64 array (the torch-free runner,
    runtime/array_runner.py) or a torch tensor (memory_pool.ReqToTokenPool); the scheduler
    reads and writes it through `radix/base.read_slots` / `write_slots`, which take either."""

    def __init__(self, table):
        self.req_to_token = table
        self.size, self.max_context_len = table.shape
        self._free = list(range(self.size - 1, -1, -1))

    def available_size(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, idx: int) -> None:
        assert 0 <= idx < self.size and idx not in self._free, f"double free of req row {idx}"
        self._free.append(idx)

    def clear(self) -> None:
        self._free = list(range(self.size - 1, -1, -1))
