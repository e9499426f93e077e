"""ArrayRunner: the torch-free model runner of a GGUF model the C forward covers.

`ModelRunner` + `CpuForward` run kernels/cpu/forward.c over loom's torch model; this runner
runs the same C function over `cpu_model.ArrayForward`'s numpy arrays (the file's block rows,
its own numpy KV pool, bfloat16 as uint16), so a scheduler process serving such a model never
imports torch (issue 32: torch is ~213 MB resident before any model). It answers the
scheduler's seam as `ModelRunner` does: the KV pool's page allocator, the request table
(`kv_pages.RequestRows` over ArrayForward's numpy table), `forward(ModelInput) ->
ForwardOutput` (runtime/step_output.py samples; logprobs, draft trees and a torch-backed
sampling info import torch there, lazily).

runtime/runner_choice.py says when a server's flags let it run (the scheduler then builds it
instead of `ModelRunner`). Pool and table sizes are `ModelRunner`'s for the same flags, so
both hand the scheduler the same slots and rows.
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np

from loom.runtime.forward_batch import ForwardOutput, ModelInput
from loom.runtime.kv_pages import PagedAllocator, RequestRows, pool_tokens
from loom.runtime.runner_choice import KV_NAMES, choose
from loom.runtime.step_output import logits_rows, sample_step

logger = logging.getLogger(__name__)


class ArrayRunner:
    """The scheduler's runner over `ArrayForward`: same seam, same sizes as `ModelRunner`."""

    def __init__(self, args):
        from loom.runtime.cpu_model import ArrayForward
        from loom.runtime.gguf.file import gguf_file
        from loom.runtime.server_args_choices import QUANTIZED_MATMULS

        self.args = args
        self.device = "cpu"
        path = str(gguf_file(args.model_path))
        cfg = _layout(path)
        self.context_len = args.context_length or cfg["max_pos"]
        page = args.page_size
        kv = KV_NAMES.get(args.kv_cache_dtype, "bf16")  # auto: ModelRunner._kv_cache_dtype's
        bits = 16 if kv == "bf16" else 32
        per_token = 2 * cfg["layers"] * cfg["kv_heads"] * cfg["head_dim"] * bits // 8
        total = self._pool_tokens(per_token)
        # ModelRunner._served_positions: sized before its weights load, with a 16-bit pool
        # under auto (the rotary rows bound positions; the values do not depend on them)
        early = per_token if args.kv_cache_dtype != "auto" else per_token * 16 // bits
        rotary_rows = min(self.context_len, self._pool_tokens(early) + page)
        self.max_total_tokens = total
        max_reqs = args.max_running_requests or min(256, max(16, total // 64))
        self.max_running_requests = max_reqs
        self.kv_dtype = kv
        self.forward_impl = ArrayForward(
            path, kv_rows=total + page, max_reqs=max_reqs + 1,
            max_context=self.context_len + page, kv_dtype=kv,
            mode=QUANTIZED_MATMULS[args.quantized_matmul], rotary_rows=rotary_rows,
        )  # fmt: skip
        self.vocab_size = self.forward_impl.cfg.vocab
        self.config = self.forward_impl.cfg
        self.req_to_token_pool = RequestRows(self.forward_impl.req_to_token)
        self.allocator = PagedAllocator(total + page, page, self.device)
        self.token_to_kv_pool = None  # the pool is ArrayForward's k / v arrays
        self.cpu_forward = None  # no drafter runs here (`why_not`): no step-size cap to give
        self.model = None
        self.threads = args.effective_cpu_threads
        self.last_model_seconds = 0.0
        self._aranges: dict[int, np.ndarray] = {}
        logger.info(
            "KV cache: %d tokens (%.1f MiB, %s), %d request rows, page size %d; torch-free "
            "runner (runtime/array_runner.py)",
            total, total * per_token / 2**20, kv, max_reqs, page,
        )  # fmt: skip

    def _pool_tokens(self, per_token: int) -> int:
        return pool_tokens(self.args.max_total_tokens, self.args.page_size, per_token)

    def forward(self, inp: ModelInput) -> ForwardOutput:
        """One step: the C forward's logits of the rows that sample or score, then
        `step_output.sample_step` (ModelRunner.forward's contract; no trees, no captures)."""
        if inp.drafts.has_trees or inp.capture is not None:
            raise ValueError("ArrayRunner runs no draft trees and keeps no hidden states")
        sample_rows, lp_rows, lp_targets = logits_rows(inp)
        want = sample_rows + lp_rows
        ext = [s - p for s, p in zip(inp.seq_lens, inp.prefix_lens)]
        t0 = time.perf_counter()
        logits = self._logits(inp, ext, want)
        self.last_model_seconds = time.perf_counter() - t0
        out = sample_step(inp, logits, len(sample_rows), lp_targets)
        out.hidden = None
        return out

    def _logits(self, inp: ModelInput, ext: list[int], want: list[int]) -> np.ndarray:
        """float32 [len(want), vocab]; a step of more tokens than the C forward takes at once
        runs as consecutive parts of whole positions (a request may span parts: each part
        sees the K / V the earlier ones wrote), the logit rows gathered in `want`'s order."""
        from loom.runtime.cpu_model import MAX_TOKENS

        fwd, n = self.forward_impl, len(inp.input_ids)
        rows = np.asarray(inp.req_pool_indices, dtype=np.int64)
        if n <= MAX_TOKENS:
            return fwd(inp.input_ids, inp.positions, inp.out_cache_loc, rows, inp.seq_lens,
                       ext, want, self.threads, prompt=inp.prompt)  # fmt: skip
        out = np.empty((len(want), self.vocab_size), dtype=np.float32)
        want_a = np.asarray(want, dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(ext)])
        for a in range(0, n, MAX_TOKENS):
            b = min(n, a + MAX_TOKENS)
            part_rows, part_seq, part_ext = [], [], []
            for i in range(len(ext)):
                lo, hi = max(a, starts[i]), min(b, starts[i + 1])
                if lo >= hi:
                    continue
                part_rows.append(rows[i])
                part_seq.append(inp.prefix_lens[i] + int(hi - starts[i]))
                part_ext.append(int(hi - lo))
            take = np.nonzero((want_a >= a) & (want_a < b))[0]
            part = fwd(inp.input_ids[a:b], inp.positions[a:b], inp.out_cache_loc[a:b],
                       part_rows, part_seq, part_ext, want_a[take] - a, self.threads,
                       prompt=inp.prompt)  # fmt: skip
            out[take] = part
        return out

    def rank_info(self, rank: int) -> dict:
        """parallel_worker.rank_info's fields for this runner (weights: the arrays the C side
        reads, file-backed or not; KV: the numpy pool)."""
        fwd = self.forward_impl
        weights = sum(a.nbytes for _, a in fwd.weights.values())
        kv = sum(a.nbytes for a in fwd.k + fwd.v)
        return {"rank": rank, "weight_bytes": weights, "kv_cache_bytes": kv,
                "max_total_tokens": self.max_total_tokens, "pid": os.getpid()}  # fmt: skip


def _layout(path: str) -> dict:
    """The pool's shape fields of a GGUF file's metadata (cpu_model.read_gguf's config)."""
    from loom.runtime.gguf.file import metadata

    meta = metadata(path)
    arch = meta["general.architecture"]

    def get(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    heads, hidden = get("attention.head_count"), get("embedding_length")
    return {
        "layers": get("block_count"),
        "kv_heads": get("attention.head_count_kv", heads),
        "head_dim": get("attention.key_length", hidden // heads),
        "max_pos": get("context_length", 2048),
    }


def create_runner(args):
    """The runner `args` ask for: `ArrayRunner` where `choose` allows it, else `ModelRunner`
    (torch imported here, then)."""
    if choose(args):
        return ArrayRunner(args)
    from loom.runtime.model_runner import ModelRunner

    return ModelRunner(args)
