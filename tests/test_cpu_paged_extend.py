"""The CPU paged extend kernel (several query rows per request: short extends and draft-tree
verify steps, runtime/cpu_kernels.py) against plain SDPA with the same masks, and the cpu_paged
backend's extend path against the torch backend end to end."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loom.runtime import cpu_kernels
from loom.runtime.model_runner import tree_mask

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler")


def _pool(kv_heads, head_dim, v_dim, lens, dtype, g):
    """A pool with scattered slots and a table of ragged rows; unused table cells hold slot ids
    out of range, which the kernel must not read."""
    slots_total = 4 * sum(lens) + 8
    k_buf = torch.randn(slots_total, kv_heads, head_dim, generator=g).to(dtype)
    v_buf = torch.randn(slots_total, kv_heads, v_dim, generator=g).to(dtype)
    table = torch.full((len(lens) + 3, max(lens) + 5), 10**9, dtype=torch.int64)
    perm = torch.randperm(slots_total, generator=g)
    rows = torch.randperm(len(lens) + 3, generator=g)[: len(lens)]
    used = 0
    for row, n in zip(rows.tolist(), lens):
        table[row, :n] = perm[used : used + n]
        used += n
    return k_buf, v_buf, table, rows


def _reference(q, k_buf, v_buf, table, rows, lens, exts, masks, scale):
    out, start = [], 0
    for row, n, e, m in zip(rows.tolist(), lens, exts, masks):
        idx = table[row, :n]
        k = k_buf[idx].float().transpose(0, 1)  # [Hkv, n, D]
        v = v_buf[idx].float().transpose(0, 1)
        if m is None:  # causal: new row j sits at position n - e + j
            m = torch.arange(n)[None, :] <= torch.arange(e)[:, None] + (n - e)
        qi = q[start : start + e].float().transpose(0, 1)  # [H, e, D]
        o = F.scaled_dot_product_attention(
            qi, k, v, attn_mask=m, scale=scale, enable_gqa=q.shape[1] != k_buf.shape[1]
        )
        out.append(o.transpose(0, 1))
        start += e
    return torch.cat(out)


# draft trees as parent lists (-1: child of the last real token)
CHAIN = [-1, 0, 1, 2]
BUSHY = [-1, -1, -1, 0, 0, 1, 3, 6]
SINGLE = [-1]


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,v_dim",
    [(4, 2, 64, 64), (4, 4, 64, 64), (8, 1, 40, 40), (6, 3, 17, 24)],
)
def test_tree_masks_and_causal_rows_match_sdpa(heads, kv_heads, head_dim, v_dim):
    """A ragged batch mixing tree verify rows (three tree shapes) with plain causal extends."""
    g = torch.Generator().manual_seed(heads * 100 + head_dim)
    prefixes = [9, 130, 1, 40, 0]
    trees = [CHAIN, BUSHY, SINGLE, None, None]
    causal_exts = {3: 5, 4: 3}  # a short extend after a prefix, and a whole 3-token prompt
    lens, exts, masks = [], [], []
    for i, (prefix, tree) in enumerate(zip(prefixes, trees)):
        if tree is None:
            e = causal_exts[i]
            masks.append(None)
        else:
            e = 1 + len(tree)
            masks.append(tree_mask(prefix, tree, "cpu"))
        lens.append(prefix + e)
        exts.append(e)
    k_buf, v_buf, table, rows = _pool(kv_heads, head_dim, v_dim, lens, torch.float32, g)
    q = torch.randn(sum(exts), heads, head_dim, generator=g)
    plan = cpu_kernels.ExtendPlan.build(lens, exts, masks)
    scale = head_dim**-0.5
    got = cpu_kernels.extend_attention(
        cpu_kernels.load(), q, k_buf, v_buf, table, rows, plan, scale
    )
    want = _reference(q, k_buf, v_buf, table, rows, lens, exts, masks, scale)
    assert got.shape == (sum(exts), heads, v_dim)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def test_a_bfloat16_pool_and_a_row_that_sees_nothing():
    g = torch.Generator().manual_seed(3)
    lens, exts = [12, 70], [4, 9]
    masks = [tree_mask(lens[0] - 4, [-1, 0, 0], "cpu"), None]
    k_buf, v_buf, table, rows = _pool(2, 64, 64, lens, torch.bfloat16, g)
    q = torch.randn(sum(exts), 4, 64, generator=g)
    lib = cpu_kernels.load()
    got = cpu_kernels.extend_attention(
        lib, q, k_buf, v_buf, table, rows, cpu_kernels.ExtendPlan.build(lens, exts, masks), 0.125
    )
    want = _reference(q, k_buf, v_buf, table, rows, lens, exts, masks, 0.125)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)  # f32 math on bf16 values
    blind = masks[0].clone()
    blind[2] = False  # SDPA would give NaN here; the kernel gives zeros
    plan = cpu_kernels.ExtendPlan.build(lens, exts, [blind, None])
    got = cpu_kernels.extend_attention(lib, q, k_buf, v_buf, table, rows, plan, 0.125)
    assert torch.equal(got[2], torch.zeros_like(got[2])) and torch.isfinite(got).all()


def test_a_mask_of_the_wrong_shape_is_refused():
    with pytest.raises(ValueError, match="custom mask of shape"):
        cpu_kernels.ExtendPlan.build([10], [3], [torch.ones(3, 9, dtype=torch.bool)])


def test_tree_verify_and_short_extends_match_the_torch_backend(monkeypatch, tiny_model_dir):
    """NGRAM draft trees on a tiny Qwen3 (GQA 4/2), page sizes 1 and 4, batches of several
    requests: the verify steps and the short extends after a cached prompt go through the C
    kernel, with the same greedy tokens and logprobs as the torch backend's SDPA path."""
    from tests.runtime_helpers import greedy, make_scheduler, run_all, submit

    path = tiny_model_dir("qwen3")
    calls = {"masked": 0, "causal": 0}
    kernel = cpu_kernels.extend_attention

    def counting(lib, q, k_buf, v_buf, table, rows, plan, scale):
        calls["masked" if (plan.mask_off >= 0).any() else "causal"] += 1
        return kernel(lib, q, k_buf, v_buf, table, rows, plan, scale)

    monkeypatch.setattr(cpu_kernels, "extend_attention", counting)
    texts = [
        "The quick brown fox jumps over the lazy dog. The quick brown fox",
        "Repeat after me: red green blue, red green blue, red green",
    ]
    # then prompts that extend the last one by a few tokens, together: short extends
    tails = [" blue", " yellow", " blue green red"]
    spec = {"speculative_algorithm": "NGRAM", "speculative_ngram_max_bfs_breadth": 4}
    results = {}
    for backend, page_size in (("torch", 1), ("cpu_paged", 1), ("cpu_paged", 4)):
        sched = make_scheduler(  # cpu_forward eager: small steps would take the C forward
            path,
            attention_backend=backend,
            page_size=page_size,
            cpu_forward="eager",
            **spec,
        )
        res = results[f"{backend}{page_size}"] = {}
        for i, text in enumerate(texts):
            submit(sched, f"r{i}", sched.tokenizer.encode(text), greedy(12), return_logprob=True)
        res.update(run_all(sched))
        for i, tail in enumerate(tails):
            ids = sched.tokenizer.encode(texts[-1] + tail)
            submit(sched, f"t{i}", ids, greedy(12), return_logprob=True)
        res.update(run_all(sched))
        assert sched.get_state()["spec_verify_ct"] > 0
    assert calls["masked"] > 0 and calls["causal"] > 0, calls
    assert len(results["torch1"]) == len(texts) + len(tails)
    for rid, ref in results["torch1"].items():
        for got in (results["cpu_paged1"][rid], results["cpu_paged4"][rid]):
            assert got.ids == ref.ids and len(ref.ids) == 12
            lp = torch.tensor([x[0] for x in got.output_logprobs])
            want = torch.tensor([x[0] for x in ref.output_logprobs])
            torch.testing.assert_close(lp, want, atol=1e-4, rtol=0)
