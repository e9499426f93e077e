"""The EAGLE-3 head shipped for SmolLM2-135M-Instruct (runtime/bundled/eagle/smollm2-135m-eagle3,
trained by scripts/train_eagle3_smollm2.py on the model's self-distilled chats): it loads for the
real model, and greedy EAGLE-3 speculation on the Q4_1 GGUF (`--quantized-matmul
batch-invariant`) gives plain decoding's tokens while accepting drafted tokens."""

from __future__ import annotations

from pathlib import Path

import torch

from loom.runtime.layers import quant_ops
from loom.runtime.spec.eagle_drafter import BUNDLED_HEADS

HEAD = BUNDLED_HEADS / "smollm2-135m-eagle3"


def test_shipped_head_is_small_and_eagle3():
    from loom.runtime.spec.eagle import read_head_config

    cfg = read_head_config(HEAD)
    assert cfg.architectures == ["LlamaForCausalLMEagle3"]
    size = sum(f.stat().st_size for f in Path(HEAD).glob("*.safetensors"))
    assert size <= 25 * 2**20, size  # the shipped-head limit (bf16)


def test_smollm2_eagle3_greedy_equals_plain(real_gguf, monkeypatch):
    from loom.runtime.spec import speculator
    from tests.runtime_helpers import batch_invariant_scheduler, run_chats

    monkeypatch.setattr(quant_ops, "DEFAULT_MODE", "auto")  # the flag below must set "bi"
    # verify every draft: the cost model would skip verify steps and test less
    monkeypatch.setattr(speculator, "extra_cost", lambda batch_size, longest: 0.0)
    path = str(real_gguf("smollm2"))
    asks = ["Give me three tips for keeping a houseplant alive.", "What is a volcano?"]

    def generate(**kw):
        sched = batch_invariant_scheduler(path, **kw)
        return run_chats(sched, asks, 32), sched

    with torch.inference_mode():
        plain, _ = generate()
        spec, sched = generate(
            speculative_algorithm="EAGLE3",
            speculative_draft_model_path=str(HEAD),
            speculative_disable_by_batch_size=64,
            speculative_verify_cost="bundled",  # no start-up measurement
        )
    for i in range(len(asks)):
        assert spec[f"p{i}"].ids == plain[f"p{i}"].ids, i
    state = sched.get_state()
    assert state["spec_verify_ct"] > 0
    # the head drafts tokens the target accepts: more than one token a verify step on average
    assert state["spec_accept_length"] > 1.0, state["spec_accept_length"]
