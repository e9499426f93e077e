"""ServerArgs: the one configuration dataclass for Engine and the server (SGLang's flag names)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path

from loom.runtime.server_args_choices import (
    CPU_FORWARD_MODES,
    DISAGGREGATION_MODES,
    DTYPES,
    EXECUTOR_BACKENDS,
    GRAMMAR_BACKENDS,
    HICACHE_L2_DTYPES,
    HICACHE_WRITE_POLICIES,
    LOAD_BALANCE_METHODS,
    MOE_A2A_BACKENDS,
    QUANTIZATIONS,
    QUANTIZED_MATMULS,
    REASONING_PARSERS,
    SCHEDULE_POLICIES,
    TOOL_CALL_PARSERS,
)
from loom.runtime.server_args_help import SERVER_HELP
from loom.runtime.server_args_validation import ServerArgsValidation

# the device nodes of the NVIDIA, ROCm and WSL GPU drivers: torch.cuda finds a device only
# through one of them, so a machine with none resolves to "cpu" without importing torch (in the
# owner process, which otherwise never needs it)
_GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg")

API_KEY_ENV = "LOOM_API_KEY"
BUNDLED_MODEL_PATH = str(Path(__file__).resolve().parent / "bundled")


@dataclass(frozen=True)
class ServerArgs(ServerArgsValidation):
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
    quantized_matmul: str = "auto"  # QUANTIZED_MATMULS (runtime/layers/quant_ops.py's modes)
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
    grammar_backend_eager: bool = False  # build it at start-up, not on the first constraint
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
    speculative_verify_cost: str = "auto"  # auto | measure | bundled | a JSON path (spec/cost.py)
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
    distributed_executor_backend: str = "mp"  # ray: runtime/ray_executor.py
    ray_address: str | None = None

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
    hicache_l2_dtype: str = "exact"  # how L2/L3 hold pages: exact (pool dtype), bf16, int8
    hicache_sync_loads: bool = False  # read L3 on the scheduler thread at admission
    hicache_storage_size: float = 0.0  # GB cap of the file tier (LRU files out); 0: none

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
        if self.quantization is None and str(self.model_path).endswith(".gguf"):
            # a GGUF file (a named model such as `smollm2` is one) keeps its blocks quantized
            # by default, as llama.cpp runs it; `--quantization none` asks for floats
            object.__setattr__(self, "quantization", "gguf")
        if self.quantization == "none":  # asked for floats: a GGUF's weights dequantized
            object.__setattr__(self, "quantization", None)
        if self.tokenizer_path is None:
            object.__setattr__(self, "tokenizer_path", self.model_path)
        if self.served_model_name is None:  # a named model is served under its name
            object.__setattr__(self, "served_model_name", name)
        self.validate()

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
        if not any(os.path.exists(d) for d in _GPU_DEVICE_NODES):
            return "cpu"  # without them torch sees no GPU either; not importing it saves ~200 MB
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
            help_text = SERVER_HELP.get(f.name, "")
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
            if f.name == "quantized_matmul":
                kwargs["choices"] = QUANTIZED_MATMULS
            if f.name == "load_balance_method":
                kwargs["choices"] = LOAD_BALANCE_METHODS
            if f.name == "distributed_executor_backend":
                kwargs["choices"] = EXECUTOR_BACKENDS
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
            if f.name == "hicache_l2_dtype":
                kwargs["choices"] = HICACHE_L2_DTYPES
            aliases = ["--model"] if f.name == "model_path" else []  # SGLang's alias
            parser.add_argument(flag, *aliases, **kwargs)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerArgs:
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        values = {k: v for k, v in vars(args).items() if k in names}
        if values.get("api_key") is None:  # a parent passes it this way, out of `ps`
            values["api_key"] = os.environ.get(API_KEY_ENV) or None
        return cls(**values)
