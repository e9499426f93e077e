"""The llama.cpp peer's pre-tokenizer mapping (benchmarks/peers/llamacpp.py), without llama.cpp.

The benchmark models' vocabularies are in no table of llama.cpp's converter, so the harness names
the llama.cpp pre-tokenizer itself: the one whose split equals, on sample texts, the split of the
HF tokenizer as transformers.AutoTokenizer loads it (what loom and the HF baselines use). The
same tokenizer.json loads with tokenizer.json's own pre-tokenizer under a Qwen3 config and with
Qwen2's regex under a Qwen2 config (transformers 5's Qwen2Tokenizer), which is why the 0.5B-shaped
(Qwen2) benchmark model once tokenized "\\n\\n" differently in llama.cpp than in loom.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from loom.runtime.server_args import BUNDLED_MODEL_PATH
from tests.file_modules import load_file

pytest.importorskip("regex")


@pytest.fixture(scope="module")
def llamacpp():
    return load_file("benchmarks/peers/llamacpp.py", "bench_llamacpp")


def _as_qwen2(tmp_path: Path) -> Path:
    """The bundled tokenizer files under a Qwen2 config (as benchmarks/common.py builds them)."""
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(BUNDLED_MODEL_PATH) / f, tmp_path / f)
    cfg = json.loads((Path(BUNDLED_MODEL_PATH) / "config.json").read_text())
    cfg.update(model_type="qwen2", architectures=["Qwen2ForCausalLM"])
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_bundled_model_maps_to_refact(llamacpp):
    assert llamacpp.pre_tokenizer(str(BUNDLED_MODEL_PATH)) == "refact"


def test_qwen2_config_maps_to_qwen2(llamacpp, tmp_path):
    assert llamacpp.pre_tokenizer(str(_as_qwen2(tmp_path))) == "qwen2"


def test_reference_splits_tell_the_candidates_apart(llamacpp):
    """Each candidate's split differs from the other's on some sample, so a wrong mapping is
    caught; "\\n\\n" before a letter is one piece in Qwen2's regex, two in GPT-2's."""
    text = "tabs\n\nand"
    assert llamacpp._split("qwen2", text) == ["tabs", "ĊĊ", "and"]
    assert llamacpp._split("refact", text) == ["tabs", "Ċ", "Ċ", "and"]
    for a in llamacpp.PRE_TOKENIZERS:
        for b in llamacpp.PRE_TOKENIZERS:
            if a != b:
                assert any(llamacpp._split(a, t) != llamacpp._split(b, t) for t in llamacpp.SAMPLES)


def test_a_split_matching_no_candidate_is_refused(llamacpp, tmp_path):
    """A pre-tokenizer llama.cpp has no reference for here (whitespace only) is refused by name."""
    path = Path(BUNDLED_MODEL_PATH)
    for f in ("config.json", "tokenizer_config.json"):
        shutil.copy(path / f, tmp_path / f)
    tok = json.loads((path / "tokenizer.json").read_text())
    tok["pre_tokenizer"] = {"type": "WhitespaceSplit"}
    (tmp_path / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(SystemExit, match="like none of llama.cpp's"):
        llamacpp.pre_tokenizer(str(tmp_path))
