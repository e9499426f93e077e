"""The distribution: `import loom` stays light, and the wheel carries every subpackage."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCE_DIRS = {
    "lang": "loom",
    "runtime": "loom/runtime",
    "grammar": "loom/grammar",
    "radix": "loom/radix",
    "kernels": "loom/kernels",
}


def test_import_loom_does_not_import_torch():
    code = "import sys, loom; print('torch' in sys.modules, loom.__version__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split()[0] == "False"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(out),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
    )
    return next(out.glob("loom-*.whl"))


def test_wheel_contains_every_subpackage(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for src, dest in SOURCE_DIRS.items():
        for init in (ROOT / src).rglob("__init__.py"):
            rel = init.relative_to(ROOT / src)
            assert f"{dest}/{rel.as_posix()}" in names, f"{src}/{rel} missing from the wheel"
    assert any(n.startswith("loom/runtime/bundled/") and n.endswith("config.json") for n in names)
    assert any(n.endswith("model.safetensors") for n in names)
    # the C sources loom.runtime.native builds at run time
    for name in ("loom_cpu.h", "blocks.h", "forward.c", "heads.c", "layout.c", ".clang-format"):
        assert f"loom/kernels/cpu/{name}" in names, f"kernels/cpu/{name} missing from the wheel"
