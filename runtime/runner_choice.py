"""Which model runner a server's flags ask for: the torch-free `ArrayRunner`
(runtime/array_runner.py) for a GGUF model the C forward covers, served plainly, else the torch
`ModelRunner` (`array_runner.create_runner` builds it). Torch-free itself: the parent process
(the Engine's owner, the HTTP server) asks it to pick the fork server's preload
(`process.set_preload`), the scheduler process whether to set torch's threads."""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

KV_NAMES = {"bf16": "bf16", "bfloat16": "bf16", "float32": "float32"}  # --kv-cache-dtype


def why_not(args) -> str | None:
    """Why `args` needs the torch runner (None: `ArrayRunner` serves them). Read from the
    flags and the file's metadata only (no weights, no torch): the C forward's cases, one
    rank, no feature whose state lives in torch modules or pools (drafters, disaggregation,
    the hierarchical cache), a file whose weights include blocks the C kernels read."""
    if args.quantization != "gguf":
        return "not a GGUF model"
    if args.resolved_device != "cpu" or args.effective_attention_backend != "cpu_paged":
        return "not the CPU paged attention backend"
    if args.cpu_forward != "auto":
        return "--cpu-forward is not auto"
    if args.world_size != 1 or args.nnodes != 1:
        return "several ranks"
    if args.speculative_algorithm:
        return "speculative decoding"
    if args.disaggregation_mode != "null":
        return "disaggregation"
    if args.enable_hierarchical_cache:
        return "the hierarchical cache"
    if args.dtype not in ("auto", "float32"):
        return f"--dtype {args.dtype}"
    if args.kv_cache_dtype != "auto" and args.kv_cache_dtype not in KV_NAMES:
        return f"--kv-cache-dtype {args.kv_cache_dtype}"
    if os.environ.get("LOOM_TORCH_RUNNER") == "1":  # the A/B knob of tests and benchmarks
        return "LOOM_TORCH_RUNNER=1"
    from loom.runtime import cpu_abi
    from loom.runtime.gguf.file import gguf_file, metadata, open_reader

    path = gguf_file(args.model_path)
    if path is None:
        return "not a GGUF file"
    arch = metadata(str(path)).get("general.architecture")
    if arch not in ("llama", "gemma3"):
        return f"architecture {arch!r}"
    types = {t.tensor_type.name for t in open_reader(str(path)).tensors}
    if not types & set(cpu_abi.QTYPES):
        return "no weights kept quantized"
    if not types <= set(cpu_abi.QTYPES) | {"F32", "F16"}:
        return f"block types {sorted(types - set(cpu_abi.QTYPES) - {'F32', 'F16'})}"
    if cpu_abi.load() is None:
        return "no C compiler"
    return None


def choose(args) -> bool:
    reason = why_not(args)
    if reason is not None and args.quantization == "gguf":
        logger.info("model runner: torch (%s)", reason)
    return reason is None
