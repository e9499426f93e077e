"""Teacher-forced scoring of one token sequence on an in-process Scheduler: per-token logprobs
and the model's top-1 prediction at each position, as bench_real's accuracy pass and the
real-model tests compare a quantized model with the same file dequantized to float32."""

from __future__ import annotations

from loom.runtime.io_struct import TokenizedGenerateReq
from loom.runtime.sampling_params import make_sampling_params
from loom.runtime.scheduler.scheduler import Scheduler
from loom.runtime.server_args import ServerArgs


def teacher_forced(
    model_path: str,
    ids: list[int],
    quantization: str | None = None,
    chunk: int | None = None,
    kv_cache_dtype: str = "auto",
    quantized_matmul: str = "auto",
) -> tuple[list[float], list[int], Scheduler]:
    """(logprob of each of ids[1:] given its prefix, the top-1 id predicted at each of those
    positions, the scheduler that ran it), float32 activations, `chunk` tokens a step
    (None: the scheduler's default chunked prefill), the KV pool in `kv_cache_dtype`, the
    quantized matmuls' `quantized_matmul` (--quantized-matmul; process-wide once set)."""
    extra = {} if chunk is None else {"chunked_prefill_size": chunk}
    s = Scheduler(
        ServerArgs(
            model_path=model_path, max_total_tokens=len(ids) + 64, quantization=quantization,
            dtype="float32", kv_cache_dtype=kv_cache_dtype, quantized_matmul=quantized_matmul,
            **extra,
        )
    )  # fmt: skip
    s.add_request(
        TokenizedGenerateReq(
            rid="r", input_ids=ids, seed=0, return_logprob=True, logprob_start_len=0,
            top_logprobs_num=1,
            sampling_params=make_sampling_params({"max_new_tokens": 1, "temperature": 0}),
        )
    )  # fmt: skip
    lp = top = None
    while not s.is_idle:
        for o in s.step():
            lp = o.input_token_logprobs or lp
            top = o.input_top_logprobs or top
    return [x[0] for x in lp[1:]], [t[0][1] for t in top[1:]], s
