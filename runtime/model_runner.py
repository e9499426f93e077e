"""ModelRunner: owns the weights, the KV pools and the attention backend; runs one step
(forward, sampling, draft verification, logprobs) and returns tokens, never logits."""

from __future__ import annotations

import logging
import time

import torch

from loom.runtime.attention.base import create_attention_backend
from loom.runtime.forward_batch import ForwardBatch, ForwardOutput, ModelInput, forward_context
from loom.runtime.memory_pool import PagedAllocator, ReqToTokenPool, TokenToKVPool
from loom.runtime.model_loader import load_config, load_model, resolve_dtype
from loom.runtime.models.llama import head_dim_of
from loom.runtime.sampler import sample_and_verify, token_logprobs
from loom.runtime.server_args import ServerArgs

logger = logging.getLogger(__name__)

_CPU_KV_BUDGET_BYTES = 2 << 30
_MAX_DEFAULT_TOKENS = 1 << 18


class ModelRunner:
    def __init__(self, args: ServerArgs):
        self.args = args
        self.device = args.resolved_device
        self.config = load_config(args.model_path)
        self.dtype = resolve_dtype(args.dtype, self.config, self.device)
        self.model = load_model(args.model_path, self.dtype, self.device, self.config)
        self.vocab_size = self.config.vocab_size
        self.context_len = args.context_length or self.config.max_position_embeddings
        self._init_memory()
        self.attn_backend = create_attention_backend(args.effective_attention_backend)
        self.last_model_seconds = 0.0

    def _init_memory(self) -> None:
        cfg, args = self.config, self.args
        page = args.page_size
        kv_heads = max(
            1,
            (getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads) // args.tp_size,
        )
        head_dim = head_dim_of(cfg)
        per_token = (
            2 * cfg.num_hidden_layers * kv_heads * head_dim * torch.finfo(self.dtype).bits // 8
        )
        if args.max_total_tokens is not None:
            total = args.max_total_tokens
        elif self.device.startswith("cuda"):
            free, _ = torch.cuda.mem_get_info()
            fraction = args.mem_fraction_static or 0.85
            total = int(free * fraction) // per_token
        else:
            total = min(_CPU_KV_BUDGET_BYTES // per_token, _MAX_DEFAULT_TOKENS)
        total = max(page * 2, total // page * page)
        self.max_total_tokens = total
        max_reqs = args.max_running_requests or min(256, max(16, total // 64))
        self.max_running_requests = max_reqs
        self.req_to_token_pool = ReqToTokenPool(max_reqs + 1, self.context_len + page, self.device)
        self.token_to_kv_pool = TokenToKVPool(
            total + page,
            cfg.num_hidden_layers,
            kv_heads,
            head_dim,
            self.dtype,
            self.device,
            padding_slots=page,
        )
        self.allocator = PagedAllocator(total + page, page, self.device)
        logger.info(
            "KV cache: %d tokens (%.1f MiB), %d request rows, page size %d",
            total,
            total * per_token / 2**20,
            max_reqs,
            page,
        )

    @torch.inference_mode()
    def forward(self, inp: ModelInput) -> ForwardOutput:
        """Run the model on one step's tokens, then sample (and verify drafts) on this device.
        Returns token ids and logprobs per request; logits never leave the runner."""
        dev = self.device
        sample_rows, lp_rows, lp_targets = _logits_rows(inp)
        batch = ForwardBatch(
            mode=inp.mode,
            input_ids=inp.input_ids.to(dev, non_blocking=True),
            positions=inp.positions.to(dev, non_blocking=True),
            out_cache_loc=inp.out_cache_loc.to(dev, non_blocking=True),
            req_pool_indices=inp.req_pool_indices.to(dev, non_blocking=True),
            seq_lens=torch.tensor(inp.seq_lens, dtype=torch.int64).to(dev, non_blocking=True),
            seq_lens_cpu=inp.seq_lens,
            prefix_lens_cpu=inp.prefix_lens,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool=self.token_to_kv_pool,
            attn_backend=self.attn_backend,
            logits_indices=torch.tensor(sample_rows + lp_rows, dtype=torch.int64).to(
                dev, non_blocking=True
            ),
        )
        self.attn_backend.init_forward_metadata(batch)
        t0 = time.perf_counter()
        with forward_context(batch):
            logits = self.model(batch.input_ids, batch.positions)
        # the model's own time (exact on the CPU; on CUDA it is launch time only)
        self.last_model_seconds = time.perf_counter() - t0
        return self._sample(inp, logits, len(sample_rows), lp_targets)

    def _sample(
        self, inp: ModelInput, logits: torch.Tensor, n_sample: int, lp_targets: list[int]
    ) -> ForwardOutput:
        counts = [c for c in inp.sample_counts if c]
        # rows whose logprobs were asked for: sampled rows of such requests, then prompt rows
        want = [n is not None for n, c in zip(inp.logprob_top_nums, inp.sample_counts) if c]
        lp_sample_rows = [r for r, w in zip(range(n_sample), _repeat(want, counts)) if w]
        lp_logits = None
        if lp_sample_rows or lp_targets:
            rows = torch.tensor(lp_sample_rows, dtype=torch.int64, device=logits.device)
            lp_logits = torch.cat([logits[rows], logits[n_sample:]])  # raw, before sampling
        sampled: list[int] = []
        accepted: list[bool] | None = None
        sampled_t = None
        if n_sample:
            sampled_t, accepted_t = sample_and_verify(
                logits[:n_sample], inp.sampling.to(logits.device)
            )
            if accepted_t is not None:  # accepted rows carry the draft token
                sampled_t = torch.where(
                    accepted_t, inp.sampling.draft_tokens.to(logits.device), sampled_t
                )
                accepted = accepted_t.tolist()
            sampled = sampled_t.tolist()
        chosen, top_v, top_i = [], None, None
        if lp_logits is not None:
            parts = [torch.tensor(lp_targets, dtype=torch.int64, device=logits.device)]
            if lp_sample_rows:
                parts.insert(0, sampled_t[torch.tensor(lp_sample_rows, device=logits.device)])
            targets = torch.cat(parts)
            top = max((n or 0) for n in inp.logprob_top_nums)
            chosen_t, top_vt, top_it = token_logprobs(lp_logits, targets, top)
            chosen = chosen_t.tolist()
            if top_vt is not None:
                top_v, top_i = top_vt.tolist(), top_it.tolist()
        return _assemble(inp, sampled, accepted, chosen, top_v, top_i)


def _repeat(values: list, counts: list[int]) -> list:
    return [v for v, c in zip(values, counts) for _ in range(c)]


def _logits_rows(inp: ModelInput) -> tuple[list[int], list[int], list[int]]:
    """Hidden-state rows that need logits: every request's sampled positions (its last
    sample_counts rows) first, then the prompt-logprob rows; and the prompt tokens scored."""
    sample_rows, lp_rows, lp_targets = [], [], []
    start = 0
    for prefix, seq, count, lp_start, targets in zip(
        inp.prefix_lens,
        inp.seq_lens,
        inp.sample_counts,
        inp.input_logprob_starts,
        inp.input_logprob_targets,
    ):
        end = start + seq - prefix
        sample_rows.extend(range(end - count, end))
        if targets:
            lp_rows.extend(range(start + lp_start, start + lp_start + len(targets)))
            lp_targets.extend(targets)
        start = end
    return sample_rows, lp_rows, lp_targets


def _assemble(inp: ModelInput, sampled, accepted, chosen, top_v, top_i) -> ForwardOutput:
    """Per-request lists from the flat rows: each request's draft tokens up to the first row
    the sampler rejected, then that row's token (the residual sample, or the last row's
    sample when every draft token was accepted). Greedy, this is exactly plain decoding."""
    n = len(inp.sample_counts)
    out = ForwardOutput([[] for _ in range(n)], [[] for _ in range(n)], [[] for _ in range(n)],
                        [[] for _ in range(n)], [[] for _ in range(n)])  # fmt: skip
    row = lp = 0
    pending_lp = []
    for i, (count, top_n) in enumerate(zip(inp.sample_counts, inp.logprob_top_nums)):
        if not count:
            continue
        rows = sampled[row : row + count]
        draft = inp.draft_ids[i]
        k = 0
        while k < len(draft) and accepted[row + k]:
            k += 1
        out.next_ids[i] = rows[: k + 1]
        if top_n is not None:
            pending_lp.append((i, lp, k + 1, top_n))
            lp += count
        row += count
    for i, first, keep, top_n in pending_lp:
        out.logprobs[i] = chosen[first : first + keep]
        if top_n:
            out.top_logprobs[i] = [
                list(zip(top_v[r][:top_n], top_i[r][:top_n])) for r in range(first, first + keep)
            ]
    for i, targets in enumerate(inp.input_logprob_targets):
        if not targets:
            continue
        out.input_logprobs[i] = chosen[lp : lp + len(targets)]
        top_n = inp.logprob_top_nums[i]
        if top_n:
            out.input_top_logprobs[i] = [
                list(zip(top_v[r][:top_n], top_i[r][:top_n])) for r in range(lp, lp + len(targets))
            ]
        lp += len(targets)
    return out
