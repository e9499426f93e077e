"""Shared-prefix (cascade) decode attention against plain per-request attention."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from loom.runtime.attention import shared_prefix as sp


def _rows(rows: list[list[int]]) -> tuple[torch.Tensor, list[int]]:
    width = max(len(r) for r in rows)
    slots = torch.zeros(len(rows), width, dtype=torch.int64)
    for i, r in enumerate(rows):
        slots[i, : len(r)] = torch.tensor(r)
    return slots, [len(r) for r in rows]


def test_groups_are_runs_of_rows_sharing_a_long_prefix(monkeypatch):
    monkeypatch.setattr(sp, "MIN_SHARED_TOKENS", 4)
    common = list(range(100, 110))
    rows = [
        list(range(1, 20)),  # alone
        common + [1, 2],
        common + [3],
        common[:6] + [4, 5, 6, 7],  # shares 6 with the previous row: same group, prefix 6
        list(range(200, 205)),  # alone
        common + [9],
        common,  # a prefix ends before each member's last token
    ]
    slots, lens = _rows(rows)
    groups = sp.find_groups(slots, lens)
    assert [(g.start, g.end, g.slots.tolist()) for g in groups] == [
        (1, 4, common[:6]),
        (5, 7, common[:9]),
    ]
    assert sp.find_groups(slots[:1], lens[:1]) == []
    short = [[1, 2, 3], [1, 2, 3, 4]]  # under the threshold: no group
    assert sp.find_groups(*_rows(short)) == []


def _reference(q, k_buf, v_buf, rows, scale):
    """Each request alone through SDPA, as the plain decode path does."""
    outs = []
    for i, r in enumerate(rows):
        idx = torch.tensor(r)
        k = k_buf[idx].transpose(0, 1)[None]  # [1, Hkv, L, D]
        v = v_buf[idx].transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(
            q[i : i + 1, :, None], k, v, scale=scale, enable_gqa=True
        )
        outs.append(o[:, :, 0])
    return torch.cat(outs)


class _Pool:
    def __init__(self, k_buf, v_buf):
        self.k, self.v = k_buf, v_buf

    def set_kv(self, layer_id, slots, k, v):
        self.k[slots], self.v[slots] = k, v

    def get_kv(self, layer_id):
        return self.k, self.v


def _decode_batch(rows, k_buf, v_buf):
    """A decode ForwardBatch stand-in: row i of the request table holds rows[i]; the last
    slot of each row is the token computed now."""
    from loom.runtime.forward_batch import ForwardMode

    slots, lens = _rows(rows)
    table = torch.zeros(len(rows) + 1, slots.shape[1] + 8, dtype=torch.int64)
    table[1:, : slots.shape[1]] = slots
    return SimpleNamespace(
        mode=ForwardMode.DECODE,
        req_to_token_pool=SimpleNamespace(req_to_token=table),
        req_pool_indices=torch.arange(1, len(rows) + 1),
        seq_lens=torch.tensor(lens),
        seq_lens_cpu=lens,
        token_to_kv_pool=_Pool(k_buf, v_buf),
        out_cache_loc=torch.tensor([r[-1] for r in rows]),
        attn_metadata=None,
    )


def test_cascade_decode_equals_per_request_attention(monkeypatch):
    from loom.runtime.attention.torch_backend import TorchAttnBackend

    monkeypatch.setattr(sp, "MIN_SHARED_TOKENS", 32)

    torch.manual_seed(0)
    heads, kv_heads, dim, pool = 4, 2, 16, 400
    k_buf = torch.randn(pool, kv_heads, dim)
    v_buf = torch.randn(pool, kv_heads, dim)
    prefix_a = list(range(10, 90))  # 80 shared slots
    prefix_b = list(range(100, 140))
    rows = [
        list(range(300, 340)),  # in no group
        prefix_a + [200],
        prefix_a + [201, 202, 203],
        prefix_a + [204, 205],
        list(range(350, 353)),  # in no group, short
        prefix_b + [206, 207],
        prefix_b + [208],
    ]
    batch = _decode_batch(rows, k_buf, v_buf)
    backend = TorchAttnBackend()
    backend.init_forward_metadata(batch)
    plan = batch.attn_metadata.shared
    assert plan.rows.tolist() == [1, 2, 3, 5, 6] and plan.single_rows.tolist() == [0, 4]
    assert [(g.start, g.end, len(g.slots)) for g in plan.groups] == [(0, 3, 80), (3, 5, 40)]
    assert plan.suffix_mask.sum(1).tolist() == [1, 3, 2, 2, 1]  # only what follows the prefix
    assert plan.single_mask.sum(1).tolist() == [40, 3]
    scale = dim**-0.5
    layer = SimpleNamespace(layer_id=0, scaling=scale, is_gqa=True)
    q = torch.randn(len(rows), heads, dim)
    k_new, v_new = k_buf[batch.out_cache_loc].clone(), v_buf[batch.out_cache_loc].clone()
    got = backend.forward_decode(q, k_new, v_new, layer, batch)
    want = _reference(q, k_buf, v_buf, rows, scale)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # half-precision KV is read at the queries' precision, as the plain path does
    k16, v16 = k_buf.half(), v_buf.half()
    got16 = sp.decode_attention(
        q[plan.rows], k16, v16, plan.suffix, plan.suffix_mask, plan.groups, scale
    )
    want16 = _reference(q, k16.float(), v16.float(), rows, scale)[plan.rows]
    torch.testing.assert_close(got16, want16, rtol=1e-4, atol=1e-4)


def test_forked_requests_decode_as_they_would_alone(tiny_model_dir):
    """End to end: 6 requests sharing a 120-token prompt decode through the shared-prefix
    path (checked), next to one unrelated request, and produce the tokens each produces
    alone (greedy)."""
    import random

    from tests.runtime_helpers import greedy, make_scheduler, run_all, submit

    rng = random.Random(5)
    shared = [rng.randrange(3, 320) for _ in range(120)]
    prompts = {f"b{i}": shared + [10 + i, 20 + i] for i in range(6)}
    prompts["lone"] = [rng.randrange(3, 320) for _ in range(150)]
    model = tiny_model_dir("llama")
    # the eager forward: the compiled CPU forward (--cpu-forward auto) runs its own attention
    # for steps of <= 32 tokens and never reaches the backend's shared-prefix path
    sched = make_scheduler(model, cpu_forward="eager")
    used = []  # per decode step: did it take the shared-prefix path?
    init = sched.runner.attn_backend.init_forward_metadata

    def init_and_note(batch):
        init(batch)
        if batch.mode.is_decode:
            used.append(batch.attn_metadata.shared is not None)

    sched.runner.attn_backend.init_forward_metadata = init_and_note
    submit(sched, "warm", shared, {"max_new_tokens": 0})
    run_all(sched)
    for rid, ids in prompts.items():
        submit(sched, rid, ids, greedy(12))
    together = run_all(sched)
    assert any(used)
    for rid, ids in prompts.items():
        alone = make_scheduler(model, disable_radix_cache=True)
        submit(alone, rid, ids, greedy(12))
        assert run_all(alone)[rid].ids == together[rid].ids, rid
