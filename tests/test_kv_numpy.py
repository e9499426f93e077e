"""The scheduler's KV bookkeeping without torch (issue 32's port, its first layer): the page
allocator, the radix cache and the KV manager run on numpy slots and a numpy request table in
a process that never imports torch, and hand out and share the slots a request expects."""

from __future__ import annotations

from tests.runtime_helpers import run_child

_SCRIPT = r"""
import sys

import numpy as np

from loom.radix.cache import RadixCache
from loom.runtime.kv_pages import PagedAllocator
from loom.runtime.req import Req
from loom.runtime.sampling_params import make_sampling_params
from loom.runtime.scheduler.kv import KVManager


class Rows:  # the request table as numpy (ReqToTokenPool's role)
    def __init__(self, size, width):
        self.size, self.req_to_token = size, np.zeros((size, width), dtype=np.int64)
        self._free = list(range(size - 1, -1, -1))

    def available_size(self):
        return len(self._free)

    def alloc(self):
        return self._free.pop() if self._free else None

    def free(self, row):
        self._free.append(row)


ps = 4
alloc = PagedAllocator(33 * ps, ps, "cpu")
rows = Rows(4, 64)
kv = KVManager(rows, alloc, RadixCache(rows, alloc, ps), ps)


def request(rid, ids):
    req = Req(rid, ids, make_sampling_params({"max_new_tokens": 4}), seed=0)
    assert kv.admit(req, len(ids) - 1)
    return req


a = request("a", list(range(10, 21)))  # 11 tokens, nothing cached
assert a.kv_len == 0 and len(a.prefix_indices) == 0
slots = kv.alloc(a, 11)
assert isinstance(slots, np.ndarray) and slots.dtype == np.int64
assert slots.tolist() == list(range(4, 15))  # fresh pages 1, 2, 3 in order
a.kv_len = 11
kv.check_integrity([a])
kv.release(a)  # into the radix cache: its 8 page-aligned tokens stay cached
kv.check_integrity([])
assert kv.tree_cache.total_size() == 8

b = request("b", list(range(10, 20)) + [99, 98, 97])
assert b.kv_len == 8 and b.prefix_indices.tolist() == list(range(4, 12))  # a's KV, shared
assert rows.req_to_token[b.req_pool_idx, :8].tolist() == list(range(4, 12))
kv.alloc(b, 5)
b.kv_len = 13
b.output_ids.append(5)  # its first sampled token, whose KV the decode step writes
decode = kv.alloc_decode([b])  # position 13: the next slot of b's partly filled last page
assert decode.tolist() == [int(rows.req_to_token[b.req_pool_idx, 12]) + 1]
b.kv_len = 14
kv.check_integrity([b])
kv.truncate(b, 12, 14)
kv.release(b)
kv.check_integrity([])
kv.flush()
assert alloc.available_size() == alloc.size
assert "torch" not in sys.modules, "the KV bookkeeping imported torch"
print("ok")
"""


def test_kv_bookkeeping_runs_on_numpy_without_torch():
    assert run_child(_SCRIPT, timeout=120) == ["ok"]
