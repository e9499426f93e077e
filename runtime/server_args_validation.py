"""ServerArgs' checks: every value in range and every combination supported, or a ValueError
naming the field (`need(cond, name, why)`)."""

from __future__ import annotations

from pathlib import Path

from loom.runtime.env import env_flag
from loom.runtime.server_args_choices import (
    ATTENTION_BACKENDS,
    CPU_FORWARD_MODES,
    DISAGGREGATION_MODES,
    DISAGGREGATION_TRANSFER_BACKENDS,
    DTYPES,
    EAGLE_ALGORITHMS,
    EXECUTOR_BACKENDS,
    GRAMMAR_BACKENDS,
    HICACHE_L2_DTYPES,
    HICACHE_STORAGE_BACKENDS,
    HICACHE_WRITE_POLICIES,
    KV_CACHE_DTYPES,
    KV_CACHE_DTYPES_NOT_YET,
    LOAD_BALANCE_METHODS,
    MOE_A2A_BACKENDS,
    NGRAM_MATCH_TYPES,
    QUANTIZATIONS,
    QUANTIZED_MATMULS,
    REASONING_PARSERS,
    SCHEDULE_POLICIES,
    SPECULATIVE_ALGORITHMS,
    SPECULATIVE_NOT_YET,
    TOOL_CALL_PARSERS,
)

# Flags loom accepts only at their off value until the feature lands (a later issue builds
# each): name -> the one value accepted.
_NOT_SUPPORTED_YET = {
    "trust_remote_code": False,
}


class ServerArgsValidation:
    """ServerArgs' `validate` (a base class of it: reads the dataclass's fields)."""

    def validate(self) -> None:
        def need(cond: bool, name: str, what: str) -> None:
            if not cond:
                raise ValueError(f"{name}: {what}")

        need(
            self.tool_call_parser is None or self.tool_call_parser in TOOL_CALL_PARSERS,
            "tool_call_parser",
            f"must be one of {TOOL_CALL_PARSERS}, got {self.tool_call_parser!r}",
        )
        need(
            self.reasoning_parser is None or self.reasoning_parser in REASONING_PARSERS,
            "reasoning_parser",
            f"must be one of {REASONING_PARSERS}, got {self.reasoning_parser!r}",
        )
        need(self.dtype in DTYPES, "dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        need(
            self.quantization is None or self.quantization in QUANTIZATIONS,
            "quantization",
            f"must be one of {QUANTIZATIONS}, got {self.quantization!r}",
        )
        need(
            self.quantized_matmul in QUANTIZED_MATMULS,
            "quantized_matmul",
            f"must be one of {tuple(QUANTIZED_MATMULS)}, got {self.quantized_matmul!r}",
        )
        need(
            self.quantized_matmul == "auto" or self.quantization is not None,
            "quantized_matmul",
            "needs quantized weights (--quantization, or a GGUF file's default)",
        )
        need(
            self.kv_cache_dtype not in KV_CACHE_DTYPES_NOT_YET,
            "kv_cache_dtype",
            f"{self.kv_cache_dtype!r} is not supported yet (only {KV_CACHE_DTYPES})",
        )
        need(
            self.kv_cache_dtype in KV_CACHE_DTYPES,
            "kv_cache_dtype",
            f"must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}",
        )
        need(
            self.attention_backend is None or self.attention_backend in ATTENTION_BACKENDS,
            "attention_backend",
            f"{self.attention_backend!r} is not supported yet (only {ATTENTION_BACKENDS})",
        )
        need(  # the Triton kernels run on the CPU only through Triton's (slow) interpreter
            self.attention_backend != "triton"
            or self.resolved_device != "cpu"
            or env_flag("TRITON_INTERPRET"),
            "attention_backend",
            "'triton' is not supported yet on the CPU (it needs CUDA; TRITON_INTERPRET=1 runs it"
            " through Triton's interpreter, for tests); use torch or cpu_paged",
        )
        need(
            self.schedule_policy in SCHEDULE_POLICIES,
            "schedule_policy",
            f"must be one of {SCHEDULE_POLICIES}, got {self.schedule_policy!r}",
        )
        need(self.page_size >= 1, "page_size", f"must be >= 1, got {self.page_size}")
        need(
            self.max_total_tokens is None or self.max_total_tokens >= 16,
            "max_total_tokens",
            f"must be >= 16, got {self.max_total_tokens}",
        )
        need(
            self.max_running_requests is None or self.max_running_requests >= 1,
            "max_running_requests",
            f"must be >= 1, got {self.max_running_requests}",
        )
        need(
            self.chunked_prefill_size is None
            or self.chunked_prefill_size == -1
            or self.chunked_prefill_size >= self.page_size,
            "chunked_prefill_size",
            f"must be -1 (off) or >= page_size, got {self.chunked_prefill_size}",
        )
        self._validate_parallel(need)
        need(
            self.max_batch_request >= 1,
            "max_batch_request",
            f"must be >= 1, got {self.max_batch_request}",
        )
        need(
            self.max_request_body_bytes >= 1024,
            "max_request_body_bytes",
            f"must be >= 1024, got {self.max_request_body_bytes}",
        )
        need(
            self.watchdog_timeout > 0,
            "watchdog_timeout",
            f"must be > 0, got {self.watchdog_timeout}",
        )
        # Accepted by SGLang's CLI, not built in loom yet: refused at start-up rather than
        # accepted and ignored.
        for name, off in _NOT_SUPPORTED_YET.items():
            need(
                getattr(self, name) == off,
                name,
                f"{getattr(self, name)!r} is not supported yet (only {off!r})",
            )
        need(
            self.cpu_threads is None or self.cpu_threads >= 1,
            "cpu_threads",
            f"must be >= 1, got {self.cpu_threads}",
        )
        need(
            self.cpu_forward in CPU_FORWARD_MODES,
            "cpu_forward",
            f"must be one of {CPU_FORWARD_MODES}, got {self.cpu_forward!r}",
        )
        need(
            self.cuda_graph_max_bs is None or self.cuda_graph_max_bs >= 1,
            "cuda_graph_max_bs",
            f"must be >= 1, got {self.cuda_graph_max_bs}",
        )
        need(
            self.grammar_backend in GRAMMAR_BACKENDS,
            "grammar_backend",
            f"must be one of {GRAMMAR_BACKENDS}, got {self.grammar_backend!r}",
        )
        need(
            self.grammar_compile_timeout > 0,
            "grammar_compile_timeout",
            f"must be > 0, got {self.grammar_compile_timeout}",
        )
        self._validate_speculative(need)
        self._validate_disaggregation(need)
        self._validate_hicache(need)

    def _validate_hicache(self, need) -> None:
        on = self.enable_hierarchical_cache
        if not on:
            for name in ("hicache_storage_backend", "hicache_storage_dir", "hicache_storage_url"):
                need(getattr(self, name) is None, name, "needs --enable-hierarchical-cache")
            return
        need(not self.disable_radix_cache, "enable_hierarchical_cache",
             "needs the radix cache (drop --disable-radix-cache)")  # fmt: skip
        need(self.tp_size == 1 and self.pp_size == 1, "enable_hierarchical_cache",
             "with tp_size or pp_size > 1 is not supported yet")  # fmt: skip
        need(self.disaggregation_mode == "null", "enable_hierarchical_cache",
             "with --disaggregation-mode is not supported yet")  # fmt: skip
        need(self.hicache_ratio > 0, "hicache_ratio", f"must be > 0, got {self.hicache_ratio}")
        need(self.hicache_size >= 0, "hicache_size", f"must be >= 0, got {self.hicache_size}")
        need(
            self.hicache_write_policy in HICACHE_WRITE_POLICIES,
            "hicache_write_policy",
            f"must be one of {HICACHE_WRITE_POLICIES}, got {self.hicache_write_policy!r}",
        )
        need(
            self.hicache_l2_dtype in HICACHE_L2_DTYPES,
            "hicache_l2_dtype",
            f"must be one of {HICACHE_L2_DTYPES}, got {self.hicache_l2_dtype!r}",
        )
        backend = self.hicache_storage_backend
        need(self.hicache_storage_size >= 0, "hicache_storage_size",
             f"must be >= 0, got {self.hicache_storage_size}")  # fmt: skip
        need(self.hicache_storage_size == 0 or backend == "file", "hicache_storage_size",
             "needs --hicache-storage-backend file (size Redis with its maxmemory)")  # fmt: skip
        need(
            backend is None or backend in HICACHE_STORAGE_BACKENDS,
            "hicache_storage_backend",
            f"must be one of {HICACHE_STORAGE_BACKENDS}, got {backend!r}",
        )
        need(self.hicache_storage_dir is None or backend == "file", "hicache_storage_dir",
             "needs --hicache-storage-backend file")  # fmt: skip
        need(self.hicache_storage_url is None or backend == "redis", "hicache_storage_url",
             "needs --hicache-storage-backend redis")  # fmt: skip

    def _validate_disaggregation(self, need) -> None:
        mode = self.disaggregation_mode
        need(
            mode in DISAGGREGATION_MODES,
            "disaggregation_mode",
            f"must be one of {DISAGGREGATION_MODES}, got {mode!r}",
        )
        backend = self.disaggregation_transfer_backend
        need(
            backend in DISAGGREGATION_TRANSFER_BACKENDS,
            "disaggregation_transfer_backend",
            f"{backend!r} is not supported yet (only {DISAGGREGATION_TRANSFER_BACKENDS})",
        )
        port = self.disaggregation_bootstrap_port
        need(0 < port < 65536, "disaggregation_bootstrap_port", f"must be a TCP port, got {port}")
        need(
            self.disaggregation_timeout > 0,
            "disaggregation_timeout",
            f"must be > 0, got {self.disaggregation_timeout}",
        )
        if mode != "null":
            for name in ("tp_size", "ep_size", "pp_size", "dp_size", "nnodes"):
                need(
                    getattr(self, name) == 1,
                    "disaggregation_mode",
                    f"{mode} with {name} {getattr(self, name)} is not supported yet (one rank)",
                )

    def _validate_speculative(self, need) -> None:
        algo = self.speculative_algorithm
        need(
            algo is None or algo.upper() not in SPECULATIVE_NOT_YET,
            "speculative_algorithm",
            f"{algo!r} is not supported yet (only {SPECULATIVE_ALGORITHMS})",
        )
        need(
            algo is None or algo.upper() in SPECULATIVE_ALGORITHMS,
            "speculative_algorithm",
            f"unknown algorithm {algo!r}; choose one of {SPECULATIVE_ALGORITHMS}",
        )
        if algo is None:  # a tuning flag without an algorithm would be accepted and ignored
            need(
                self.speculative_num_draft_tokens is None,
                "speculative_num_draft_tokens",
                "needs --speculative-algorithm",
            )
        self._validate_eagle(need)
        if algo is None:
            return
        n = self.speculative_num_draft_tokens
        need(
            n is None or 2 <= n <= 64,
            "speculative_num_draft_tokens",
            f"must be in [2, 64], got {n}",
        )
        lo, hi = (
            self.speculative_ngram_min_match_window_size,
            self.speculative_ngram_max_match_window_size,
        )
        need(lo >= 1, "speculative_ngram_min_match_window_size", f"must be >= 1, got {lo}")
        need(
            lo <= hi <= 64,
            "speculative_ngram_max_match_window_size",
            f"must be in [min_match_window_size, 64], got {hi}",
        )
        lo_b, hi_b = self.speculative_ngram_min_bfs_breadth, self.speculative_ngram_max_bfs_breadth
        need(lo_b >= 1, "speculative_ngram_min_bfs_breadth", f"must be >= 1, got {lo_b}")
        need(
            lo_b <= hi_b <= 64,
            "speculative_ngram_max_bfs_breadth",
            f"must be in [min_bfs_breadth, 64], got {hi_b}",
        )
        need(
            self.speculative_ngram_match_type.upper() in NGRAM_MATCH_TYPES,
            "speculative_ngram_match_type",
            f"must be one of {NGRAM_MATCH_TYPES}, got {self.speculative_ngram_match_type!r}",
        )
        need(
            self.speculative_ngram_branch_length >= 1,
            "speculative_ngram_branch_length",
            f"must be >= 1, got {self.speculative_ngram_branch_length}",
        )
        need(
            self.speculative_ngram_capacity >= 1024,
            "speculative_ngram_capacity",
            f"must be >= 1024, got {self.speculative_ngram_capacity}",
        )
        need(
            self.speculative_disable_by_batch_size >= 1,
            "speculative_disable_by_batch_size",
            f"must be >= 1, got {self.speculative_disable_by_batch_size}",
        )
        vc = self.speculative_verify_cost
        need(
            vc in ("auto", "measure", "bundled") or Path(vc).is_file(),
            "speculative_verify_cost",
            f"must be auto, measure, bundled or an existing JSON file, got {vc!r}",
        )

    def _validate_eagle(self, need) -> None:
        """EAGLE flags: only with an EAGLE algorithm; chains only (topk 1) for now."""
        algo = (self.speculative_algorithm or "").upper()
        eagle = algo in EAGLE_ALGORITHMS
        for name in (
            "speculative_draft_model_path",
            "speculative_num_steps",
            "speculative_eagle_topk",
        ):
            need(
                eagle
                or getattr(self, name) is None
                or (algo == "MEDUSA" and name == "speculative_draft_model_path"),
                name,
                f"needs --speculative-algorithm {' or '.join(EAGLE_ALGORITHMS)}",
            )
        need(
            algo != "MEDUSA" or (self.tp_size == 1 and self.pp_size == 1),
            "speculative_algorithm",
            "MEDUSA with tp_size or pp_size > 1 is not supported yet",
        )
        if not eagle:
            return
        steps, topk = self.speculative_num_steps, self.speculative_eagle_topk
        need(
            steps is None or 1 <= steps <= 63,
            "speculative_num_steps",
            f"must be in [1, 63], got {steps}",
        )
        need(
            topk is None or 1 <= topk <= 16,
            "speculative_eagle_topk",
            f"must be in [1, 16], got {topk}",
        )
        n = self.speculative_num_draft_tokens
        need(
            n is None or steps is None or (topk or 1) > 1 or n == steps + 1,
            "speculative_num_draft_tokens",
            f"must be speculative_num_steps + 1 ({steps + 1 if steps else '?'}) with topk 1, "
            f"got {n}",
        )
        k, s = self.effective_speculative_eagle_topk, self.effective_speculative_num_steps
        most = 1 + k + (s - 1) * k * k  # the root + every candidate the tree search offers
        need(
            n is None or n <= most,
            "speculative_num_draft_tokens",
            f"{n} is more than the {most} tokens {s} steps of top-{k} can offer",
        )
        need(
            self.tp_size == 1 and self.pp_size == 1,
            "speculative_algorithm",
            f"{algo} with tp_size or pp_size > 1 is not supported yet",
        )

    def _validate_parallel(self, need) -> None:
        """Parallel layout (runtime/distributed.py): world = tp_size ranks, or ep_size ranks
        with tp_size 1 (attention replicated, experts sharded); EP = TP x DP, so ep_size divides
        tp_size when tp_size > 1."""
        need(self.tp_size >= 1, "tp_size", f"must be >= 1, got {self.tp_size}")
        need(self.ep_size >= 1, "ep_size", f"must be >= 1, got {self.ep_size}")
        need(
            self.tp_size == 1 or self.tp_size % self.ep_size == 0,
            "ep_size",
            f"{self.ep_size} must divide tp_size ({self.tp_size}) (EP = TP x DP, dp_size is 1)",
        )
        need(self.dp_size >= 1, "dp_size", f"must be >= 1, got {self.dp_size}")
        need(
            self.dp_size == 1 or self.nnodes == 1,
            "dp_size",
            f"{self.dp_size} with nnodes > 1 is not supported yet (replicas run on one node)",
        )
        need(
            self.load_balance_method in LOAD_BALANCE_METHODS,
            "load_balance_method",
            f"must be one of {LOAD_BALANCE_METHODS}, got {self.load_balance_method!r}",
        )
        need(
            self.dp_size > 1 or self.load_balance_method == "round_robin",
            "load_balance_method",
            "needs --dp-size > 1 (it picks the replica of each request)",
        )
        need(self.pp_size >= 1, "pp_size", f"must be >= 1, got {self.pp_size}")
        need(
            self.pp_size == 1 or (self.tp_size == 1 and self.ep_size == 1),
            "pp_size",
            f"{self.pp_size} with tp_size or ep_size > 1 is not supported yet (one rank per stage)",
        )
        part = self.pp_layer_partition
        if part is not None:
            counts = part.split(",")
            need(
                all(c.strip().isdigit() for c in counts),
                "pp_layer_partition",
                f"must be comma-separated layer counts (e.g. 8,8,7,7), got {part!r}",
            )
            need(
                len(counts) == self.pp_size,
                "pp_layer_partition",
                f"has {len(counts)} stages, pp_size is {self.pp_size}",
            )
        mb = self.pp_max_micro_batch_size
        need(mb is None or mb >= 1, "pp_max_micro_batch_size", f"must be >= 1, got {mb}")
        need(mb is None or self.pp_size > 1, "pp_max_micro_batch_size", "needs pp_size > 1")
        a2a = self.moe_a2a_backend
        need(a2a in MOE_A2A_BACKENDS, "moe_a2a_backend", f"must be one of {MOE_A2A_BACKENDS}")
        need(
            a2a != "all_to_all" or (self.ep_size > 1 and self.tp_size in (1, self.ep_size)),
            "moe_a2a_backend",
            "all_to_all needs ep_size > 1 and each expert whole on one rank (tp_size 1 or "
            f"tp_size == ep_size), got tp_size {self.tp_size}, ep_size {self.ep_size}",
        )
        need(self.nnodes >= 1, "nnodes", f"must be >= 1, got {self.nnodes}")
        need(
            0 <= self.node_rank < self.nnodes,
            "node_rank",
            f"must be in [0, nnodes={self.nnodes}), got {self.node_rank}",
        )
        need(
            self.world_size % self.nnodes == 0,
            "nnodes",
            f"{self.nnodes} nodes cannot hold {self.world_size} ranks evenly",
        )
        need(
            self.nnodes == 1 or self.dist_init_addr is not None,
            "dist_init_addr",
            "is required when nnodes > 1 (host:port of node 0, reachable from every node)",
        )
        backend = self.distributed_executor_backend
        need(
            backend in EXECUTOR_BACKENDS,
            "distributed_executor_backend",
            f"must be one of {EXECUTOR_BACKENDS}, got {backend!r}",
        )
        need(
            backend == "mp" or self.world_size > 1 or self.dp_size > 1,
            "distributed_executor_backend",
            "ray places ranks or replicas: it needs tp_size, ep_size, pp_size or dp_size > 1",
        )
        need(
            backend == "mp" or self.nnodes == 1,
            "distributed_executor_backend",
            "ray places every rank itself; --nnodes / --node-rank are for the mp launch",
        )
        need(
            self.ray_address is None or backend == "ray",
            "ray_address",
            "needs --distributed-executor-backend ray",
        )
        if self.dist_init_addr is not None:
            host, _, port = self.dist_init_addr.rpartition(":")
            need(
                bool(host) and port.isdigit() and 0 < int(port) < 65536,
                "dist_init_addr",
                f"must be host:port, got {self.dist_init_addr!r}",
            )
