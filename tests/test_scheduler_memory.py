"""What the scheduler keeps resident for a model, where a cut could come back unnoticed
(docs/benchmarks.md, "Issue 32: where the scheduler's memory goes"): rotary tables sized to the
positions the KV pool can serve, not to the model's whole context (Gemma 3 270M: 128 MB at
32k positions); a GGUF file's metadata arrays not held as Python lists by the cached reader
(Gemma 3's vocabulary: 43 MB)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loom.runtime.layers.rotary import RotaryEmbedding, served_positions
from loom.runtime.model_runner import ModelRunner
from loom.runtime.server_args import ServerArgs
from tests.gguf_files import write_gguf
from tests.runtime_helpers import make_scheduler, run_all, submit

SCALINGS = [
    None,
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 256},
]  # fmt: skip


@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("head_dim, max_position, rows", [(64, 8192, 224), (256, 32768, 5184), (64, 1024, 7)])  # fmt: skip
def test_a_served_table_is_the_full_tables_first_rows(scaling, head_dim, max_position, rows):
    """Bit for bit: the frequencies follow max_position (yarn reads it), only the rows stop."""
    full = RotaryEmbedding(head_dim, max_position, 10000.0, scaling)
    with served_positions(rows):
        cut = RotaryEmbedding(head_dim, max_position, 10000.0, scaling)
    assert cut.cos_cache.shape == (rows, head_dim)
    assert torch.equal(cut.cos_cache, full.cos_cache[:rows])
    assert torch.equal(cut.sin_cache, full.sin_cache[:rows])
    with served_positions(10 * max_position):  # never past the model's own
        assert (
            RotaryEmbedding(head_dim, max_position, 10000.0, scaling).cos_cache.shape[0]
            == max_position
        )


def _tables(runner: ModelRunner) -> set[int]:
    return {layer.self_attn.rotary_emb.cos_cache.shape[0] for layer in runner.model.model.layers}


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_rotary_tables_follow_the_pool_and_the_context_length(tiny_model_dir, family):
    """The tiny models' context is 1,024 positions: a 64-token pool (page 1, one padding
    slot) gets 65-row tables, a context length below that its own, the CPU default pool
    (far more tokens than the context) the whole context."""
    path = tiny_model_dir(family)

    def runner(**kw) -> ModelRunner:
        return ModelRunner(ServerArgs(model_path=path, dtype="float32", **kw))

    assert _tables(runner(max_total_tokens=64)) == {65}
    assert _tables(runner(max_total_tokens=64, context_length=40)) == {40}
    assert _tables(runner()) == {1024}


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_request_filling_the_pool_runs_to_its_last_slot(tiny_model_dir, family):
    """Tables sized to the pool still cover its last slot: a prompt and output that fill a
    64-token pool (its output capped at 64 - prompt) decode to the end, the C forward and
    eager giving the same tokens."""
    path = tiny_model_dir(family)
    out = {}
    for mode in ("eager", "auto"):
        sched = make_scheduler(path, cpu_forward=mode, max_total_tokens=64, page_size=1)
        assert (sched.runner.cpu_forward is not None) == (mode == "auto")
        submit(sched, "r", list(range(5, 45)), {"max_new_tokens": 100, "temperature": 0,
                                               "ignore_eos": True})  # fmt: skip
        out[mode] = run_all(sched)["r"].ids
    assert len(out["auto"]) == 64 - 40
    assert out["auto"] == out["eager"]


def test_gguf_metadata_arrays_are_decoded_on_read_not_kept(tiny_model_dir, tmp_path):
    """Each read of an array gives a fresh list equal to the last (nothing holds them), and
    the header holds no list after the file is opened."""
    from loom.runtime.gguf.reader import GGUFFile

    file = write_gguf(Path(tiny_model_dir("llama")), tmp_path / "llama.gguf", "F32")
    meta = GGUFFile(str(file)).fields
    tokens = meta["tokenizer.ggml.tokens"]
    assert (
        isinstance(tokens, list) and len(tokens) > 100 and all(isinstance(t, str) for t in tokens)
    )
    assert meta["tokenizer.ggml.tokens"] == tokens and meta["tokenizer.ggml.tokens"] is not tokens
    assert meta.get("tokenizer.ggml.token_type") == meta["tokenizer.ggml.token_type"]
    assert not [k for k, v in meta._values.items() if isinstance(v, list)]
