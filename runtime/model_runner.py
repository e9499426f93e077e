"""ModelRunner: owns the weights, the KV pools and the attention backend; runs one forward."""

from __future__ import annotations

import logging

import torch

from loom.runtime.attention.base import create_attention_backend
from loom.runtime.forward_batch import ForwardBatch, forward_context
from loom.runtime.memory_pool import PagedAllocator, ReqToTokenPool, TokenToKVPool
from loom.runtime.model_loader import load_config, load_model, resolve_dtype
from loom.runtime.models.llama import head_dim_of
from loom.runtime.scheduler.batch import ModelInput
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
        self.attn_backend = create_attention_backend(args.attention_backend)

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
    def forward(self, inp: ModelInput) -> torch.Tensor:
        """Runs the model on one step's tokens; returns float32 logits [len(logits_indices), V]."""
        dev = self.device
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
            logits_indices=inp.logits_indices.to(dev, non_blocking=True),
        )
        self.attn_backend.init_forward_metadata(batch)
        with forward_context(batch):
            return self.model(batch.input_ids, batch.positions)
