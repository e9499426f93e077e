"""Decode steps replayed from CUDA graphs captured per bucketed batch size.

A decode step of B requests runs in the graph of the smallest captured size >= B
(`kernels/cuda_graph.py`: 1, 2, 4, 8, then every 8 up to `--cuda-graph-max-bs`). Its inputs
are copied into static buffers the graph was captured on (input ids, positions, out-cache
slots, page-table rows, sequence lengths); rows B .. size-1 are padding, refilled on every
step: token 0 at position 0, its K/V written to slot 0 (the pool's padding page, never handed
to a request, never read by one), its attention over one position of page-table row
`PAD_ROW` (a read whose result is dropped, like the padded rows' logits). Sampling, grammar
masks, logprobs and draft verification stay outside the graph, in the model runner.

What is captured: the whole model forward (embedding, layers, final norm, LM head on every
row) of a decode step, with the triton attention backend, whose decode metadata is static
(`TritonAttnBackend.graph_decode_metadata`: a split count fixed by the context length, no
shared-prefix groups). Everything else runs eagerly: extend and verify steps, batches over
the largest size, steps whose drafter reads the forward's hidden states (EAGLE's and
Medusa's: `ForwardBatch.capture` set), the torch and cpu_paged backends
(their decode metadata has data-dependent shapes), MoE models (their dispatch counts tokens
on the host), tensor, expert and pipeline parallel ranks (not verified on a GPU yet), and
every CPU run.

On the CPU the same runner runs in "eager replay" mode (`capture=False`): the static buffers
and padding exactly as above, then the model run eagerly on the padded batch (with the
backend's per-step metadata when it has no static one). Tests use it to check the buffer
and padding logic against the plain path; `scripts/gpu_check.sh --dry-run` uses it too.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from loom.kernels.cuda_graph import bucket_for, capture_batch_sizes, pad_values
from loom.runtime.forward_batch import ForwardBatch, ForwardMode, forward_context

if TYPE_CHECKING:
    from loom.runtime.model_runner import ModelRunner

logger = logging.getLogger(__name__)

DEFAULT_MAX_BS = 160  # when --cuda-graph-max-bs is not given (capped by max running requests)
PAD_ROW = 0  # page-table row padded requests read their one position through


def graph_sizes(runner: ModelRunner) -> list[int]:
    """The batch sizes to capture for this runner's flags."""
    max_bs = runner.args.cuda_graph_max_bs or DEFAULT_MAX_BS
    return capture_batch_sizes(min(max_bs, runner.max_running_requests))


def why_not_captured(runner: ModelRunner) -> str | None:
    """Why this runner's decode steps cannot be captured (None: they can)."""
    args, cfg = runner.args, runner.config
    if args.disable_cuda_graph:
        return "--disable-cuda-graph"
    if not runner.device.startswith("cuda"):
        return "graphs are captured on CUDA only"
    if not hasattr(runner.attn_backend, "graph_decode_metadata"):
        return f"the {args.effective_attention_backend!r} attention backend is not capturable"
    if args.world_size > 1:
        return "tensor/expert/pipeline-parallel ranks run eagerly"
    if getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None):
        return "MoE layers count tokens on the host"
    if "sliding_attention" in (getattr(cfg, "layer_types", None) or ()):
        return "sliding-window layers choose their attention path on the host"
    return None


def create_graph_runner(runner: ModelRunner) -> GraphRunner | None:
    """The runner's decode graphs, captured now; None (eager decode) where they do not apply."""
    reason = why_not_captured(runner)
    if reason is not None:
        if runner.device.startswith("cuda"):
            logger.info("CUDA graphs off: %s", reason)
        return None
    return GraphRunner(runner, graph_sizes(runner), capture=True)


class GraphRunner:
    """Static decode buffers for `sizes[-1]` rows and one graph per size in `sizes`.

    Contract: `can_run(batch)` says whether a forward batch may take `run(batch)`, which
    returns the same logits as the plain forward (the rows `batch.logits_indices` asks for;
    all rows: a view of a static buffer that the next `run` overwrites) and writes K/V only
    into the batch's out-cache slots and the padding page.
    """

    def __init__(self, runner: ModelRunner, sizes: list[int], capture: bool):
        if capture and not runner.device.startswith("cuda"):
            raise ValueError("cuda graphs: capture needs a CUDA device (use capture=False)")
        self.runner = runner
        self.sizes = sizes
        self.max_bs = sizes[-1]
        self.capture = capture
        dev, n = runner.device, self.max_bs
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.out_cache_loc = torch.zeros(n, dtype=torch.int64, device=dev)
        self.req_pool_indices = torch.full((n,), PAD_ROW, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int64, device=dev)
        self.logits_indices = torch.arange(n, dtype=torch.int64, device=dev)
        backend = runner.attn_backend
        self.static_metadata = hasattr(backend, "graph_decode_metadata")
        # per size: the forward batch over the static buffers (static metadata only)
        self.batches: dict[int, ForwardBatch] = {}
        if self.static_metadata:
            # no request is longer than its page-table row or the whole KV pool
            longest = min(runner.req_to_token_pool.max_context_len, runner.max_total_tokens)
            meta = backend.graph_decode_metadata(longest)
            for bs in sizes:
                self.batches[bs] = self._batch(bs, [1] * bs)
                self.batches[bs].attn_metadata = meta
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        if capture:
            self._capture_all()

    def can_run(self, batch: ForwardBatch) -> bool:
        return (
            batch.mode.is_decode
            and batch.batch_size <= self.max_bs
            and batch.custom_masks is None
            # a drafter reading the forward's hidden states (EAGLE, Medusa: `batch.capture`)
            # needs the Python-side capture a replay skips
            and batch.capture is None
        )

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        b = batch.batch_size
        bs = bucket_for(b, self.sizes)
        self._load(batch, b, bs)
        if bs in self.graphs:
            self.graphs[bs].replay()
            logits = self.outputs[bs]
        else:
            if self.static_metadata:
                static = self.batches[bs]
            else:  # the backend's own metadata, built on the padded batch
                static = self._batch(bs, batch.seq_lens_cpu + [1] * (bs - b))
                self.runner.attn_backend.init_forward_metadata(static)
            logits = self._forward(static)
        # the graph computes every row's logits; the step may want fewer (requests that only
        # write their last token's KV sample nothing): decode rows are 0 .. B-1, one per request
        if batch.logits_indices.numel() == b:
            return logits[:b]
        return logits.index_select(0, batch.logits_indices)

    # ------------------------------------------------------------------ internals
    def _load(self, batch: ForwardBatch, b: int, bs: int) -> None:
        """The step's rows into the static buffers, rows b .. bs-1 reset to padding."""
        for buf, src, pad in zip(
            (self.input_ids, self.positions, self.out_cache_loc, self.req_pool_indices, self.seq_lens),
            (batch.input_ids, batch.positions, batch.out_cache_loc, batch.req_pool_indices,
             batch.seq_lens),
            pad_values(PAD_ROW),
        ):  # fmt: skip
            buf[:b].copy_(src, non_blocking=True)
            buf[b:bs].fill_(pad)

    def _batch(self, bs: int, seq_lens_cpu: list[int]) -> ForwardBatch:
        r = self.runner
        return ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            out_cache_loc=self.out_cache_loc[:bs],
            req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs],
            seq_lens_cpu=seq_lens_cpu,
            prefix_lens_cpu=[n - 1 for n in seq_lens_cpu],
            req_to_token_pool=r.req_to_token_pool,
            token_to_kv_pool=r.token_to_kv_pool,
            attn_backend=r.attn_backend,
            logits_indices=self.logits_indices[:bs],
        )

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        with forward_context(batch):
            return self.runner.model(batch.input_ids, batch.positions)

    @torch.inference_mode()  # as ModelRunner.forward runs the eager steps
    def _capture_all(self) -> None:
        """One graph per size, largest first so the smaller ones reuse its memory pool. The
        buffers hold padding meanwhile: the warm-up and captured runs write slot 0 only."""
        pool = None
        for bs in reversed(self.sizes):
            batch = self.batches[bs]
            try:
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):  # warm-up: Triton compiles, allocator settles
                    for _ in range(2):
                        self._forward(batch)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[bs] = self._forward(batch)
            except Exception as e:
                raise RuntimeError(
                    f"CUDA graph capture failed at batch size {bs} ({e}); "
                    "run with --disable-cuda-graph, or a smaller --cuda-graph-max-bs"
                ) from e
            pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        logger.info("CUDA graphs captured for decode batch sizes %s", self.sizes)
