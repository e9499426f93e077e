"""KV memory: request rows of slot indices, and per-layer K/V buffers with a page allocator.

Slot 0 .. page_size-1 form a reserved padding page: it is never handed out, so a zero in
`req_to_token` never aliases live KV, and padded positions can safely write there.
"""

from __future__ import annotations

import mmap

import torch

# "float32": loom's own value (SGLang has none), to pin a float32 pool where "auto" picks
# bfloat16 (a GGUF model in the C forward: ModelRunner._kv_cache_dtype)
_KV_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def resolve_kv_dtype(kv_cache_dtype: str, model_dtype: torch.dtype, backend: str) -> torch.dtype:
    """The KV pool's storage dtype for --kv-cache-dtype ("auto": the model dtype). K/V are
    rounded to it when stored; every attention path reads them back into float32 (the C
    kernels) or the query's dtype (torch) before its math. Triton's kernels are only tested
    with a pool in the model dtype, so another combination is refused there."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in _KV_DTYPES:
        raise ValueError(f"kv_cache_dtype: {kv_cache_dtype!r} is not supported yet")
    dtype = _KV_DTYPES[kv_cache_dtype]
    if backend == "triton" and dtype != model_dtype:
        raise ValueError(
            f"kv_cache_dtype: {kv_cache_dtype!r} with a {model_dtype} model is not supported yet"
            " by the triton attention backend (use --dtype bfloat16, or the torch backend)"
        )
    return dtype


def zeros_untouched(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    """torch.zeros, but on the CPU in fresh anonymous pages: zero-filled by the kernel when
    first touched, so only the pages written become resident. `torch.zeros` writes every byte:
    a default Gemma 3 server's request rows (257 x 32,769 int64) were 67 MB resident at
    start-up, while the rows a server uses hold at most its pool's tokens."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = 1
    for n in shape:
        count *= n
    if count == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, count * dtype.itemsize)  # the tensor keeps the map alive
    return torch.frombuffer(buf, dtype=dtype, count=count).view(shape)


class ReqToTokenPool:
    """[max requests x max context] slot indices; a row is a running request's KV map."""

    def __init__(self, size: int, max_context_len: int, device: str):
        self.size = size
        self.max_context_len = max_context_len
        self.req_to_token = zeros_untouched((size, max_context_len), torch.int64, device)
        self._free = list(range(size - 1, -1, -1))

    def available_size(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, idx: int) -> None:
        assert 0 <= idx < self.size and idx not in self._free, f"double free of req row {idx}"
        self._free.append(idx)

    def clear(self) -> None:
        self._free = list(range(self.size - 1, -1, -1))


class TokenToKVPool:
    """Per-layer K and V buffers of shape [num_slots, kv_heads, head_dim]."""

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str,
        v_head_dim: int | None = None,
        padding_slots: int = 1,
    ):
        from loom.runtime.distributed import pp_layer_range

        self.num_slots = num_slots
        # a pipeline stage keeps the KV of its own layers only (the others get empty buffers)
        mine = pp_layer_range(num_layers)

        def buffer(dim: int, layer: int) -> torch.Tensor:
            rows = num_slots if layer in mine else 0
            return torch.empty((rows, kv_heads, dim), dtype=dtype, device=device)

        # Uninitialised: a slot is always written before it is read, except the padding page,
        # which padded decode positions read (masked out) and so must hold finite values.
        self.k_buffers = [buffer(head_dim, i) for i in range(num_layers)]
        self.v_buffers = [buffer(v_head_dim or head_dim, i) for i in range(num_layers)]
        for buf in self.k_buffers + self.v_buffers:
            buf[:padding_slots].zero_()

    def set_kv(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k_buffers[layer_id][slots] = k.to(self.k_buffers[layer_id].dtype)
        self.v_buffers[layer_id][slots] = v.to(self.v_buffers[layer_id].dtype)

    def get_kv(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffers[layer_id], self.v_buffers[layer_id]

    def bytes_per_token(self) -> int:
        total = sum(b.numel() * b.element_size() for b in self.k_buffers + self.v_buffers)
        return total // self.num_slots


SMALL_FREE = 64  # slots freed without torch.unique (see `PagedAllocator.free`)


class PagedAllocator:
    """Free list of KV pages. Slots are handed out page by page; `size` excludes the padding page.

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
        self._ring = torch.arange(1, self.num_pages + 1, dtype=torch.int64)
        self._head = 0
        self._count = self.num_pages

    def _ring_read(self, n: int) -> torch.Tensor:
        """A copy of the n ring entries from the head, wrapping (the ring's entries are reused)."""
        end = self._head + n
        if end <= self.num_pages:
            return self._ring[self._head : end].clone()
        return torch.cat([self._ring[self._head :], self._ring[: end - self.num_pages]])

    def free_list(self) -> torch.Tensor:
        """The free pages in the order they will be handed out (a copy)."""
        return self._ring_read(self._count)

    def available_size(self) -> int:
        return self._count * self.page_size

    def _take_pages(self, n: int) -> torch.Tensor | None:
        if n > self._count:
            return None
        pages = self._ring_read(n)
        self._head = (self._head + n) % self.num_pages
        self._count -= n
        return pages

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """Fresh page-aligned slots for `num_tokens` tokens (page size 1: any slots)."""
        pages = self._take_pages(-(-num_tokens // self.page_size))
        if pages is None or self.page_size == 1:  # page size 1: a page is its one slot
            return pages
        offsets = torch.arange(self.page_size, dtype=torch.int64)
        slots = (pages[:, None] * self.page_size + offsets).flatten()
        return slots[:num_tokens]

    def alloc_decode(
        self, prev_lens: torch.Tensor, last_slots: torch.Tensor
    ) -> torch.Tensor | None:
        """One slot for each of B requests at positions prev_lens: the slot after last_slots
        inside a partly filled page, else the first slot of a fresh page."""
        if self.page_size == 1:
            return self.alloc(len(prev_lens))
        fresh = prev_lens % self.page_size == 0
        pages = self._take_pages(int(fresh.sum()))
        if pages is None:
            return None
        slots = last_slots + 1
        slots[fresh] = pages * self.page_size
        return slots

    def alloc_extend(self, prev_len: int, last_slot: int, num_tokens: int) -> torch.Tensor | None:
        """Slots for positions prev_len .. prev_len+num_tokens-1 of one request, continuing the
        partially filled page that ends at `last_slot` (ignored when prev_len is page-aligned)."""
        in_page = prev_len % self.page_size
        fill = 0 if in_page == 0 else min(self.page_size - in_page, num_tokens)
        head = torch.arange(last_slot + 1, last_slot + 1 + fill, dtype=torch.int64)
        if fill == num_tokens:
            return head
        rest = self.alloc(num_tokens - fill)
        if rest is None:
            return None
        return torch.cat([head, rest]) if fill else rest

    def pages_needed(self, prev_len: int, num_tokens: int) -> int:
        in_page = prev_len % self.page_size
        fill = 0 if in_page == 0 else min(self.page_size - in_page, num_tokens)
        return -(-(num_tokens - fill) // self.page_size)

    def free(self, slots: torch.Tensor) -> None:
        count = slots.numel()
        if count == 0:
            return
        if count <= SMALL_FREE:
            # a verify step's rejected draft slots: a set of a few ints, not torch.unique's
            # sort (~4 vs ~15 us a call; these frees come on most verify steps at batch 1)
            ps = self.page_size
            asc = sorted({s // ps for s in slots.tolist()})
            lowest, pages = asc[0], torch.tensor(asc, dtype=torch.int64)
        else:
            pages = torch.unique(slots.to(torch.int64).cpu() // self.page_size)
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
        # a count per page, O(pages): sorting them (torch.unique) took ~20 ms on the bundled
        # model's 262,144 pages, on every idle scheduler step (a request arriving waited)
        free = self.free_list()
        if len(free):
            counts = torch.bincount(free, minlength=self.num_pages + 1)
            assert int(counts.max()) == 1, "page freed twice"
