"""`--attention-backend triton` end to end on the CPU through Triton's interpreter: greedy
outputs equal to the torch backend's on a short ragged batch (prefill, decode, then two
requests extending one radix-cached prefix and decoding through the shared-prefix kernel),
with pages of 1 slot, and with pages of 16 under NGRAM speculative decoding with draft trees
(verified through the kernel's custom-mask path)."""

from __future__ import annotations

import pytest
import torch

from loom.kernels.interpret import load_interpreted
from tests.runtime_helpers import greedy, make_scheduler, run_all, submit

PROMPTS = {
    "a": list(range(5, 25)),
    "b": [7, 9, 11, 13, 200, 3, 4],
    "c": [(i * 37) % 300 + 3 for i in range(21)],
    "d": [5, 6, 7, 8] * 6,  # repeats, so the n-gram trie drafts
    "e": [(i * 11) % 300 + 3 for i in range(72)],
}
TREES = {
    "speculative_algorithm": "NGRAM",
    "speculative_ngram_max_bfs_breadth": 4,
    "speculative_num_draft_tokens": 8,
    "speculative_disable_by_batch_size": 64,
}
# both share e's cached KV (64+ slots), so their decode rows form a shared-prefix group
FOLLOW_UPS = {"e2": PROMPTS["e"] + [40, 41, 42], "e3": PROMPTS["e"] + [50]}


def generate(path: str, **kwargs) -> dict:
    sched = make_scheduler(path, **kwargs)
    for rid, ids in PROMPTS.items():
        submit(sched, rid, ids, greedy(8))
    first = run_all(sched)
    for rid, ids in FOLLOW_UPS.items():
        submit(sched, rid, ids, greedy(4))
    second = run_all(sched)
    assert min(second[r].cached_tokens for r in FOLLOW_UPS) >= 64, "should extend e's cache"
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
    from loom.kernels import cascade, extend_attention

    masked, groups = [], []
    kernel = extend_attention.extend_attention

    def counting(*args, **kwargs):
        masked.append(len(args) > 10 and args[10] is not None)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(extend_attention, "extend_attention", counting)
    shared = cascade.cascade_decode_attention

    def grouping(*args, **kwargs):
        groups.append(args[7])
        return shared(*args, **kwargs)

    monkeypatch.setattr(cascade, "cascade_decode_attention", grouping)
    out = generate(tiny_model_dir("llama"), attention_backend="triton", page_size=page_size, **spec)
    assert out == reference
    assert any(masked) == bool(spec), "draft trees go through the custom-mask path"
    if not spec:  # (with drafts the follow-ups verify trees rather than decode)
        assert groups, "the follow-ups' decode steps take the shared-prefix kernel"


def test_triton_refused_on_the_cpu_without_the_interpreter(monkeypatch):
    from loom.runtime.server_args import ServerArgs

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="^attention_backend: 'triton' .*needs CUDA"):
        ServerArgs(attention_backend="triton", device="cpu")
