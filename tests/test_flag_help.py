"""Flag help that names a number says what the code does: each such number is read out of the
help text and compared with the constant or derived value the code uses. A help text that
gains a number no check reads fails `test_every_number_in_help_is_checked` until a check (or
a reason it names no limit of loom's) is added here. (`--cpu-forward` once said steps of up to
32 tokens while the code ran 8,192.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from loom.runtime.router.args import _HELP as ROUTER_HELP
from loom.runtime.server_args import ServerArgs
from loom.runtime.server_args_help import SERVER_HELP


def _num(text: str) -> int:
    return int(text.replace(",", ""))


def _grab(help_text: str, pattern: str) -> tuple[str, ...]:
    m = re.search(pattern, help_text)
    assert m, f"the help no longer matches {pattern!r}: {help_text!r}"
    return m.groups()


def check_cpu_forward(h):
    from loom.runtime import cpu_forward

    (n,) = _grab(h, r"steps of up to ([\d,]+) tokens")
    assert _num(n) == cpu_forward.MAX_TOKENS


def check_cuda_graph_max_bs(h):
    from loom.kernels.cuda_graph import capture_batch_sizes
    from loom.runtime.graph_runner import DEFAULT_MAX_BS

    sizes, step, default = _grab(h, r"sizes ([\d, ]+), then every (\d+) up to it.*default (\d+)")
    first = [int(s) for s in sizes.split(",")]
    want = first + list(range(first[-1] + int(step), 41, int(step)))
    assert capture_batch_sizes(40) == want
    assert int(default) == DEFAULT_MAX_BS


def check_speculative_num_draft_tokens(h):
    (n,) = _grab(h, r"default (\d+) with an algorithm")
    assert ServerArgs(speculative_algorithm="NGRAM").effective_num_draft_tokens == int(n)


def check_speculative_num_steps(h):
    chain, tree = _grab(h, r"else (\d+) for a chain, (\d+) for a tree")
    assert ServerArgs().effective_speculative_num_steps == int(chain)
    tree_args = ServerArgs(speculative_algorithm="EAGLE", speculative_eagle_topk=4)
    assert tree_args.effective_speculative_num_steps == int(tree)
    with_n = ServerArgs(speculative_algorithm="EAGLE", speculative_num_draft_tokens=7)
    assert with_n.effective_speculative_num_steps == 6  # "num_draft_tokens - 1"


def check_speculative_ngram_max_bfs_breadth(h):
    (n,) = _grab(h, r"\((\d+) = chain drafts, the default\)")
    assert ServerArgs().speculative_ngram_max_bfs_breadth == int(n)


def check_speculative_eagle_topk(h):
    (n,) = _grab(h, r"(\d+) = chains")
    assert ServerArgs().effective_speculative_eagle_topk == int(n)


def check_chunked_prefill_size(h):
    (n,) = _grab(h, r"\((-?\d+): off\)")
    assert ServerArgs(chunked_prefill_size=int(n)).effective_chunked_prefill_size is None


def check_disaggregation_bootstrap_port(h):
    (n,) = _grab(h, r"default (\d+)")
    assert ServerArgs().disaggregation_bootstrap_port == int(n)


def check_pp_layer_partition(h):
    from loom.runtime.distributed import pp_layer_partition

    counts, layers, pp, default = _grab(
        h, r"e\.g\. ([\d,]+) for (\d+) layers at pp_size (\d+), where the default split is ([\d,]+)"
    )
    assert sum(int(c) for c in counts.split(",")) == int(layers)
    assert len(counts.split(",")) == int(pp)
    assert ServerArgs(pp_size=int(pp), pp_layer_partition=counts).pp_layer_counts is not None
    assert pp_layer_partition(int(layers), int(pp)) == tuple(int(c) for c in default.split(","))


def check_pp_size(h):  # the split it describes is the one pp_layer_partition makes
    from loom.runtime.distributed import pp_layer_partition

    assert "the remainder one each to the stages counting back from the one before the last" in h
    assert pp_layer_partition(10, 4) == (2, 3, 3, 2)  # 2 left over: stages 2 and 1


def check_cpu_threads(h):
    from loom.runtime.cpu_topology import physical_cores

    _grab(h, r"\) - (1) \(one core")
    assert ServerArgs().effective_cpu_threads == max(1, physical_cores() - 1)


def check_max_request_body_bytes(h):
    import inspect

    from loom.runtime.server import app

    (status,) = _grab(h, r"\((\d+) beyond\)")
    assert f"error_response(too_big, {status})" in inspect.getsource(app)


def check_router_request_timeout(h):
    import inspect

    from loom.runtime.router import proxy

    (status,) = _grab(h, r"\((\d+) beyond\)")
    assert status in inspect.getsource(proxy)


def check_hicache_size(h):
    (n,) = _grab(h, r"(\d+): --hicache-ratio decides")
    assert ServerArgs().hicache_size == int(n)


def check_hicache_storage_url(h):
    from loom.radix import storage

    (url,) = _grab(h, r"default (redis://[\w.:/]+)\)")
    assert url == storage.DEFAULT_REDIS_URL


def check_quantization(h):
    from loom.runtime.layers.quant_types import BLOCKS

    (q8,) = _grab(h, r"int8 \(ggml Q8_0: int8 codes, one f16 scale per (\d+)\)")
    (q4,) = _grab(h, r"int4 \(ggml Q4_1: 4-bit codes, f16 scale and minimum per (\d+);")
    assert BLOCKS["Q8_0"][0] == int(q8) and BLOCKS["Q4_1"][0] == int(q4)


def check_quantized_matmul(h):
    (rows,) = _grab(h, r"for steps of up to (\d+) rows")
    src = (Path(__file__).resolve().parent.parent / "kernels" / "cpu" / "quant.c").read_text()
    (f32v_max,) = re.findall(r"#define F32V_MAX (\d+) ", src)
    assert int(rows) == int(f32v_max)


CHECKS = {
    ("serve", "cpu_forward"): check_cpu_forward,
    ("serve", "cuda_graph_max_bs"): check_cuda_graph_max_bs,
    ("serve", "speculative_num_draft_tokens"): check_speculative_num_draft_tokens,
    ("serve", "speculative_num_steps"): check_speculative_num_steps,
    ("serve", "speculative_ngram_max_bfs_breadth"): check_speculative_ngram_max_bfs_breadth,
    ("serve", "speculative_eagle_topk"): check_speculative_eagle_topk,
    ("serve", "chunked_prefill_size"): check_chunked_prefill_size,
    ("serve", "disaggregation_bootstrap_port"): check_disaggregation_bootstrap_port,
    ("serve", "pp_layer_partition"): check_pp_layer_partition,
    ("serve", "pp_size"): check_pp_size,
    ("serve", "cpu_threads"): check_cpu_threads,
    ("serve", "max_request_body_bytes"): check_max_request_body_bytes,
    ("serve", "hicache_size"): check_hicache_size,
    ("serve", "hicache_storage_url"): check_hicache_storage_url,
    ("serve", "quantization"): check_quantization,
    ("serve", "quantized_matmul"): check_quantized_matmul,
    ("router", "request_timeout"): check_router_request_timeout,
}
# Numbers that are names or other projects' values, not limits of loom's code.
NOT_LIMITS = {
    ("serve", "model_path"): "'gemma3-270m': a model's name",
    ("serve", "attention_backend"): "TRITON_INTERPRET=1: an environment setting",
    ("serve", "speculative_draft_model_path"): "EAGLE3 / Medusa-1: layout names",
    (
        "serve",
        "speculative_ngram_capacity",
    ): "SGLang's default, quoted; loom's is the (default: ...)",
    ("serve", "ep_size"): "'tp_size 1': the layout, checked by ServerArgs' validation tests",
    ("serve", "node_rank"): "'node 0': the node that serves HTTP",
}
HELPS = {("serve", k): v for k, v in SERVER_HELP.items()}
HELPS.update({("router", k): v for k, v in ROUTER_HELP.items()})


def test_every_number_in_help_is_checked():
    # a number: digits not inside a word or a path (qwen25, fp8_e5m2, /v1 are names)
    with_numbers = {key for key, text in HELPS.items() if re.search(r"(?<![\w/])\d", text)}
    unchecked = with_numbers - set(CHECKS) - set(NOT_LIMITS)
    assert not unchecked, f"help names a number no check reads: {sorted(unchecked)}"
    assert not (set(CHECKS) | set(NOT_LIMITS)) - set(HELPS), "a check names a flag that is gone"


@pytest.mark.parametrize("key", sorted(CHECKS), ids=lambda k: f"{k[0]}-{k[1]}")
def test_help_numbers_match_the_code(key):
    CHECKS[key](HELPS[key])


def test_cli_help_carries_the_checked_text():
    """What `loom serve --help` prints is the text checked above, with the real default."""
    import argparse

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    actions = {a.dest: a for a in parser._actions}
    assert actions["cpu_forward"].help.startswith(SERVER_HELP["cpu_forward"])
    assert actions["cpu_forward"].help.endswith(f"(default: {ServerArgs.cpu_forward})")
