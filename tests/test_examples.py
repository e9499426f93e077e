"""Every example runs end to end on the bundled model (one shared Engine, each example's
`main(backend)`)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BUNDLED = ROOT / "runtime" / "bundled"
EXAMPLES = sorted(p.stem for p in (ROOT / "examples").glob("*.py"))

pytestmark = pytest.mark.skipif(
    not (BUNDLED / "config.json").exists(), reason="the bundled model is not built yet"
)


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(
        f"loom_example_{name}", ROOT / "examples" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def engine():
    import loom

    eng = loom.Engine(max_total_tokens=16384)
    yield eng
    eng.shutdown()


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_runs(engine, name):
    module = load_example(name)
    result = module.main(engine)
    assert result is not None
