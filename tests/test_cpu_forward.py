"""The compiled CPU forward (runtime/cpu_forward.py) against the eager modules: logits and the
KV it writes on ragged extend, cached-prefix extend, decode and draft-tree verify steps of every
covered family, over a float32 and a bfloat16 KV pool (--kv-cache-dtype bf16: the eager side
with the same pool); greedy generations equal end to end (page sizes 1 and 4, tree drafts); the
fallbacks and the flag."""

from __future__ import annotations

import contextlib
import ctypes

import pytest
import torch

from loom.runtime import cpu_forward
from loom.runtime.attention.base import create_attention_backend
from loom.runtime.attention.torch_backend import _ExtendMeta, causal_mask
from loom.runtime.cpu_forward import _ptr
from loom.runtime.forward_batch import ForwardBatch, ForwardMode, forward_context
from loom.runtime.model_runner import ModelRunner, tree_mask
from loom.runtime.server_args import BUNDLED_MODEL_PATH, ServerArgs
from tests.runtime_helpers import make_scheduler, run_all, submit

pytestmark = pytest.mark.skipif(cpu_forward.load() is None, reason="no C compiler")

FAMILIES = ["llama", "llama-mqa", "qwen2", "qwen3", "gemma3"]  # llama: llama3 rope scaling;
# qwen3: q/k norm; gemma3: one sliding layer (window 8, past it from the second step), one global
KV_DTYPES = ["auto", "bf16"]  # --kv-cache-dtype: the model's float32, or a bfloat16 pool


def _runner(path: str, **kw) -> ModelRunner:
    return ModelRunner(ServerArgs(model_path=path, dtype="float32", max_total_tokens=4096, **kw))


def _bf16_int4_bi_runner(path: str, isa: str, monkeypatch) -> ModelRunner:
    """A bfloat16 pool, int4 weights with the batch-invariant matmul (a row's products the
    same in a step of any size), the C forward of build `isa`; the process-wide matmul mode
    the runner sets is restored after the test."""
    from loom.runtime.layers import quant_ops

    monkeypatch.setattr(quant_ops, "DEFAULT_MODE", quant_ops.DEFAULT_MODE)  # the runner sets it
    runner = _runner(path, kv_cache_dtype="bf16", quantization="int4",
                     quantized_matmul="batch-invariant")  # fmt: skip
    if isa != "native":
        runner.cpu_forward.lib = cpu_forward.load(isa)
    return runner


class _Steps:
    """Requests with scattered KV slots in one runner's pools; `batch` builds one step."""

    def __init__(self, runner: ModelRunner, n_req: int, seed: int):
        self.r, self.g = runner, torch.Generator().manual_seed(seed)
        self.rows = torch.randperm(runner.req_to_token_pool.req_to_token.shape[0] - 1)[:n_req]
        self.free = (torch.randperm(3000, generator=self.g) + 8).tolist()
        self.lens = [0] * n_req

    def batch(
        self, reqs, ext, mode, masks=None, all_logits=True, ids=None, depths=None
    ) -> ForwardBatch:
        """`ids`: the step's token ids (default random); `depths`: each request's tokens'
        positions after its prefix (default 0, 1, ...; a draft tree's node depths)."""
        r, table = self.r, self.r.req_to_token_pool.req_to_token
        given, ids, pos, slots, seq, pre = ids, [], [], [], [], []
        for k, (i, e) in enumerate(zip(reqs, ext)):
            new = [self.free.pop() for _ in range(e)]
            table[self.rows[i], self.lens[i] : self.lens[i] + e] = torch.tensor(new)
            if given is None:
                ids += torch.randint(0, r.vocab_size, (e,), generator=self.g).tolist()
            d = range(e) if depths is None or depths[k] is None else depths[k]
            pos += [self.lens[i] + x for x in d]
            slots += new
            pre.append(self.lens[i])
            self.lens[i] += e
            seq.append(self.lens[i])
        ids = ids if given is None else list(given)
        t = len(ids)
        logit_rows = list(range(t)) if all_logits else [t - 1]
        return ForwardBatch(
            mode=mode, input_ids=torch.tensor(ids), positions=torch.tensor(pos),
            out_cache_loc=torch.tensor(slots), req_pool_indices=self.rows[list(reqs)].clone(),
            seq_lens=torch.tensor(seq), seq_lens_cpu=seq, prefix_lens_cpu=pre,
            req_to_token_pool=r.req_to_token_pool, token_to_kv_pool=r.token_to_kv_pool,
            attn_backend=create_attention_backend("torch"),
            logits_indices=torch.tensor(logit_rows), custom_masks=masks,
        )  # fmt: skip


def _compare(
    runner: ModelRunner, batch: ForwardBatch, capture=None, tol=1e-4, kv_tol=1e-5
) -> float:
    """Eager (torch backend) and C logits and written KV agree; the C KV stays in the pool.
    `capture`: the layers whose features both keep (`ForwardBatch.capture`); tol / kv_tol:
    rtol = atol of the logits / the KV (a real model's 18 layers grow float32 rounding).
    Returns the largest logit difference."""
    pool = runner.token_to_kv_pool
    before = [b.clone() for b in pool.k_buffers + pool.v_buffers]
    batch.attn_backend.init_forward_metadata(batch)
    meta = batch.attn_metadata
    if pool.k_buffers[0].dtype != torch.float32 and isinstance(meta, _ExtendMeta):
        # The C forward reads every K / V row back from the pool, a prompt's own included;
        # the torch backend attends to a prompt without a cached prefix from the step's
        # float32 K / V directly. The reference here reads the pool too: that prompt's causal
        # mask spelled out sends it through the pool's (rounded) rows.
        meta.masks = [
            causal_mask(0, e, "cpu") if m is None else m
            for m, e in zip(meta.masks, meta.extend_lens)
        ]
    batch.capture, batch.captured = capture, None
    with forward_context(batch):
        want = runner.model(batch.input_ids, batch.positions)
    want_cap, batch.captured = batch.captured, None
    eager_kv = [b.clone() for b in pool.k_buffers + pool.v_buffers]
    for b, old in zip(pool.k_buffers + pool.v_buffers, before):
        b.copy_(old)
    assert runner.cpu_forward.covers(batch)
    got = runner.cpu_forward(batch)
    assert got.shape == want.shape and got.dtype == torch.float32
    # a 16-bit pool: C's and eager's float32 K / V (1e-6 apart) round to different bfloat16
    # values in a few elements (one unit, 2^-8 relative; checked below), which the later
    # layers carry into the logits (measured up to 8.6e-4 on these models on an AVX-512 CPU,
    # and 2.9e-3 in 2 of 15,744 logits on an AVX2 one, AMD Zen 3, where torch's eager float32
    # kernels round differently and more values straddle a boundary)
    if pool.k_buffers[0].dtype != torch.float32:
        tol = max(tol, 4e-3)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    # the same greedy token, but where eager's top two are a tie within the tolerance (the
    # random tiny models have such rows; one on the AVX2 CPU above)
    top2 = want.topk(2, dim=-1).values
    tie = top2[:, 0] - top2[:, 1] <= 2 * tol
    assert torch.equal(got.argmax(-1)[~tie], want.argmax(-1)[~tie])
    if capture is not None:  # a drafter's features: final hidden + inner layers'
        (hid, aux), (want_hid, want_aux) = batch.captured, want_cap
        torch.testing.assert_close(hid, want_hid, rtol=1e-4, atol=1e-4)
        assert len(aux) == len(want_aux) == len(capture)
        for a, ref in zip(aux, want_aux):
            torch.testing.assert_close(a, ref, rtol=1e-4, atol=1e-4)
    for b, ref in zip(pool.k_buffers + pool.v_buffers, eager_kv):
        if b.dtype == torch.float32:
            torch.testing.assert_close(b, ref, rtol=kv_tol, atol=kv_tol, equal_nan=True)
            continue
        # a 16-bit pool: both sides round the float32 K / V to nearest even, so the bits are
        # the same except where C's and eager's float32 values (1e-6 apart) straddle a rounding
        # boundary: one unit in the last place there, and in later layers a few more where
        # such a unit has moved their inputs (measured 4.6e-5 on a 1.5e-3 value). Truncating
        # instead of rounding would differ in about half of the elements.
        assert b.dtype == ref.dtype == torch.bfloat16
        torch.testing.assert_close(b.float(), ref.float(), rtol=2**-7, atol=1e-4, equal_nan=True)
        mine = batch.out_cache_loc
        bits, want_bits = b[mine].view(torch.int16), ref[mine].view(torch.int16)
        assert (bits == want_bits).float().mean() > 0.9  # measured >= 0.988 on a step's slots
    return float((got - want).abs().max())


@pytest.mark.parametrize("kv", KV_DTYPES)
@pytest.mark.parametrize("family", FAMILIES)
@torch.inference_mode()
def test_logits_and_kv_match_eager_on_every_kind_of_step(tiny_model_dir, family, kv):
    runner = _runner(tiny_model_dir(family), kv_cache_dtype=kv)
    assert runner.cpu_forward is not None
    st = _Steps(runner, 4, seed=len(family))
    _compare(runner, st.batch([0, 1, 2], [5, 1, 9], ForwardMode.EXTEND))  # ragged prompts
    _compare(runner, st.batch([0, 1, 2, 3], [3, 2, 1, 4], ForwardMode.EXTEND))  # after prefixes
    # long extends after prefixes take the blocked attention (>= 8 tokens; 70 > one 64-row
    # query chunk) beside per-token ones
    _compare(runner, st.batch([0, 1, 2, 3], [1, 12, 70, 2], ForwardMode.EXTEND))
    for _ in range(2):
        _compare(runner, st.batch([0, 1, 2, 3], [1] * 4, ForwardMode.DECODE, all_logits=False))
    # draft-tree verify rows beside a causal chain: the mask layout of ModelRunner.tree_mask
    trees = {0: [-1, -1, 0, 1], 2: [-1, 0, 0]}
    masks = [tree_mask(st.lens[i], trees[i], "cpu") if i in trees else None for i in range(3)]
    _compare(runner, st.batch([0, 1, 2], [5, 3, 4], ForwardMode.EXTEND, masks))


@pytest.mark.parametrize("kv", KV_DTYPES)
@pytest.mark.parametrize("family", ["llama-d64", "llama-d128", "llama-d256", "llama-mha"])
@torch.inference_mode()
def test_one_token_decode_attention_matches_eager(tiny_model_dir, family, kv):
    """forward.c's one-token decode attention (attn_one: head_dim 64 / 128, groups of up to 4
    query heads; head_dim 256 one query head a pass; K / V rows prefetched and read once; a
    bfloat16 pool's rows widened in registers) beside the per-token loop for the shapes it
    leaves (llama-mha: head_dim 16): decode steps over scattered slots and contexts from 1 to
    past ONE_PF + 60 columns, against eager."""
    runner = _runner(tiny_model_dir(family), kv_cache_dtype=kv)
    st = _Steps(runner, 3, seed=7)
    _compare(runner, st.batch([0, 1, 2], [1, 2, 60], ForwardMode.EXTEND))
    for _ in range(3):
        _compare(runner, st.batch([0, 1, 2], [1] * 3, ForwardMode.DECODE, all_logits=False))


# (loom_block_attn_min, loom_small_attn_max): the default (small_attention for 2-32 tokens),
# the packed block_attention for every multi-token request, the per-token loop for all
ATTN_PATHS = {"small": (2, 32), "packed": (2, 0), "per-token": (1000, 0)}


@contextlib.contextmanager
def _attn_knobs(runner: ModelRunner, block_min: int, small_max: int):
    """The C attention's path knobs set for the block, then restored."""
    lib, old = runner.cpu_forward.lib, []
    for name, value in (("loom_block_attn_min", block_min), ("loom_small_attn_max", small_max)):
        knob = ctypes.c_int.in_dll(lib, name)
        old.append((knob, knob.value))
        knob.value = value
    try:
        yield
    finally:
        for knob, value in old:
            knob.value = value


@pytest.mark.parametrize("kv", KV_DTYPES)
@pytest.mark.parametrize("block_min, small_max", [(1, 0), (1000, 0), (1000, 1000)])
@pytest.mark.parametrize("family", ["llama-mqa", "qwen3", "gemma3"])
@torch.inference_mode()
def test_attention_paths_match_eager(tiny_model_dir, family, block_min, small_max, kv):
    """The three attention paths on every kind of step: every request through the blocked
    (packed-matmul) path, single tokens included (block_min 1), every token through the
    per-token loop (1000, 0), or every multi-token request, the 70-token one included, through
    small_attention (1000, 1000); the default is the test above."""
    runner = _runner(tiny_model_dir(family), kv_cache_dtype=kv)
    with _attn_knobs(runner, block_min, small_max):
        st = _Steps(runner, 4, seed=11)
        _compare(runner, st.batch([0, 1, 2], [5, 1, 9], ForwardMode.EXTEND))
        _compare(runner, st.batch([0, 1, 2, 3], [1, 12, 70, 2], ForwardMode.EXTEND))
        _compare(runner, st.batch([0, 1, 2, 3], [1] * 4, ForwardMode.DECODE, all_logits=False))
        # a tree whose second row sees only the prefix and the root; 16-token chain drafts
        trees = {0: [-1, -1, 0, 1], 2: list(range(-1, 14))}
        masks = [tree_mask(st.lens[i], trees[i], "cpu") if i in trees else None for i in range(3)]
        _compare(runner, st.batch([0, 1, 2], [5, 3, 16], ForwardMode.EXTEND, masks))


@pytest.mark.parametrize("kv", KV_DTYPES)
@pytest.mark.parametrize("path", list(ATTN_PATHS))
# groups 1, 2, 4; gemma3: window 8, so trees and chains past it AND the window into the mask
@pytest.mark.parametrize("family", ["llama-mha", "qwen3", "llama-mqa", "gemma3"])
@torch.inference_mode()
def test_verify_sized_attention_matches_eager(tiny_model_dir, family, path, kv):
    """Requests of 2-16 tokens (a verify step's 1 + drafts) after odd prefixes, as causal
    chains and as draft trees, beside a decode token, through each attention path (the
    default, "small", is also checked to be the default): logits and KV as eager's."""
    runner = _runner(tiny_model_dir(family), kv_cache_dtype=kv)
    assert ctypes.c_int.in_dll(runner.cpu_forward.lib, "loom_small_attn_max").value == 32
    with _attn_knobs(runner, *ATTN_PATHS[path]):
        st = _Steps(runner, 3, seed=5)
        _compare(runner, st.batch([0, 1, 2], [7, 13, 21], ForwardMode.EXTEND))
        g = torch.Generator().manual_seed(3)
        for n in range(2, 17):
            parents = [int(torch.randint(-1, i, (1,), generator=g)) for i in range(n - 1)]
            masks = [None, tree_mask(st.lens[1], parents, "cpu"), None]
            _compare(runner, st.batch([0, 1, 2], [n, n, 1], ForwardMode.EXTEND, masks))


@pytest.mark.parametrize("isa", ["native", "avx2"])
@pytest.mark.parametrize("family", ["llama", "llama-mqa", "llama-d128", "qwen3", "gemma3"])
@torch.inference_mode()
def test_bf16_pool_verify_rows_are_the_decode_steps_bit_for_bit(
    tiny_model_dir, monkeypatch, family, isa
):
    """On a bfloat16 pool every row of a verify step (a causal chain of drafts, and a draft
    tree whose one branch is that chain) gives the logits and writes the K / V bits that
    decoding the same tokens one step at a time gives: greedy speculation then equals plain
    decoding. Rounding K / V to bfloat16 turns a last-bit difference between two attention
    summation orders into a whole bf16 step of the next layer's K / V (on SmolLM2's Q4_1
    target greedy NGRAM left plain decoding at the 7th token). gemma3: window 8, so the later
    rows' windows start inside the prompt; avx2: the build without AVX-512, whose decode
    attention is the per-token loop. The weights int4 with the batch-invariant matmul
    (a row's products the same in a step of any size: what the matmuls must give for the
    attention to be the only difference left)."""
    runner = _bf16_int4_bi_runner(tiny_model_dir(family), isa, monkeypatch)
    cf, pool = runner.cpu_forward, runner.token_to_kv_pool
    st = _Steps(runner, 3, seed=13)
    prompt = torch.randint(0, runner.vocab_size, (11,), generator=st.g).tolist()
    drafts = torch.randint(0, runner.vocab_size, (7,), generator=st.g).tolist()
    for i in range(3):
        cf(st.batch([i], [11], ForwardMode.EXTEND, ids=prompt))
    decoded, dec_slots = [], []
    for d in drafts:  # request 0: plain decoding
        batch = st.batch([0], [1], ForwardMode.DECODE, ids=[d], all_logits=False)
        decoded.append(cf(batch)[0])
        dec_slots.append(int(batch.out_cache_loc[0]))
    chain = st.batch([1], [7], ForwardMode.EXTEND, ids=drafts)  # request 1: one verify
    # request 2: a tree (row 0 the last real token) whose chain node k >= 1 is row 2k - 1,
    # each with a sibling (row 2k) under the same parent
    parents, ids, depths = [], [drafts[0]], [0]
    for k in range(1, 7):
        parent = 2 * k - 4 if k > 1 else -1  # tree_mask's node index (row - 1)
        parents += [parent, parent]
        ids += [drafts[k], (drafts[k] + 1 + k) % runner.vocab_size]
        depths += [k, k]
    tree = st.batch([2], [13], ForwardMode.EXTEND, [tree_mask(11, parents, "cpu")], ids=ids,
                    depths=[depths])  # fmt: skip
    for batch, rows in ((chain, list(range(7))), (tree, [0] + list(range(1, 13, 2)))):
        got = cf(batch)
        for k, r in enumerate(rows):
            assert torch.equal(got[r], decoded[k]), (k, float((got[r] - decoded[k]).abs().max()))
        mine = batch.out_cache_loc[rows]
        for b in pool.k_buffers + pool.v_buffers:
            assert torch.equal(b[mine].view(torch.int16), b[dec_slots].view(torch.int16))


@pytest.mark.parametrize("isa", ["native", "avx2"])
@pytest.mark.parametrize("family", ["llama", "llama-mqa", "llama-d128", "qwen3", "gemma3"])
@torch.inference_mode()
def test_bf16_pool_cached_prefix_and_chunks_equal_a_whole_prefill_bit_for_bit(
    tiny_model_dir, family, isa, monkeypatch
):
    """On a bfloat16 pool a prompt gives the same logits and K / V bits however its prefill is
    split: whole (one 80-token extend: past small_attention's 32 rows and one 64-row query
    chunk), after a cached prefix (a first request's 50 or 20 tokens in the pool, then the
    other 30 / 60, the radix cache's case), or in chunks of 16 or 40 (--chunked-prefill-size).
    Each row attends as its token's decode step would, so the split cannot move a sum; on this
    pool a last-bit difference becomes a whole bf16 step of the next layer's K / V (SmolLM2's
    tool_choice="auto" answer in tests/test_tools_real.py lost its call after a cached prefix).
    The weights int4 with the batch-invariant matmul, as in the verify test above."""
    runner = _bf16_int4_bi_runner(tiny_model_dir(family), isa, monkeypatch)
    cf, pool = runner.cpu_forward, runner.token_to_kv_pool
    splits = [[80], [50, 30], [20, 60], [16] * 5, [40, 40], [79, 1]]
    st = _Steps(runner, len(splits), seed=21)
    prompt = torch.randint(0, runner.vocab_size, (80,), generator=st.g).tolist()
    rows, slots = [], []
    for i, split in enumerate(splits):
        got, mine, done = [], [], 0
        for n in split:
            batch = st.batch([i], [n], ForwardMode.EXTEND, ids=prompt[done : done + n])
            got.append(cf(batch))
            mine.append(batch.out_cache_loc)
            done += n
        rows.append(torch.cat(got))
        slots.append(torch.cat(mine))
    for i in range(1, len(splits)):
        diff = float((rows[i] - rows[0]).abs().max())
        assert torch.equal(rows[i], rows[0]), (splits[i], diff)
        for b in pool.k_buffers + pool.v_buffers:
            assert torch.equal(b[slots[i]].view(torch.int16), b[slots[0]].view(torch.int16))


@pytest.mark.parametrize("weights", ["int4-bi", "float"])
@pytest.mark.parametrize("isa", ["native", "avx2"])
@pytest.mark.parametrize("family", ["llama", "llama-mqa", "qwen3", "gemma3"])
@torch.inference_mode()
def test_bf16_pool_step_in_parts_equals_the_whole_step_bit_for_bit(
    tiny_model_dir, family, isa, weights, monkeypatch
):
    """On a bfloat16 pool a long step runs as parts of at most loom_step_rows rows (forward.c:
    a 4,096-token prefill's scratch was ~100 MB) with the logits and K / V bits of the whole
    step: three requests after cached prefixes, 80 tokens cut into five parts of 16 (two
    requests split across parts), every row's logits and then the last row's only (the LM
    head runs once over the logit rows either way). gemma3: window 8, so parts start past
    it. The same tokens go to two sets of requests, one step whole, one in parts."""
    if weights == "int4-bi":
        runner = _bf16_int4_bi_runner(tiny_model_dir(family), isa, monkeypatch)
    else:
        runner = _runner(tiny_model_dir(family), kv_cache_dtype="bf16")
        if isa != "native":
            runner.cpu_forward.lib = cpu_forward.load(isa)
    cf, pool = runner.cpu_forward, runner.token_to_kv_pool
    knob = ctypes.c_int.in_dll(cf.lib, "loom_step_rows")
    assert knob.value == 512
    st = _Steps(runner, 6, seed=13)
    g = torch.Generator().manual_seed(4)
    ids = [torch.randint(0, runner.vocab_size, (n,), generator=g).tolist() for n in (13, 80, 80)]
    out = {}
    try:
        for side, (reqs, rows) in {"whole": ([0, 1, 2], 0), "parts": ([3, 4, 5], 16)}.items():
            knob.value = rows
            got, mine = [], []
            steps = [([3, 9, 1], ids[0], True), ([30, 5, 45], ids[1], True),
                     ([45, 30, 5], ids[2], False)]  # fmt: skip
            for ext, tok, all_logits in steps:
                batch = st.batch(reqs, ext, ForwardMode.EXTEND, ids=tok, all_logits=all_logits)
                got.append(cf(batch))
                mine.append(batch.out_cache_loc)
            out[side] = got, torch.cat(mine)
    finally:
        knob.value = 512
    (whole, s0), (parts, s1) = out["whole"], out["parts"]
    for a, b in zip(whole, parts):
        assert torch.equal(a, b), float((a - b).abs().max())
    for buf in pool.k_buffers + pool.v_buffers:
        assert torch.equal(buf[s0].view(torch.int16), buf[s1].view(torch.int16))


@torch.inference_mode()
def test_attention_paths_agree_on_a_row_that_sees_nothing(tiny_model_dir):
    """A mask row with no visible column (eager gives NaN there) gets zero attention, so the
    same logits on every path, and the other rows are unchanged by it."""
    runner = _runner(tiny_model_dir("qwen3"))
    st = _Steps(runner, 1, seed=9)
    _compare(runner, st.batch([0], [11], ForwardMode.EXTEND))
    mask = tree_mask(st.lens[0], [-1, 0, 1, 1, -1], "cpu")
    blank = mask.clone()
    blank[3] = False
    batch = st.batch([0], [6], ForwardMode.EXTEND, [blank])
    out = {}
    for path in ATTN_PATHS:
        with _attn_knobs(runner, *ATTN_PATHS[path]):
            out[path] = runner.cpu_forward(batch)
    assert torch.isfinite(out["per-token"]).all()
    for path in ("small", "packed"):
        torch.testing.assert_close(out[path], out["per-token"], rtol=1e-5, atol=1e-5)
    batch.custom_masks = [mask]
    seen = runner.cpu_forward(batch)
    rows = [0, 1, 2, 4, 5]  # no row sees row 3 (node 2 has no descendants): only it differs
    torch.testing.assert_close(out["small"][rows], seen[rows], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out["small"][3], seen[3])


@pytest.mark.parametrize("family", ["llama", "qwen3", "bundled"])
@torch.inference_mode()
def test_eagle3_aux_captures_match_eager(tiny_model_dir, family):
    """EAGLE-3's features (the residual stream after inner layers, in capture order, a layer
    named twice as eager does) and the final hidden states come back from C as eager's."""
    runner = _runner(BUNDLED_MODEL_PATH if family == "bundled" else tiny_model_dir(family))
    st = _Steps(runner, 2, seed=7)
    cap = (1, 0, 1)
    _compare(runner, st.batch([0, 1], [6, 3], ForwardMode.EXTEND), cap)
    _compare(runner, st.batch([0, 1], [1, 1], ForwardMode.DECODE, all_logits=False), cap)
    masks = [tree_mask(st.lens[0], [-1, 0, 0, 1], "cpu"), None]
    _compare(runner, st.batch([0, 1], [5, 2], ForwardMode.EXTEND, masks), cap)


@pytest.fixture(scope="module")
def bundled_pair():
    return {m: make_scheduler(BUNDLED_MODEL_PATH, cpu_forward=m) for m in ("eager", "auto")}


def _generate(sched, prompts, n=10):
    for i, ids in enumerate(prompts):
        submit(sched, f"r{i}", ids, {"max_new_tokens": n, "temperature": 0, "ignore_eos": True})
    return {k: v.ids for k, v in run_all(sched).items()}


def test_bundled_greedy_batch_equals_eager(bundled_pair):
    """A ragged batch (a 40-token prompt through the blocked attention) prefilled and decoded
    in C, then with a step limit below the prefill so it runs eager and decodes in C; the same
    greedy tokens as eager throughout."""
    fast = bundled_pair["auto"].runner.cpu_forward
    assert fast is not None
    prompts = [[5, 6, 7], [9] * 40, [11, 12, 13, 14, 15, 16]]
    want = _generate(bundled_pair["eager"], prompts)
    assert _generate(bundled_pair["auto"], prompts) == want
    fast.max_tokens = 32
    try:
        assert _generate(bundled_pair["auto"], prompts) == want
    finally:
        fast.max_tokens = cpu_forward.MAX_TOKENS


def test_gemma3_greedy_past_the_window_equals_eager(tiny_model_dir):
    """Gemma 3 (one sliding layer of window 8, one global, soft-capped logits) generating 16
    tokens after prompts of 3-20 tokens, batched: the C forward's greedy tokens are eager's."""
    path = tiny_model_dir("gemma3")
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6, 9, 11, 13, 2, 3, 4, 8, 10, 12, 14, 16, 18], [30, 31, 32]]
    prompts.append(list(range(40, 52)))
    out = {}
    for mode in ("eager", "auto"):
        sched = make_scheduler(path, cpu_forward=mode)
        assert (sched.runner.cpu_forward is not None) == (mode == "auto")
        out[mode] = _generate(sched, prompts, n=16)
    assert out["eager"] == out["auto"]


@pytest.mark.parametrize("page_size, kv", [(1, "auto"), (4, "auto"), (4, "bf16")])
def test_tree_drafts_and_pages_give_eager_tokens(tiny_model_dir, monkeypatch, page_size, kv):
    """NGRAM draft trees (breadth 4) verified through the C forward: greedy tokens equal to
    the eager forward's, at page sizes 1 and 4, and over a bfloat16 pool (both sides)."""
    from loom.runtime.spec import speculator

    monkeypatch.setattr(speculator, "extra_cost", lambda batch_size, longest: 0.0)
    path = tiny_model_dir("qwen3")
    spec = dict(
        speculative_algorithm="NGRAM",
        speculative_ngram_max_bfs_breadth=4,
        speculative_disable_by_batch_size=64,
        page_size=page_size,
        kv_cache_dtype=kv,
    )
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [30, 31, 32, 30, 31], [40] * 6]
    out = {}
    for mode in ("eager", "auto"):
        sched = make_scheduler(path, cpu_forward=mode, **spec)
        out[mode] = _generate(sched, prompts, n=16)
        assert sched.get_state()["spec_verify_ct"] > 0
    assert out["eager"] == out["auto"]


@pytest.mark.parametrize(
    "family,kw,why",
    [
        ("qwen3-moe", {}, "is not the SiLU-gated dense MLP"),
        ("llama", {"dtype": "bfloat16"}, "weights are not float32"),
    ],
)
def test_uncovered_models_run_eager(tiny_model_dir, caplog, family, kw, why):
    with caplog.at_level("INFO", logger="loom.runtime.cpu_forward"):
        runner = ModelRunner(
            ServerArgs(model_path=tiny_model_dir(family), max_total_tokens=2048, **kw)
        )
    assert runner.cpu_forward is None
    assert why in caplog.text


def test_bf16_pool_runs_in_c_and_other_pools_are_refused(tiny_model_dir):
    """--kv-cache-dtype bf16 with float32 weights takes the C forward (it stores and reads the
    bfloat16 pool itself); a pool of another dtype (float16: no flag makes one today), or one
    mixing dtypes across layers, is named and left to eager."""
    runner = _runner(tiny_model_dir("llama"), kv_cache_dtype="bf16")
    pool = runner.token_to_kv_pool
    assert runner.cpu_forward is not None and pool.k_buffers[0].dtype == torch.bfloat16
    assert runner.cpu_forward._struct.kv_bf16 == 1
    assert _runner(tiny_model_dir("llama")).cpu_forward._struct.kv_bf16 == 0

    def why(k_buffers):
        fake = type("Pool", (), {"k_buffers": k_buffers, "v_buffers": pool.v_buffers})()
        return cpu_forward.unsupported(runner.model, fake, tp_size=1, pp_size=1)

    assert why(pool.k_buffers) is None
    assert "not float32 or bfloat16" in why([b.half() for b in pool.k_buffers])
    assert "not float32 or bfloat16" in why([b.float() for b in pool.k_buffers])


def test_bundled_greedy_over_a_bf16_pool_equals_eager():
    """The bundled model with a bfloat16 pool: the same greedy tokens from the C forward as
    from the eager layers (cpu_paged's bf16 kernels) over the same pool, and output logprobs
    within 5e-3 of them (measured 1.3e-3; bf16's own error against a float32 pool is ~5e-3,
    tests/test_kv_dtype.py). Not closer: the eager layers attend to a prompt without a cached
    prefix from its unrounded K / V, the C forward from the pool's rounded rows."""
    prompts = [[5, 6, 7], [9] * 40, [11, 12, 13, 14, 15, 16]]
    out = {}
    for mode in ("eager", "auto"):
        sched = make_scheduler(BUNDLED_MODEL_PATH, cpu_forward=mode, kv_cache_dtype="bf16")
        assert (sched.runner.cpu_forward is None) == (mode == "eager")
        for i, ids in enumerate(prompts):
            submit(
                sched, f"r{i}", ids, {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True},
                return_logprob=True,
            )  # fmt: skip
        out[mode] = run_all(sched)
    for i in range(len(prompts)):
        got, want = out["auto"][f"r{i}"], out["eager"][f"r{i}"]
        assert got.ids == want.ids, i
        a = torch.tensor([lp for lp, *_ in got.output_logprobs])
        b = torch.tensor([lp for lp, *_ in want.output_logprobs])
        torch.testing.assert_close(a, b, atol=5e-3, rtol=0)


def test_flag_and_backend_choose_eager(tiny_model_dir):
    path = tiny_model_dir("llama")
    assert _runner(path, cpu_forward="eager").cpu_forward is None
    assert _runner(path, attention_backend="torch").cpu_forward is None
    with pytest.raises(ValueError, match=r"^cpu_forward: must be one of"):
        ServerArgs(model_path=path, cpu_forward="fast")
    import argparse

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    assert (
        ServerArgs.from_cli_args(parser.parse_args(["--cpu-forward", "eager"])).cpu_forward
        == "eager"
    )
    with pytest.raises(SystemExit):  # argparse's choices
        parser.parse_args(["--cpu-forward", "fast"])


@torch.inference_mode()
def test_large_steps_and_eagle_capture_fall_back_and_bad_input_is_an_error(tiny_model_dir):
    runner = _runner(tiny_model_dir("llama"))
    st = _Steps(runner, 2, seed=1)
    runner.cpu_forward.max_tokens = 16
    big = st.batch([0], [17], ForwardMode.EXTEND)
    assert not runner.cpu_forward.covers(big)
    small = st.batch([1], [2], ForwardMode.EXTEND)
    small.capture = (0, 2)  # a layer the model lacks: eager (and its error)
    assert not runner.cpu_forward.covers(small)
    small.capture = None
    runner.cpu_forward.profile = prof = torch.zeros(2, dtype=torch.float64)
    runner.cpu_forward(small)  # the benchmark's split: CPU seconds in matmuls, in attention
    assert prof[0] > 0 and prof[1] > 0
    runner.cpu_forward.profile = None
    small.positions[0] = 10**6
    with pytest.raises(IndexError, match="rotary table"):
        runner.cpu_forward(small)
    small.positions[0] = 0
    small.input_ids[0] = runner.vocab_size
    with pytest.raises(IndexError, match="vocabulary"):
        runner.cpu_forward(small)


def _has_avx512f() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return " avx512f" in f.read()
    except OSError:
        return False


@pytest.mark.parametrize("isa", ["native", "avx2"])
def test_isa_variants_build_as_asked(isa):
    """ "native" is AVX-512 exactly where the CPU reports avx512f; "avx2" never is."""
    lib = cpu_forward.load(isa)
    want = 512 if isa == "native" and _has_avx512f() else 256
    assert lib.loom_isa_bits() == want


@pytest.mark.parametrize("isa", ["native", "avx2"])
@pytest.mark.parametrize("k,n", [(256, 1000), (20, 7), (688, 256), (45, 37), (1, 17)])
def test_matmul_kernels_match_linear(k, n, isa):
    """Both matmuls every projection uses, on odd shapes (K not a multiple of the SIMD width
    or of the accumulator sets' k unroll, N not of the 4-row tile or the 16-row panel) at every
    token count 1..70 (every split into passes of up to 16 (AVX-512) / 6 (AVX2) tokens), with
    and without bias, in both instruction-set variants: the row-major dot-product tiles, and
    the packed panels with the weights as cpu_forward.pack lays them out."""
    g = torch.Generator().manual_seed(k * n)
    x, w, b = (
        torch.randn(70, k, generator=g),
        torch.randn(n, k, generator=g),
        torch.randn(n, generator=g),
    )
    lib, wp = cpu_forward.load(isa), cpu_forward.pack(w)
    assert wp.shape == (-(-n // 16), k, 16) and torch.equal(wp[0, :, : min(n, 16)], w[:16].T)
    refs = {bias is None: torch.nn.functional.linear(x, w, bias) for bias in (None, b)}
    for t in range(1, 71):
        for fn, weights in ((lib.loom_linear_f32, w), (lib.loom_linear_packed_f32, wp)):
            for bias in (None, b) if t in (1, 2, 3, 7, 13, 70) else (b,):
                y = torch.full((t, n), float("nan"))
                threads = 2 if t == 70 else 1  # the OpenMP split over tiles / panels
                fn(x.data_ptr(), t, k, weights.data_ptr(), _ptr(bias), n, y.data_ptr(), threads)
                torch.testing.assert_close(y, refs[bias is None][:t], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kv", KV_DTYPES)
@torch.inference_mode()
@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_avx2_variant_forward_matches_eager(tiny_model_dir, family, kv):
    """The whole forward built without AVX-512 (the path of CPUs without it) on every kind of
    step, as the native build is in the test above, over both pools."""
    runner = _runner(tiny_model_dir(family), kv_cache_dtype=kv)
    runner.cpu_forward.lib = cpu_forward.load("avx2")
    st = _Steps(runner, 4, seed=3)
    _compare(runner, st.batch([0, 1, 2], [5, 1, 9], ForwardMode.EXTEND))
    _compare(runner, st.batch([0, 1, 2, 3], [1, 12, 70, 2], ForwardMode.EXTEND))
    _compare(runner, st.batch([0, 1, 2, 3], [1] * 4, ForwardMode.DECODE, all_logits=False))
    masks = [tree_mask(st.lens[0], [-1, -1, 0, 1], "cpu"), None]
    _compare(runner, st.batch([0, 1], [5, 7], ForwardMode.EXTEND, masks))


@pytest.mark.parametrize("kv", KV_DTYPES)
# head_dim 16 / 32 / 64 / 128 / 256, GQA groups 1-4; gemma3: window 8 (compacted columns)
@pytest.mark.parametrize(
    "family", ["llama-mha", "llama-mqa", "llama-d64", "llama-d128", "llama-d256", "gemma3"]
)
@torch.inference_mode()
def test_avx2_one_token_attention_is_the_per_token_loop_bit_for_bit(tiny_model_dir, family, kv):
    """attn_avx2.c (forward.c attn_one in AVX2 builds: decode tokens, and on a bfloat16 pool
    every row, as query-row tiles of loom_attn_rows rows: 8, the default, 5, and 1, one row at
    a time) against attn_items' per-token loop (the knob loom_attn_avx2 = 0), in the AVX2
    build: the same logits and K / V bits on prompts (77 rows: 9 tiles of 8 and one of 5; a
    window's rows: runs that start past column 0), decode steps over contexts of 1 to ~90
    columns (not multiples of 8 among them) and draft-tree verify steps; the one-row kernel
    with its K rows prefetched one block ahead, its own rows only (the older kernel) and 64
    rows ahead, kv head 0 fetching whole slots (the default: the first blocks before its loop,
    contexts shorter and longer than that)."""
    runner = _runner(tiny_model_dir(family), kv_cache_dtype=kv)
    runner.cpu_forward.lib = cpu_forward.load("avx2")
    cf, pool = runner.cpu_forward, runner.token_to_kv_pool
    knob = ctypes.c_int.in_dll(cf.lib, "loom_attn_avx2")
    rows = ctypes.c_int.in_dll(cf.lib, "loom_attn_rows")
    ahead = ctypes.c_int.in_dll(cf.lib, "loom_attn_avx2_ahead")
    slots = ctypes.c_int.in_dll(cf.lib, "loom_attn_avx2_slots")
    assert knob.value == 1 and rows.value == 8 and ahead.value == 64 and slots.value == 1
    st = _Steps(runner, 3, seed=21)

    def both(batch: ForwardBatch) -> None:
        before = [b.clone() for b in pool.k_buffers + pool.v_buffers]
        out = []
        # (loom_attn_avx2, loom_attn_rows, loom_attn_avx2_ahead, loom_attn_avx2_slots)
        for value, tile, rows_ahead, whole in (
            (0, 8, 64, 1), (1, 8, 64, 1), (1, 5, 64, 1), (1, 1, 64, 1), (1, 1, 8, 0), (1, 8, 8, 0)
        ):  # fmt: skip
            for b, old in zip(pool.k_buffers + pool.v_buffers, before):
                b.copy_(old)
            knob.value, rows.value, ahead.value, slots.value = value, tile, rows_ahead, whole
            try:
                logits = cf(batch)
            finally:
                knob.value, rows.value, ahead.value, slots.value = 1, 8, 64, 1
            out.append((logits, [b.clone() for b in pool.k_buffers + pool.v_buffers]))
        l0, kv0 = out[0]
        for l1, kv1 in out[1:]:
            assert torch.equal(l0, l1), float((l0 - l1).abs().max())
            for a, b in zip(kv0, kv1):  # as bits: the pool's unwritten slots may hold NaNs
                bits = torch.int32 if a.dtype == torch.float32 else torch.int16
                assert torch.equal(a.view(bits), b.view(bits))

    both(st.batch([0, 1, 2], [1, 7, 77], ForwardMode.EXTEND))
    for _ in range(10):
        both(st.batch([0, 1, 2], [1] * 3, ForwardMode.DECODE, all_logits=False))
    masks = [None, tree_mask(st.lens[1], [-1, 0, 0, 1], "cpu"), None]
    both(st.batch([0, 1, 2], [3, 5, 1], ForwardMode.EXTEND, masks))


@pytest.mark.parametrize("isa", ["native", "avx2"])
def test_verify_tiles_and_the_old_split_match_linear(isa):
    """loom_f32_verify_tiles: on AVX2 a 7- or 8-token packed matmul is one pass (an 8-token
    pass spills an accumulator), where the old split (knob 0) ran 4 + 3 and 4 + 4; both, and
    the AVX-512 build (which has no such case), give linear's result (with bias) on odd
    shapes, SmolLM2's QKV among them."""
    lib = cpu_forward.load(isa)
    knob = ctypes.c_int.in_dll(lib, "loom_f32_verify_tiles")
    old = knob.value
    try:
        for k, n in ((576, 960), (45, 37), (1, 17)):
            g = torch.Generator().manual_seed(k + n)
            w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
            wp = cpu_forward.pack(w)
            for t in (6, 7, 8, 9):
                x = torch.randn(t, k, generator=g)
                want = torch.nn.functional.linear(x, w, b)
                for tiles in (1, 0):
                    knob.value = tiles
                    y = torch.full((t, n), float("nan"))
                    lib.loom_linear_packed_f32(
                        x.data_ptr(), t, k, wp.data_ptr(), b.data_ptr(), n, y.data_ptr(), 1
                    )
                    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4)
    finally:
        knob.value = old
