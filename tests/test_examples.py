"""Every example runs end to end on the bundled model (one shared Engine, each example's
`main(backend)`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.file_modules import load_file

ROOT = Path(__file__).resolve().parent.parent
BUNDLED = ROOT / "runtime" / "bundled"
EXAMPLES = sorted(p.stem for p in (ROOT / "examples").glob("*.py"))

pytestmark = pytest.mark.skipif(
    not (BUNDLED / "config.json").exists(), reason="the bundled model is not built yet"
)


def load_example(name: str):
    return load_file(f"examples/{name}.py", f"loom_example_{name}")


@pytest.fixture(scope="module")
def engine():
    import loom

    eng = loom.Engine(max_total_tokens=16384)
    yield eng
    eng.shutdown()


def _check(name: str, result) -> None:
    """What holds whatever the model says (decoding constraints, program structure), plus
    one fact the bundled model reliably knows."""
    if name == "quick_start":
        assert "Paris" in result["answer_1"]
    elif name == "json_extraction":
        for state in result:
            assert set(json.loads(state["person"])) == {"name", "age", "job"}
    elif name == "react_agent":  # every call names a tool with the arguments it takes
        calls = result.get_meta_info("trace")["tool_calls"]
        assert result.ret_value and all(
            set(c["arguments"]) <= {"query", "expression", "city"} for c in calls
        )
    elif name == "tool_agent":  # tool_choice="required": at least one valid call
        calls = result.get_meta_info("answer")["tool_calls"]
        assert calls and calls[0]["name"] in ("get_weather", "calculator")
    elif name == "tree_of_thought":
        assert result["answer"] in [c.strip() for c in result["candidate"]] + ["I do not know."]
    elif name == "parallel_sampling":
        assert len(result[0]["story"]) == 3 and len(result[1]["answer"]) == 3
    elif name == "few_shot_qa":
        assert len(result) == 6 and "Paris" in result[0]["answer"]


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_runs(engine, name):
    module = load_example(name)
    result = module.main(engine)
    assert result is not None
    _check(name, result)
