"""`--quantized-matmul prefill-int8` end to end (kernels/cpu/quant_i8.c through cpu_forward.py):
a prompt step's rows take 8-bit activations, decode rows the default kernels, and a prompt's
bits do not depend on how its prefill is chunked."""

from __future__ import annotations

import torch

from loom.runtime.layers import quant_ops
from tests.runtime_helpers import greedy, make_scheduler, run_all, submit


def test_prefill_int8_chunks_equal_a_whole_prefill_and_differ_from_auto(real_gguf, monkeypatch):
    """SmolLM2 Q4_1, one prompt decoded greedily: whole and in chunks of 16 tokens give the
    same tokens and output logprobs (every prompt row one arithmetic at any step size), and on
    AVX-512 VNNI builds other logprobs than mode auto (the prompt rows took the 8-bit kernel)."""
    monkeypatch.setattr(quant_ops, "DEFAULT_MODE", quant_ops.DEFAULT_MODE)  # process-wide
    path = str(real_gguf("smollm2"))
    prompt = list(range(400, 460))

    def run(mode, **kw):
        sched = make_scheduler(path, quantization="gguf", quantized_matmul=mode, **kw)
        submit(sched, "a", prompt, greedy(8), return_logprob=True, top_logprobs_num=0)
        out = run_all(sched)["a"]
        return out.ids, [lp for lp, *_ in out.output_logprobs]

    with torch.inference_mode():
        whole = run("prefill-int8")
        chunked = run("prefill-int8", chunked_prefill_size=16)
        quant_ops.DEFAULT_MODE = "auto"
        auto = run("auto")
    assert chunked == whole
    if quant_ops.load() is not None and quant_ops.load().loom_q_i8_type(quant_ops.QTYPES["Q4_1"]):
        assert whole[1] != auto[1]
    else:
        assert whole == auto
