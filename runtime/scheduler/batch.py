"""ScheduleBatch: the CPU-side plan of one step, and the inputs it hands the model runner."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loom.runtime.forward_batch import ForwardMode
from loom.runtime.req import Req


@dataclass
class ModelInput:
    """What the runner needs, as CPU tensors/lists (the runner moves them to the device)."""

    mode: ForwardMode
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: list[int]
    prefix_lens: list[int]
    logits_indices: torch.Tensor
    # per request: (first logits row, number of rows, first prompt position scored) or None
    input_logprob_rows: list[tuple[int, int, int] | None]
    sample_rows: list[int | None]  # per request: logits row to sample from, or None


class ScheduleBatch:
    """Requests that run together in one step. For EXTEND each request computes positions
    [kv_len, kv_len + extend_len); for DECODE each computes its one new token."""

    def __init__(self, reqs: list[Req], mode: ForwardMode):
        self.reqs = reqs
        self.mode = mode
        self.out_cache_loc: torch.Tensor | None = None
        self.model_input: ModelInput | None = None

    def __len__(self) -> int:
        return len(self.reqs)

    def build_input(self) -> ModelInput:
        assert self.out_cache_loc is not None, "KV slots must be allocated before building input"
        ids: list[int] = []
        positions: list[int] = []
        logits_rows: list[int] = []
        lp_rows: list[tuple[int, int] | None] = []
        sample_rows: list[int | None] = []
        prefix_lens, seq_lens = [], []
        start = 0
        for req in self.reqs:
            fill = req.fill_ids
            if self.mode is ForwardMode.DECODE:
                begin, end = req.kv_len, req.kv_len + 1
            else:
                begin, end = req.kv_len, req.kv_len + req.extend_len
            ids.extend(fill[begin:end])
            positions.extend(range(begin, end))
            prefix_lens.append(begin)
            seq_lens.append(end)
            lp_rows.append(
                self._input_logprob_rows(req, begin, end, start, len(logits_rows), logits_rows)
            )
            if (
                end == req.seq_len
                and not req.finished
                and req.sampling_params.max_new_tokens > len(req.output_ids)
            ):
                sample_rows.append(len(logits_rows))
                logits_rows.append(start + end - begin - 1)
            else:
                sample_rows.append(None)
            start += end - begin
        self.model_input = ModelInput(
            mode=self.mode,
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            out_cache_loc=self.out_cache_loc,
            req_pool_indices=torch.tensor([r.req_pool_idx for r in self.reqs], dtype=torch.int64),
            seq_lens=seq_lens,
            prefix_lens=prefix_lens,
            logits_indices=torch.tensor(logits_rows, dtype=torch.int64),
            input_logprob_rows=lp_rows,
            sample_rows=sample_rows,
        )
        return self.model_input

    @staticmethod
    def _input_logprob_rows(
        req: Req, begin: int, end: int, token_start: int, row0: int, rows: list[int]
    ):
        """Prompt logprobs: the logits at position p score prompt token p+1. Collect positions
        p in [begin, end) with max(start_len, 1) - 1 <= p < len(prompt) - 1."""
        if not req.return_logprob:
            return None
        prompt_len = len(req.origin_input_ids)
        if len(req.logprob.input_token_logprobs) >= prompt_len - req.logprob.start_len:
            return None  # already computed (a resumed request)
        lo = max(begin, max(req.logprob.start_len, 1) - 1)
        hi = min(end, prompt_len - 1)
        if lo >= hi:
            return None
        rows.extend(range(token_start + lo - begin, token_start + hi - begin))
        return (row0, hi - lo, lo + 1)
