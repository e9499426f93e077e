from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """tiny_model_dir(family) -> path of a tiny checkpoint, built once per session."""
    from tests.tiny_models import build_tiny_model

    root: Path = tmp_path_factory.mktemp("tiny_models")

    def get(family: str = "llama") -> str:
        return str(build_tiny_model(family, root / family))

    return get


@pytest.fixture(scope="session")
def llama(tiny_model_dir):
    """The tiny llama checkpoint's path (the speculative-decoding tests' target)."""
    return tiny_model_dir("llama")


@pytest.fixture(scope="session")
def real_gguf():
    """real_gguf(name) -> path of a named real model's GGUF (`smollm2`, `gemma3-270m`): the
    installed package's file, else ~/.cache/loom/models, else fetched there once (registry)."""
    from loom.runtime.gguf.named import resolve_model_name

    return resolve_model_name
