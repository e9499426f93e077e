"""The values each enumerated server flag accepts (argparse `choices` and the validation's
checks read the same tuples)."""

from __future__ import annotations

from loom.runtime.tool_formats import PARSER_NAMES

# --tool-call-parser's choices: the formats' own names and aliases (one list)
TOOL_CALL_PARSERS = PARSER_NAMES
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
EXECUTOR_BACKENDS = ("mp", "ray")
DTYPES = ("auto", "float32", "bfloat16", "float16", "half", "float", "bf16", "fp16", "fp32")
# --kv-cache-dtype (SGLang's values): the KV pool's storage dtype, "auto" = the model dtype
KV_CACHE_DTYPES = ("auto", "bf16", "bfloat16", "float32")
KV_CACHE_DTYPES_NOT_YET = ("fp8_e5m2", "fp8_e4m3", "fp4_e2m1")
# hierarchical KV cache (radix/hicache.py), SGLang's names
HICACHE_WRITE_POLICIES = ("write_through", "write_back")
HICACHE_STORAGE_BACKENDS = ("file", "redis")
HICACHE_L2_DTYPES = ("exact", "bf16", "int8")
# --quantization: weight-only quantization of a float checkpoint at load (model_loader)
QUANTIZATIONS = ("int8", "int4", "gguf", "none")
# --quantized-matmul -> quant_ops mode: "auto" (per call: the batch-invariant kernels for Q8_0 /
# Q4_0 / Q4_1 / Q5_x where built with AVX-512 VNNI; for other types the f32 decode GEMV up to 8 rows
# where built, the batch-invariant kernels above), "batch-invariant" (one arithmetic for every
# row count)
QUANTIZED_MATMULS = {"auto": "auto", "batch-invariant": "bi", "prefill-int8": "prefill"}
