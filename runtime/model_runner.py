"""ModelRunner: owns the weights, the KV pools and the attention backend; runs one step
(forward, sampling, draft verification, logprobs) and returns tokens, never logits."""

from __future__ import annotations

import logging
import time

import torch

from loom.runtime.attention.base import create_attention_backend
from loom.runtime.forward_batch import (
    ForwardBatch,
    ForwardOutput,
    ModelInput,
    forward_context,
    host_tensor,
)
from loom.runtime.graph_runner import create_graph_runner
from loom.runtime.kv_pages import PagedAllocator, pool_tokens
from loom.runtime.memory_pool import ReqToTokenPool, TokenToKVPool, resolve_kv_dtype
from loom.runtime.model_loader import load_config, load_model, resolve_dtype
from loom.runtime.models.llama import head_dim_of
from loom.runtime.server_args import ServerArgs
from loom.runtime.step_output import logits_rows, sample_step

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, args: ServerArgs):
        self.args = args
        self.device = args.resolved_device
        self.config = load_config(args.model_path)
        self.dtype = resolve_dtype(args.dtype, self.config, self.device)
        if args.quantized_matmul != "auto":  # validated: the weights are quantized
            from loom.runtime.layers import quant_ops
            from loom.runtime.server_args_choices import QUANTIZED_MATMULS

            # process-wide (one model a scheduler process; the C forward reads it at build)
            quant_ops.DEFAULT_MODE = QUANTIZED_MATMULS[args.quantized_matmul]
        self.context_len = args.context_length or self.config.max_position_embeddings
        self.model = load_model(
            args.model_path, self.dtype, self.device, self.config, quantization=args.quantization,
            rotary_positions=self._served_positions(),
        )  # fmt: skip
        self.vocab_size = self.config.vocab_size
        self._init_memory()
        self.attn_backend = create_attention_backend(args.effective_attention_backend)
        # decode steps replayed from CUDA graphs (None: eager; always None on the CPU)
        self.graph_runner = create_graph_runner(self)
        self.last_model_seconds = 0.0
        self._on_cpu = torch.device(self.device).type == "cpu"
        self._aranges: dict[int, torch.Tensor] = {}
        # the compiled CPU forward for small steps (runtime/cpu_forward.py), with the default
        # CPU attention backend only (an explicit torch/triton backend runs eager); None: eager
        self.cpu_forward = None
        if args.cpu_forward == "auto" and args.effective_attention_backend == "cpu_paged":
            from loom.runtime.cpu_forward import CpuForward
            from loom.runtime.process import release_free_heap

            self.cpu_forward = CpuForward.build(
                self.model, self.token_to_kv_pool, tp_size=args.tp_size, pp_size=args.pp_size
            )
            release_free_heap()  # the merged q/k/v and gate/up copies freed their parts

    def _kv_cache_dtype(self) -> str:
        """--kv-cache-dtype, with `auto` for a GGUF model kept quantized on the CPU meaning a
        bfloat16 pool where the compiled C forward runs it (llama.cpp's default is a 16-bit
        cache too): half the KV bytes, and SmolLM2's teacher-forced top-1 agreement with the
        float32 reference 99.65% over 2,000 tokens, perplexity within 0.04%
        (docs/benchmarks.md, "Issue 32: the bfloat16 pool's prefill split-invariant, and the
        default again"). Every row on that pool attends as its token's decode step, so a prompt
        decodes the same after a radix-cached prefix as prefilled whole. A model the C forward
        would leave to the eager layers keeps the model dtype."""
        args = self.args
        if not (
            args.kv_cache_dtype == "auto"
            and args.quantization == "gguf"
            and args.cpu_forward == "auto"
            and args.effective_attention_backend == "cpu_paged"
            and self.dtype == torch.float32
            and torch.device(self.device).type == "cpu"
            # a file of float tensors (nothing kept quantized) keeps its checkpoint's arithmetic
            and any(getattr(p, "quant", None) is not None for p in self.model.parameters())
        ):
            return args.kv_cache_dtype
        from types import SimpleNamespace

        from loom.runtime import cpu_forward

        kv16 = [torch.empty(0, dtype=torch.bfloat16)]
        pool = SimpleNamespace(k_buffers=kv16, v_buffers=kv16)
        why = cpu_forward.unsupported(self.model, pool, tp_size=args.tp_size, pp_size=args.pp_size)
        return "auto" if why or cpu_forward.load() is None else "bf16"

    def _kv_layout(self, weights_loaded: bool = True) -> tuple[int, int, torch.dtype, int]:
        """(KV heads on this rank, head_dim, KV dtype, bytes of KV per token) of the pool.
        Before the weights are loaded (`weights_loaded` False: the rotary tables' sizing),
        `auto` may still become bfloat16 (`_kv_cache_dtype` reads the loaded weights), so the
        bytes are the fewer of the two: the pool's token count is then an upper bound."""
        cfg, args = self.config, self.args
        kv_heads = max(
            1,
            (getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads) // args.tp_size,
        )
        head_dim = head_dim_of(cfg)
        backend = args.effective_attention_backend
        if weights_loaded:
            kv_dtype = resolve_kv_dtype(self._kv_cache_dtype(), self.dtype, backend)
        else:
            kv_dtype = resolve_kv_dtype(args.kv_cache_dtype, self.dtype, backend)
        bits = torch.finfo(kv_dtype).bits
        if not weights_loaded and args.kv_cache_dtype == "auto" and args.quantization == "gguf":
            bits = min(bits, 16)
        per_token = 2 * cfg.num_hidden_layers * kv_heads * head_dim * bits // 8
        return kv_heads, head_dim, kv_dtype, per_token

    def _pool_tokens(self, per_token: int, weights_loaded: bool = True) -> int | None:
        """Tokens the KV pool holds (whole pages). None before the weights are loaded on CUDA
        without max_total_tokens: the pool is then sized from the memory they leave."""
        args, device_tokens = self.args, None
        if args.max_total_tokens is None and self.device.startswith("cuda"):
            if not weights_loaded:
                return None
            free, _ = torch.cuda.mem_get_info()
            device_tokens = int(free * (args.mem_fraction_static or 0.85)) // per_token
        return pool_tokens(args.max_total_tokens, args.page_size, per_token, device_tokens)

    def _served_positions(self) -> int | None:
        """The most positions any step can use, for the rotary tables (None: the config's
        max_position_embeddings). Every token of a step holds a KV slot together with its whole
        prefix, and the scheduler caps a request (drafts included) by the context length, so
        positions stay below min(context length, the pool's slots). Gemma 3 270M's tables sized
        to its 32k context are 128 MB, against 1 MB for the 224-token pool bench_real gives it
        (docs/benchmarks.md, "Issue 32: where the scheduler's memory goes")."""
        total = self._pool_tokens(self._kv_layout(weights_loaded=False)[3], weights_loaded=False)
        return None if total is None else min(self.context_len, total + self.args.page_size)

    def _init_memory(self) -> None:
        cfg, args = self.config, self.args
        page = args.page_size
        kv_heads, head_dim, self.kv_dtype, per_token = self._kv_layout()
        total = self._pool_tokens(per_token)
        self.max_total_tokens = total
        max_reqs = args.max_running_requests or min(256, max(16, total // 64))
        self.max_running_requests = max_reqs
        self.req_to_token_pool = ReqToTokenPool(max_reqs + 1, self.context_len + page, self.device)
        self.token_to_kv_pool = TokenToKVPool(
            total + page,
            cfg.num_hidden_layers,
            kv_heads,
            head_dim,
            self.kv_dtype,
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
        sample_rows, lp_rows, lp_targets = logits_rows(inp)
        seq_lens = inp.seq_lens_tensor
        if seq_lens is None:
            seq_lens = host_tensor(inp.seq_lens, torch.int64)
        if not lp_rows and len(sample_rows) == len(inp.input_ids):
            # every fed token is sampled (a decode or verify step): rows 0 .. T-1, in order
            logits_indices = self._arange(len(sample_rows))
        else:
            logits_indices = host_tensor(sample_rows + lp_rows, torch.int64)
        to_dev = self._to_device
        batch = ForwardBatch(
            mode=inp.mode,
            input_ids=to_dev(inp.input_ids),
            positions=to_dev(inp.positions),
            out_cache_loc=to_dev(inp.out_cache_loc),
            req_pool_indices=to_dev(inp.req_pool_indices),
            seq_lens=to_dev(seq_lens),
            seq_lens_cpu=inp.seq_lens,
            prefix_lens_cpu=inp.prefix_lens,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool=self.token_to_kv_pool,
            attn_backend=self.attn_backend,
            logits_indices=to_dev(logits_indices),
            capture=inp.capture,
            prompt=inp.prompt,
        )
        if inp.drafts.has_trees:
            batch.custom_masks = [
                None if par is None else tree_mask(prefix, par, self.device)
                for prefix, par in zip(inp.prefix_lens, inp.drafts.parents)
            ]
        graphed = self.graph_runner is not None and self.graph_runner.can_run(batch)
        compiled = not graphed and self.cpu_forward is not None and self.cpu_forward.covers(batch)
        if not (compiled or graphed):
            self.attn_backend.init_forward_metadata(batch)
        t0 = time.perf_counter()
        if graphed:  # the padded batch's captured graph (runtime/graph_runner.py)
            logits = self.graph_runner.run(batch)
        elif compiled:
            logits = self.cpu_forward(batch)
        else:
            with forward_context(batch):
                logits = self.model(batch.input_ids, batch.positions)
        # the model's own time (exact on the CPU; on CUDA it is launch time only)
        self.last_model_seconds = time.perf_counter() - t0
        out = sample_step(inp, logits, len(sample_rows), lp_targets)
        if batch.custom_masks is not None:
            self._move_tree_kv(inp, out.accepted_nodes)
        out.hidden = batch.captured  # a drafter's features (`inp.capture`), for after the step
        return out

    def _to_device(self, t) -> torch.Tensor:
        """A step's index array (numpy from the scheduler: `torch.as_tensor` shares its
        memory, no copy; a tensor as it is) on this runner's device."""
        t = torch.as_tensor(t)
        return t if self._on_cpu else t.to(self.device, non_blocking=True)

    def _arange(self, n: int) -> torch.Tensor:
        """arange(n) on the host, kept across steps (read-only: nothing writes logits_indices)."""
        t = self._aranges.get(n)
        if t is None:
            t = torch.arange(n, dtype=torch.int64)
            if n <= 4096:
                self._aranges[n] = t
        return t

    def _move_tree_kv(self, inp: ModelInput, accepted_nodes: list[list[int]]) -> None:
        """Accepted tree node j-th on the path sits at KV column prefix + 1 + node; move its
        K and V (every layer) to column prefix + 1 + j, its position, so the request's KV is
        a plain sequence again (the scheduler then frees the columns after the path).
        Sources never precede their destination, so one gathered copy is safe."""
        src_cols, dst_cols, rows = [], [], []
        for i, par in enumerate(inp.drafts.parents):
            if par is None:
                continue
            base = inp.prefix_lens[i] + 1
            for j, node in enumerate(accepted_nodes[i]):
                if node != j:
                    rows.append(int(inp.req_pool_indices[i]))
                    src_cols.append(base + node)
                    dst_cols.append(base + j)
        if not rows:
            return
        table = self.req_to_token_pool.req_to_token
        r = torch.tensor(rows, dtype=torch.int64, device=table.device)
        src = table[r, torch.tensor(src_cols, device=table.device)]
        dst = table[r, torch.tensor(dst_cols, device=table.device)]
        pool = self.token_to_kv_pool
        for buf in pool.k_buffers + pool.v_buffers:
            if buf.shape[0]:  # a pipeline stage holds only its own layers
                buf[dst] = buf[src]


def tree_mask(prefix_len: int, parents: list[int], device) -> torch.Tensor:
    """[1 + n, prefix_len + 1 + n] bool: the last real token (row 0, at column prefix_len)
    sees the prefix and itself; node i (row 1 + i, column prefix_len + 1 + i) sees the prefix,
    the last real token, its ancestors and itself."""
    n = len(parents)
    mask = torch.zeros(1 + n, prefix_len + 1 + n, dtype=torch.bool)
    mask[:, : prefix_len + 1] = True
    for i, par in enumerate(parents):
        row = mask[1 + i]
        if par >= 0:
            row[prefix_len + 1 :] = mask[1 + par, prefix_len + 1 :]
        row[prefix_len + 1 + i] = True
    return mask.to(device)
