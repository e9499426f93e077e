"""`--attention-backend triton` end to end on the CPU through Triton's interpreter: greedy
outputs equal to the torch backend's on a short ragged batch (prefill, decode, then an extend
over a radix-cached prefix), with pages of 1 and 16 slots."""

from __future__ import annotations

import pytest
import torch

from loom.kernels import load_interpreted
from tests.runtime_helpers import greedy, make_scheduler, run_all, submit

PROMPTS = {
    "a": list(range(5, 25)),
    "b": [7, 9, 11, 13, 200, 3, 4],
    "c": [(i * 37) % 300 + 3 for i in range(33)],
}
FOLLOW_UP = PROMPTS["a"] + [40, 41, 42]  # its first 20 tokens are in the radix cache


def generate(path: str, **kwargs) -> dict:
    sched = make_scheduler(path, **kwargs)
    for rid, ids in PROMPTS.items():
        submit(sched, rid, ids, greedy(6))
    first = run_all(sched)
    submit(sched, "a2", FOLLOW_UP, greedy(4))
    second = run_all(sched)
    assert second["a2"].cached_tokens >= 16, "the follow-up should extend a cached prefix"
    return {rid: r.ids for rid, r in {**first, **second}.items()}


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return generate(tiny_model_dir("llama"), attention_backend="torch")


@pytest.mark.parametrize("page_size", [1, 16])
def test_triton_backend_greedy_equals_torch(tiny_model_dir, reference, monkeypatch, page_size):
    if not torch.cuda.is_available():
        load_interpreted("decode_attention")  # the backend's kernels, built for the interpreter
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # ServerArgs admits triton on the CPU so
    out = generate(tiny_model_dir("llama"), attention_backend="triton", page_size=page_size)
    assert out == reference


def test_triton_refused_on_the_cpu_without_the_interpreter(monkeypatch):
    from loom.runtime.server_args import ServerArgs

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="^attention_backend: 'triton' .*needs CUDA"):
        ServerArgs(attention_backend="triton", device="cpu")
