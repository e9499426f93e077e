"""`--attention-backend triton` end to end on the CPU through Triton's interpreter: greedy
outputs equal to the torch backend's on a short ragged batch (prefill, decode, then an extend
over a radix-cached prefix), with pages of 1 slot, and with pages of 16 under NGRAM
speculative decoding with draft trees (verified through the kernel's custom-mask path)."""

from __future__ import annotations

import pytest
import torch

from loom.kernels import load_interpreted
from tests.runtime_helpers import greedy, make_scheduler, run_all, submit

PROMPTS = {
    "a": list(range(5, 25)),
    "b": [7, 9, 11, 13, 200, 3, 4],
    "c": [(i * 37) % 300 + 3 for i in range(33)],
    "d": [5, 6, 7, 8] * 6,  # repeats, so the n-gram trie drafts
}
TREES = {
    "speculative_algorithm": "NGRAM",
    "speculative_ngram_max_bfs_breadth": 4,
    "speculative_num_draft_tokens": 8,
    "speculative_disable_by_batch_size": 64,
}
FOLLOW_UP = PROMPTS["a"] + [40, 41, 42]  # its first 20 tokens are in the radix cache


def generate(path: str, **kwargs) -> dict:
    sched = make_scheduler(path, **kwargs)
    for rid, ids in PROMPTS.items():
        submit(sched, rid, ids, greedy(8))
    first = run_all(sched)
    submit(sched, "a2", FOLLOW_UP, greedy(4))
    second = run_all(sched)
    assert second["a2"].cached_tokens >= 16, "the follow-up should extend a cached prefix"
    return {rid: r.ids for rid, r in {**first, **second}.items()}


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return generate(tiny_model_dir("llama"), attention_backend="torch")


@pytest.mark.parametrize("page_size, spec", [(1, {}), (16, TREES)], ids=["page1", "page16-trees"])
def test_triton_backend_greedy_equals_torch(
    tiny_model_dir, reference, monkeypatch, page_size, spec
):
    if not torch.cuda.is_available():
        load_interpreted("decode_attention")  # the backend's kernels, built for the interpreter
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # ServerArgs admits triton on the CPU so
    from loom.kernels import extend_attention

    masked = []
    kernel = extend_attention.extend_attention

    def counting(*args, **kwargs):
        masked.append(len(args) > 10 and args[10] is not None)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(extend_attention, "extend_attention", counting)
    out = generate(tiny_model_dir("llama"), attention_backend="triton", page_size=page_size, **spec)
    assert out == reference
    assert any(masked) == bool(spec), "draft trees go through the custom-mask path"


def test_triton_refused_on_the_cpu_without_the_interpreter(monkeypatch):
    from loom.runtime.server_args import ServerArgs

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="^attention_backend: 'triton' .*needs CUDA"):
        ServerArgs(attention_backend="triton", device="cpu")
