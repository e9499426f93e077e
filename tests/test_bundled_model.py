"""The bundled model: `Engine()` with no arguments loads it quickly and it answers chats."""

from __future__ import annotations

import json
import time

import pytest

import loom
from loom.runtime.server_args import BUNDLED_MODEL_PATH


@pytest.fixture(scope="module")
def timed_engine():
    t = time.perf_counter()
    engine = loom.Engine()
    elapsed = time.perf_counter() - t
    yield engine, elapsed
    engine.shutdown()


def _chat(engine, text: str, max_new: int = 40) -> str:
    prompt = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
    out = engine.generate(prompt, {"max_new_tokens": max_new, "temperature": 0})
    assert out["meta_info"]["finish_reason"]["type"] == "stop"  # it ends its turn by itself
    return out["text"]


def test_engine_with_no_arguments_uses_the_bundled_model(timed_engine):
    engine, elapsed = timed_engine
    assert engine.server_args.model_path == BUNDLED_MODEL_PATH
    # a bound that catches a start-up doing real work (loading a hub model, training), not a
    # speed gate: three processes import torch, which took 33 s at load 8 on 2 cores
    assert elapsed < 90.0, f"Engine() took {elapsed:.1f} s"


def test_it_answers_a_chat_prompt(timed_engine):
    engine, _ = timed_engine
    assert "Paris" in _chat(engine, "What is the capital of France?")


def test_it_answers_extraction_with_json(timed_engine):
    engine, _ = timed_engine
    answer = _chat(engine, "Extract the name and age as JSON: Bob is 42 and lives in Rome.")
    assert json.loads(answer)["name"] == "Bob"
