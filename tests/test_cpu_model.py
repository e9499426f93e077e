"""runtime/cpu_model.py, the C forward over numpy arrays (no torch), against runtime/cpu_forward.py,
the same C function over loom's torch model, on the real GGUF files: the same logits bit for bit
and the same KV written, step by step; and a process that runs it never imports torch."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from loom.runtime import cpu_abi
from loom.runtime.cpu_model import ArrayForward
from loom.runtime.model_runner import ModelRunner
from loom.runtime.server_args import ServerArgs
from tests.runtime_helpers import run_child

pytestmark = pytest.mark.skipif(cpu_abi.load() is None, reason="no C compiler")

PROMPTS = [[1, 504, 3458, 282, 4649, 314, 2, 198, 47, 30, 11, 99], [1, 1205, 42, 7]]


def _steps(n_decode: int):
    """(ids, positions, slots, rows, seq_lens, extend_lens, logit_rows) of a two-request
    prefill, then decode steps whose tokens are fixed (teacher-forced: both sides see the same
    inputs whatever their logits). Request r takes req_to_token row r + 1, slots from 100 * r + 7."""
    lens = [len(p) for p in PROMPTS]
    base = [7, 107]
    yield ([t for p in PROMPTS for t in p], [j for n in lens for j in range(n)],
           [b + j for b, n in zip(base, lens) for j in range(n)], [1, 2], lens, lens,
           [lens[0] - 1, sum(lens) - 1])  # fmt: skip
    for step in range(n_decode):
        pos = [n + step for n in lens]
        yield ([17 + step, 300 + step], pos, [b + q for b, q in zip(base, pos)], [1, 2],
               [q + 1 for q in pos], [1, 1], [0, 1])  # fmt: skip


@pytest.mark.parametrize("name", ["smollm2", "gemma3-270m"])
@pytest.mark.parametrize("kv", ["float32", "bf16"])
def test_numpy_binding_equals_the_torch_binding_bit_for_bit(real_gguf, name, kv):
    path = real_gguf(name)
    runner = ModelRunner(ServerArgs(model_path=path, max_total_tokens=512, kv_cache_dtype=kv))
    cf = runner.cpu_forward
    assert cf is not None
    rot = runner.model.model.layers[0].self_attn.rotary_emb
    rows = rot.cos_cache.shape[0]
    af = ArrayForward(path, kv_rows=512, max_reqs=4, kv_dtype=kv, rotary_rows=rows)
    # numpy's float32 pow / cos / sin differ from torch's in the last bit here and there
    # (~2e-5 at most): the rotary tables agree within that, so the logits within rounding;
    # with torch's tables copied into the numpy binding's arrays they are the same bits
    swaps = []
    for i, lay in enumerate(runner.model.model.layers):
        key = af.cfg.local_rope if af.cfg.gemma and af.cfg.sliding[i] else af.cfg.global_rope
        for mine, theirs in zip(af._tables[key], (lay.self_attn.rotary_emb.cos_cache,
                                                   lay.self_attn.rotary_emb.sin_cache)):  # fmt: skip
            np.testing.assert_allclose(mine, theirs.numpy(), rtol=0, atol=1e-4)
            swaps.append((mine, theirs.numpy()))
    table = runner.req_to_token_pool.req_to_token
    for r, base in ((1, 7), (2, 107)):
        table[r, :64] = torch.arange(base, base + 64)
        af.req_to_token[r, :64] = np.arange(base, base + 64)
    threads = torch.get_num_threads()
    refs = []
    for ids, pos, slots, rws, seq, ext, want in _steps(3):
        batch = SimpleNamespace(
            seq_lens_cpu=seq, extend_lens_cpu=ext, custom_masks=None, capture=None, prompt=False,
            input_ids=torch.tensor(ids), positions=torch.tensor(pos),
            out_cache_loc=torch.tensor(slots), req_pool_indices=torch.tensor(rws),
            req_to_token_pool=runner.req_to_token_pool, logits_indices=torch.tensor(want),
        )  # fmt: skip
        refs.append(cf(batch).numpy())
        got = af(ids, pos, slots, rws, seq, ext, want, nthreads=threads)
        assert np.array_equal(refs[-1].argmax(-1), got.argmax(-1))
        # float32 pool: Gemma's logits reach ~70 (measured 2.8e-2 apart on an AVX2 CPU, AMD
        # Zen 3, whose numpy sin / cos differ more from torch's than on AVX-512); a bfloat16
        # pool rounds K / V to 8 bits, where a table's last-bit difference moves a stored value
        # by 2^-8 now and then. The bit-for-bit check below, with torch's tables, is exact.
        tol = 5e-2 if kv == "float32" else 0.5
        np.testing.assert_allclose(got, refs[-1], rtol=1e-3, atol=tol)
    for mine, theirs in swaps:
        mine[:] = theirs
    for ref, (ids, pos, slots, rws, seq, ext, want) in zip(refs, _steps(3)):
        got = af(ids, pos, slots, rws, seq, ext, want, nthreads=threads)
        assert np.array_equal(ref, got), float(np.abs(ref - got).max())
    pool = runner.token_to_kv_pool  # torch.empty: compare the slots the steps wrote
    written = sorted({s for _, _, slots, *_ in _steps(3) for s in slots})
    for i in (0, len(af.k) - 1):
        for ref, mine in ((pool.k_buffers[i], af.k[i]), (pool.v_buffers[i], af.v[i])):
            ref = ref[written]
            ref = ref.view(torch.int16).numpy().view(np.uint16) if kv == "bf16" else ref.numpy()
            assert np.array_equal(ref, mine[written])


_NO_TORCH = """
import sys
from loom.runtime.cpu_model import ArrayForward
f = ArrayForward(sys.argv[1], kv_rows=256, max_reqs=4, kv_dtype=sys.argv[2])
print(f.greedy([[1, 504, 3458, 282, 4649, 314, 2], [1, 1205, 42, 7]], 6, nthreads=1))
assert "torch" not in sys.modules, "torch was imported"
"""


def test_greedy_without_torch_equals_the_scheduler(real_gguf, monkeypatch):
    """A process that builds the numpy binding and decodes greedily never imports torch, and
    its tokens are the scheduler's (the torch path) on the same file and pool dtype."""
    monkeypatch.setenv("LOOM_TORCH_RUNNER", "1")  # else the scheduler runs ArrayRunner
    from loom.runtime.scheduler.scheduler import Scheduler
    from tests.runtime_helpers import run_all, submit

    path = real_gguf("smollm2")
    got = eval(run_child(_NO_TORCH, path, "bf16")[-1])
    sched = Scheduler(ServerArgs(model_path=path, max_total_tokens=512, kv_cache_dtype="bf16"))
    ids = [[1, 504, 3458, 282, 4649, 314, 2], [1, 1205, 42, 7]]
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    for i, p in enumerate(ids):
        submit(sched, str(i), p, params)
    outs = run_all(sched)
    assert [outs[str(i)].ids for i in range(len(ids))] == got
