"""The CPU paged decode kernel (runtime/attention/cpu_kernels.py) against plain SDPA per request,
and the cpu_paged backend against the torch backend end to end."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loom.runtime import cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler")


def _reference(q, k_buf, v_buf, table, rows, lens, scale):
    out = []
    for i, (row, n) in enumerate(zip(rows.tolist(), lens.tolist())):
        idx = table[row, :n]
        k = k_buf[idx].float().transpose(0, 1)[None]  # [1, Hkv, n, D]
        v = v_buf[idx].float().transpose(0, 1)[None]
        qi = q[i].float()[None, :, None, :]  # [1, H, 1, D]
        o = F.scaled_dot_product_attention(
            qi, k, v, scale=scale, enable_gqa=q.shape[1] != k_buf.shape[1]
        )
        out.append(o[0, :, 0])
    return torch.stack(out)


def _case(heads, kv_heads, head_dim, v_dim, lens, dtype, seed=0):
    """A pool with scattered slots (as after many allocations and frees) and a table whose
    rows hold ragged lengths; unused table cells hold garbage slot ids the kernel must not read."""
    g = torch.Generator().manual_seed(seed)
    slots_total = 4 * sum(lens) + 8
    k_buf = torch.randn(slots_total, kv_heads, head_dim, generator=g).to(dtype)
    v_buf = torch.randn(slots_total, kv_heads, v_dim, generator=g).to(dtype)
    width = max(lens) + 5
    table = torch.full((len(lens) + 3, width), 10**9, dtype=torch.int64)  # out of range
    perm = torch.randperm(slots_total, generator=g)
    rows = torch.randperm(len(lens) + 3, generator=g)[: len(lens)]
    used = 0
    for row, n in zip(rows.tolist(), lens):
        table[row, :n] = perm[used : used + n]
        used += n
    q = torch.randn(len(lens), heads, head_dim, generator=g).to(dtype)
    return q, k_buf, v_buf, table, rows, torch.tensor(lens, dtype=torch.int64)


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,v_dim",
    [(4, 4, 64, 64), (4, 2, 64, 64), (8, 1, 40, 40), (6, 3, 17, 24)],
)
def test_decode_kernel_matches_sdpa_on_ragged_batches(heads, kv_heads, head_dim, v_dim):
    lens = [1, 7, 130, 33, 2, 64]
    q, k_buf, v_buf, table, rows, lens_t = _case(
        heads, kv_heads, head_dim, v_dim, lens, torch.float32
    )
    scale = head_dim**-0.5
    got = cpu_kernels.decode_attention(
        cpu_kernels.load(), q, k_buf, v_buf, table, rows, lens_t, max(lens), scale
    )
    want = _reference(q, k_buf, v_buf, table, rows, lens_t, scale)
    assert got.shape == (len(lens), heads, v_dim) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def test_decode_kernel_reads_a_bfloat16_pool():
    lens = [5, 90, 1]
    q, k_buf, v_buf, table, rows, lens_t = _case(4, 2, 64, 64, lens, torch.bfloat16, seed=1)
    got = cpu_kernels.decode_attention(
        cpu_kernels.load(), q, k_buf, v_buf, table, rows, lens_t, max(lens), 0.125
    )
    assert got.dtype == torch.bfloat16
    want = _reference(q, k_buf, v_buf, table, rows, lens_t, 0.125)  # f32 math on bf16 values
    torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=1e-2)


def test_decode_kernel_uses_threads_like_one():
    lens = [400, 3, 777, 120, 8, 1000, 1, 550]  # enough work for a team of two
    q, k_buf, v_buf, table, rows, lens_t = _case(4, 2, 32, 32, lens, torch.float32, seed=2)
    lib, threads = cpu_kernels.load(), torch.get_num_threads()
    outs = []
    for n in (1, 2):
        torch.set_num_threads(n)
        try:
            outs.append(
                cpu_kernels.decode_attention(lib, q, k_buf, v_buf, table, rows, lens_t, 1000, 0.2)
            )
        finally:
            torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])  # each (request, kv head) is one thread's work


def test_the_backend_decodes_like_the_torch_backend(tiny_model_dir, monkeypatch):
    """Same greedy tokens and the same output logprobs (within float error) through the
    scheduler, with a batch of ragged prompts, one sharing a long prefix, and page size 4."""
    from tests.runtime_helpers import make_scheduler, run_all, submit

    path = tiny_model_dir("qwen3")
    calls = []
    kernel = cpu_kernels.decode_attention
    monkeypatch.setattr(
        cpu_kernels, "decode_attention", lambda *a, **kw: calls.append(1) or kernel(*a, **kw)
    )
    common = list(range(5, 60))
    prompts = [[7, 8, 9], common + [3], common + [4, 5], list(range(100, 190))]
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    results = {}
    for backend in ("torch", "cpu_paged"):
        # cpu_forward eager: steps of <= 32 tokens would take the compiled C forward instead
        sched = make_scheduler(path, attention_backend=backend, page_size=4, cpu_forward="eager")
        for i, ids in enumerate(prompts):
            submit(sched, f"r{i}", ids, params, return_logprob=True, top_logprobs_num=0)
        results[backend] = run_all(sched)
    assert calls, "no decode step reached the C kernel"
    for rid, ref in results["torch"].items():
        got = results["cpu_paged"][rid]
        assert got.ids == ref.ids and len(ref.ids) == 12
        lp = torch.tensor([x[0] for x in got.output_logprobs])
        want = torch.tensor([x[0] for x in ref.output_logprobs])
        torch.testing.assert_close(lp, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("head_dim", [64, 40])
@pytest.mark.parametrize("tree", [False, True])
def test_bf16_extend_rows_are_decode_steps_bit_for_bit(head_dim, tree):
    """On a bfloat16 pool every row of an extend (a verify step's 1 + drafts: a causal chain,
    or a draft tree's mask) is bitwise the decode kernel's output for that row's query over the
    slots it sees in order: the eager layers' greedy speculation then reads what plain decoding
    reads (a last-bit difference, rounded into the next layer's bf16 K / V, is a whole unit)."""
    from loom.runtime.model_runner import tree_mask

    prefix, ext = 37, 9
    q, k_buf, v_buf, table, rows, _ = _case(6, 2, head_dim, head_dim, [prefix + ext],
                                            torch.bfloat16, seed=4)  # fmt: skip
    q = torch.randn(ext, 6, head_dim, generator=torch.Generator().manual_seed(5))
    mask = tree_mask(prefix, [-1, 0, -1, 1, 2, 3, 3, 5], "cpu") if tree else None
    plan = cpu_kernels.ExtendPlan.build([prefix + ext], [ext], [mask])
    lib, scale = cpu_kernels.load(), head_dim**-0.5
    got = cpu_kernels.extend_attention(lib, q, k_buf, v_buf, table, rows, plan, scale)
    slots = table[rows[0], : prefix + ext]
    for j in range(ext):
        seen = mask[j] if tree else torch.arange(prefix + ext) <= prefix + j
        one = slots[seen][None].contiguous()
        want = cpu_kernels.decode_attention(
            lib, q[j : j + 1], k_buf, v_buf, one, torch.zeros(1, dtype=torch.int64),
            torch.tensor([one.shape[1]]), one.shape[1], scale,
        )  # fmt: skip
        assert torch.equal(got[j], want[0]), (j, float((got[j] - want[0]).abs().max()))
