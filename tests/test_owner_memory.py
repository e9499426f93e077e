"""The process that owns an Engine (the user's) holds the tokenizer and the request state, not
the model: it must not import torch (~200 MB of resident memory per process; docs/benchmarks.md
"Issue 32: peak RSS of loom's process tree"). Only the scheduler ranks, started from the fork
server that preloads it, do. Each case runs in a fresh interpreter: this test process has torch."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import sys
import loom

if __name__ == "__main__":
    engine = loom.Engine(None if sys.argv[1] == "bundled" else sys.argv[1], log_level="warning",
                         random_seed=0, max_total_tokens=512)
    try:
        params = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
        out = engine.generate("Hello", params)
        assert out["meta_info"]["completion_tokens"] == 4, out
    finally:
        engine.shutdown()
    print("torch" in sys.modules, "loom.runtime.model_runner" in sys.modules)
"""


def owner_imports(model: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, model], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.split()[-2:]


def test_engine_owner_does_not_import_torch_bundled():
    assert owner_imports("bundled") == ["False", "False"]


def test_engine_owner_does_not_import_torch_gguf(real_gguf):
    assert owner_imports(real_gguf("smollm2")) == ["False", "False"]
