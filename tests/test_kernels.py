"""Every Triton kernel in loom.kernels against its plain-torch reference, on the CPU through
Triton's interpreter (TRITON_INTERPRET=1; slow, so the shapes are tiny but ragged: odd head
dims, GQA groups 1/4/8, page sizes 1 and 16, empty prefixes, several tree shapes)."""

from __future__ import annotations

import importlib

import pytest
import torch

from loom.kernels.interpret import load_interpreted

# compiled kernels on CUDA (scripts/gpu_check.sh), the interpreter elsewhere
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def kernel(name: str):
    return (
        importlib.import_module(f"loom.kernels.{name}") if DEV == "cuda" else load_interpreted(name)
    )


decode_attention = kernel("decode_attention")
extend_attention = kernel("extend_attention")
cascade = kernel("cascade")
kv_store = kernel("kv_store")
bitmask = kernel("bitmask")
norm = kernel("norm")
rotary = kernel("rotary")


@pytest.fixture(autouse=True)
def _on_device():
    with torch.device(DEV):
        yield


def paged_pool(seq_lens, kv_heads, head_dim, page_size, dtype=torch.float32, v_dim=None, seed=0):
    """A KV pool and page table as the runtime lays them out: page 0 is padding, each request
    owns whole pages, scattered in a shuffled order. Returns (k_buf, v_buf, req_to_token,
    req_pool_indices)."""
    g = torch.Generator().manual_seed(seed)
    pages_per = [-(-n // page_size) for n in seq_lens]
    num_pages = sum(pages_per) + 3
    order = torch.randperm(num_pages - 1, generator=g, device="cpu") + 1
    slots = num_pages * page_size
    k_buf = torch.randn(slots, kv_heads, head_dim, generator=g, device="cpu").to(dtype)
    v_buf = torch.randn(slots, kv_heads, v_dim or head_dim, generator=g, device="cpu")
    width = max(seq_lens) + page_size
    table = torch.zeros(len(seq_lens) + 2, width, dtype=torch.int64, device="cpu")
    rows = torch.randperm(len(seq_lens) + 2, generator=g, device="cpu")[: len(seq_lens)]
    at = 0
    for row, n, p in zip(rows.tolist(), seq_lens, pages_per):
        pages = order[at : at + p]
        at += p
        pos = torch.arange(page_size, device="cpu")
        table[row, :n] = (pages[:, None] * page_size + pos).flatten()[:n]
    return k_buf.to(DEV), v_buf.to(DEV, dtype), table.to(DEV), rows.to(DEV)


# Half precision is tested in float16: Triton's interpreter computes bfloat16 wrongly (numpy has
# no bfloat16); scripts/gpu_check.sh runs these tests on CUDA, where bfloat16 is covered too.
HALF = torch.bfloat16 if torch.cuda.is_available() else torch.float16


def close(a, b, dtype=torch.float32):
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)


# -- decode ------------------------------------------------------------------------------


DECODE_CASES = [
    # heads, kv_heads, head_dim, page_size, seq_lens, splits
    (4, 4, 16, 1, [1, 9, 30], 1),  # MHA, a one-token context
    (8, 2, 24, 16, [17, 5, 40], 3),  # GQA 4, odd-ish head dim, pages of 16, split-K
    (8, 1, 20, 1, [33, 2], 4),  # MQA (GQA 8), more splits than a short request has tokens
    (6, 2, 13, 16, [64], 2),  # group 3 (not a power of two), odd head dim, page-aligned
]


@pytest.mark.parametrize("h, hkv, d, page, lens, splits", DECODE_CASES)
def test_decode_attention(h, hkv, d, page, lens, splits):
    k_buf, v_buf, table, rows = paged_pool(lens, hkv, d, page)
    q = torch.randn(len(lens), h, d)
    seq = torch.tensor(lens)
    args = (q, k_buf, v_buf, table, rows, seq, d**-0.5)
    out, lse = decode_attention.decode_attention(*args, num_splits=splits, block_n=16)
    ref, ref_lse = decode_attention.decode_attention_ref(*args)
    close(out, ref)
    close(lse, ref_lse)


def test_decode_attention_half_and_kv_start():
    lens = [19, 7]
    k_buf, v_buf, table, rows = paged_pool(lens, 2, 32, 1, dtype=HALF)
    q = torch.randn(2, 4, 32).to(HALF)
    seq, start = torch.tensor(lens), torch.tensor([5, 0])
    args = (q, k_buf, v_buf, table, rows, seq, 0.2)
    out, lse = decode_attention.decode_attention(*args, kv_start=start, num_splits=2, block_n=16)
    ref, ref_lse = decode_attention.decode_attention_ref(*args, kv_start=start)
    assert out.dtype == HALF
    close(out, ref, HALF)
    close(lse, ref_lse, HALF)


def test_num_splits_for():
    assert decode_attention.num_splits_for(1) == 1
    assert decode_attention.num_splits_for(256) == 1
    assert decode_attention.num_splits_for(257) == 2
    assert decode_attention.num_splits_for(10**6) == 16


# -- extend --------------------------------------------------------------------------------


EXTEND_CASES = [
    # heads, kv_heads, head_dim, page_size, prefix_lens, extend_lens
    (4, 4, 16, 1, [0, 0], [5, 19]),  # no cached prefix at all
    (8, 2, 20, 16, [0, 21, 3], [7, 1, 18]),  # ragged, one empty prefix, a one-token extension
    (8, 1, 15, 1, [16, 5], [17, 2]),  # MQA, odd head dim, an extension past a query block
]


@pytest.mark.parametrize("h, hkv, d, page, prefix, ext", EXTEND_CASES)
def test_extend_attention(h, hkv, d, page, prefix, ext):
    seq = [p + e for p, e in zip(prefix, ext)]
    k_buf, v_buf, table, rows = paged_pool(seq, hkv, d, page)
    q = torch.randn(sum(ext), h, d)
    pre_t, ext_t = torch.tensor(prefix), torch.tensor(ext)
    qo = torch.cumsum(ext_t, 0) - ext_t
    out = extend_attention.extend_attention(
        q, k_buf, v_buf, table, rows, pre_t, ext_t, qo, max(ext), 0.3, block_n=16
    )
    ref = extend_attention.extend_attention_ref(q, k_buf, v_buf, table, rows, pre_t, ext_t, 0.3)
    close(out, ref)


def tree_mask(prefix_len: int, parents: list[int]) -> torch.Tensor:
    """A draft tree's verification mask: node i (parents[i] = index of its parent, -1 for the
    root) sees the whole prefix, its ancestors and itself."""
    n = len(parents)
    mask = torch.zeros(n, prefix_len + n, dtype=torch.bool)
    mask[:, :prefix_len] = True
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, prefix_len + j] = True
            j = parents[j]
    return mask


TREES = [
    [-1],  # the sampled token alone
    [-1, 0, 1, 2],  # a chain (linear drafting: equal to the causal mask)
    [-1, 0, 0, 0, 1, 1, 2],  # branching
    [-1, 0, 1, 0, 3, 3, 5, 2, 7, 0, 9, 10, 4, 6, 8, 11, 12, 13],  # deeper than a query block
]


@pytest.mark.parametrize("h, hkv", [(2, 2), (4, 1)])
def test_tree_mask_attention(h, hkv):
    prefix = [0, 9, 23, 4]
    ext = [len(t) for t in TREES]
    seq = [p + e for p, e in zip(prefix, ext)]
    k_buf, v_buf, table, rows = paged_pool(seq, hkv, 18, 16, seed=1)
    q = torch.randn(sum(ext), h, 18)
    masks = [tree_mask(p, t) for p, t in zip(prefix, TREES)]
    flat, starts = extend_attention.pack_custom_masks(masks, DEV)
    pre_t, ext_t = torch.tensor(prefix), torch.tensor(ext)
    qo = torch.cumsum(ext_t, 0) - ext_t
    out = extend_attention.extend_attention(
        q, k_buf, v_buf, table, rows, pre_t, ext_t, qo, max(ext), 0.25, flat, starts, block_n=16
    )
    ref = extend_attention.extend_attention_ref(
        q, k_buf, v_buf, table, rows, pre_t, ext_t, 0.25, masks
    )
    close(out, ref)
    # a chain's tree mask is the causal mask: the kernel's two paths agree
    chain = slice(int(qo[1]), int(qo[1]) + ext[1])
    causal = extend_attention.extend_attention(
        q, k_buf, v_buf, table, rows, pre_t, ext_t, qo, max(ext), 0.25, block_n=16
    )
    close(out[chain], causal[chain])


# -- shared-prefix (cascade) decode -------------------------------------------------------


def test_cascade_decode_equals_per_request_decode():
    from loom.runtime.attention import shared_prefix

    h, hkv, d, page = 4, 2, 16, 1
    # rows 0-2 fork one 70-token prompt, row 3 is alone, rows 4-5 fork another
    base_a, base_b = 70, 66
    lens = [base_a + 3, base_a + 1, base_a + 5, 12, base_b + 2, base_b + 4]
    k_buf, v_buf, table, rows = paged_pool(lens, hkv, d, page, seed=2)
    for r in rows[1:3].tolist():
        table[r, :base_a] = table[int(rows[0]), :base_a]
    table[int(rows[5]), :base_b] = table[int(rows[4]), :base_b]
    seq = torch.tensor(lens)
    slots = torch.stack([table[int(r), : max(lens)] for r in rows])
    slots = slots.masked_fill(torch.arange(max(lens))[None] >= seq[:, None], 0)
    groups = shared_prefix.find_groups(slots, lens)
    bounds = [(g.start, g.end, len(g.slots)) for g in groups]
    assert [(s, e) for s, e, _ in bounds] == [(0, 3), (4, 6)]
    q = torch.randn(len(lens), h, d)
    out = cascade.cascade_decode_attention(
        q, k_buf, v_buf, table, rows, seq, 0.25, bounds, num_splits=2, block_n=16
    )
    ref, _ = decode_attention.decode_attention_ref(q, k_buf, v_buf, table, rows, seq, 0.25)
    close(out, ref)


def test_merge_states_with_an_empty_part():
    o1, o2 = torch.randn(3, 2, 5), torch.randn(3, 2, 5)
    lse1, lse2 = torch.randn(3, 2), torch.randn(3, 2)
    lse1[0] = float("-inf")
    out = cascade.merge_states(o1, lse1, o2, lse2, torch.float32)
    w1 = torch.exp(lse1 - torch.logaddexp(lse1, lse2))[..., None]
    close(out, o1 * w1 + o2 * (1 - w1))
    close(out[0], o2[0])


# -- KV store, bitmask, norm, rotary -------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_store_kv(dtype):
    k_buf, v_buf = torch.zeros(40, 3, 10, dtype=dtype), torch.zeros(40, 3, 7, dtype=dtype)
    k_ref, v_ref = k_buf.clone(), v_buf.clone()
    slots = torch.tensor([5, 39, 0, 17, 16])
    k, v = torch.randn(5, 3, 10), torch.randn(5, 3, 7)
    kv_store.store_kv(k_buf, v_buf, slots, k, v, block=16)
    kv_store.store_kv_ref(k_ref, v_ref, slots, k, v)
    assert torch.equal(k_buf, k_ref) and torch.equal(v_buf, v_ref)
    kv_store.store_kv(k_buf, v_buf, slots[:0], k[:0], v[:0])  # an empty step is fine


@pytest.mark.parametrize("vocab", [1, 33, 100])
def test_apply_token_bitmask(vocab):
    g = torch.Generator().manual_seed(vocab)
    words = -(-vocab // 32)
    mask = torch.randint(
        -(2**31), 2**31 - 1, (3, words), dtype=torch.int32, generator=g, device="cpu"
    )
    mask = mask.to(DEV)
    mask[1] = -1  # everything allowed
    mask[2, 0] = 0  # the first 32 tokens banned
    logits = torch.randn(3, vocab, generator=g, device="cpu").to(DEV)
    ref = logits.clone()
    bitmask.apply_token_bitmask_(logits, mask, block=32)
    bitmask.apply_token_bitmask_ref(ref, mask)
    assert torch.equal(logits, ref)
    with pytest.raises(ValueError, match="bitmask"):
        bitmask.apply_token_bitmask_(torch.zeros(3, words * 32 + 1), mask)


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("hidden", [24, 37])
def test_rmsnorm(dtype, hidden):
    x = torch.randn(5, hidden).to(dtype)
    res = torch.randn(5, hidden).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden)).to(dtype)
    close(norm.rmsnorm(x, w, 1e-6), norm.rmsnorm_ref(x, w, 1e-6), dtype)
    out, new_res = norm.rmsnorm(x, w, 1e-6, residual=res)
    ref_out, ref_res = norm.rmsnorm_ref(x, w, 1e-6, residual=res)
    assert torch.equal(new_res, ref_res)
    close(out, ref_out, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_rotary_equals_the_layer(dtype):
    from loom.runtime.layers.rotary import RotaryEmbedding

    emb = RotaryEmbedding(
        head_dim=18, max_position=64, base=10000.0, scaling={"rope_type": "yarn", "factor": 2.0}
    )
    positions = torch.tensor([0, 5, 63, 7])
    q, k = torch.randn(4, 6, 18).to(dtype), torch.randn(4, 2, 18).to(dtype)
    rq, rk = rotary.rotary(positions, q, k, emb.cos_cache, emb.sin_cache)
    eq, ek = emb(positions, q, k)
    close(rq, eq, dtype)
    close(rk, ek, dtype)
    with pytest.raises(ValueError, match="head_dim"):
        rotary.rotary(positions, q[..., :17], k[..., :17], emb.cos_cache, emb.sin_cache)


# -- CUDA-graph buckets and padding ------------------------------------------------------


def test_capture_batch_sizes_and_buckets():
    from loom.kernels.cuda_graph import bucket_for, capture_batch_sizes

    assert capture_batch_sizes(1) == [1]
    assert capture_batch_sizes(8) == [1, 2, 4, 8]
    assert capture_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = capture_batch_sizes(64)
    assert sizes[-1] == 64 and sizes == sorted(set(sizes))
    assert [bucket_for(b, sizes) for b in (1, 3, 5, 9, 64, 65)] == [1, 4, 8, 16, 64, None]
    with pytest.raises(ValueError, match="cuda_graph_max_bs"):
        capture_batch_sizes(0)


def test_padded_decode_rows_leave_the_real_rows_unchanged():
    """A batch padded to its bucket by the padding rules gives the real rows the same
    attention output, and its padded rows write only into the padding slot."""
    from loom.kernels.cuda_graph import pad_decode_inputs

    lens = [9, 30, 4]
    k_buf, v_buf, table, rows = paged_pool(lens, 2, 16, 16, seed=3)
    pad_row = next(r for r in range(table.shape[0]) if r not in rows.tolist())
    assert int(table[pad_row, 0]) == 0
    q = torch.randn(3, 4, 16)
    seq = torch.tensor(lens)
    ids, pos, loc = torch.tensor([5, 6, 7]), seq - 1, table[rows, seq - 1]
    pids, ppos, ploc, prows, pseq = pad_decode_inputs(ids, pos, loc, rows, seq, 8, pad_row)
    assert pids.tolist()[3:] == [0] * 5 and ppos.tolist()[3:] == [0] * 5
    assert ploc.tolist()[3:] == [0] * 5 and prows.tolist()[3:] == [pad_row] * 5
    assert pseq.tolist() == lens + [1] * 5
    qp = torch.cat([q, torch.randn(5, 4, 16)])
    before = k_buf.clone()
    kv_store.store_kv(k_buf, v_buf, ploc[3:], torch.randn(5, 2, 16), torch.randn(5, 2, 16))
    assert torch.equal(k_buf[1:], before[1:])  # only slot 0 (padding) was written
    out, _ = decode_attention.decode_attention(qp, k_buf, v_buf, table, prows, pseq, 0.25)
    ref, _ = decode_attention.decode_attention_ref(q, k_buf, v_buf, table, rows, seq, 0.25)
    close(out[:3], ref)
    assert torch.isfinite(out).all()
    with pytest.raises(ValueError, match="does not fit"):
        pad_decode_inputs(ids, pos, loc, rows, seq, 2, pad_row)
