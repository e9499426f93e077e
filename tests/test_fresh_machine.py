"""A newcomer runs Python and pytest from the checkout's root, where '' (or the root) is first on
sys.path: no top-level folder of the checkout may shadow an installed distribution of the same
name (transformers 5 imports Hugging Face's `kernels`; the checkout has a `kernels/` folder).

The mechanism (docs/architecture.md, "Packages"): runtime/, grammar/, radix/ and kernels/ have
no __init__.py, so from the root they are namespace portions, and the import system takes a
regular package found anywhere later on sys.path before a namespace portion. lang/ is loom's own
__init__ and stays a regular package: no distribution may provide a top-level `lang`.
"""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NAMESPACE_FOLDERS = ("runtime", "grammar", "radix", "kernels")


def _from_root(code: str, *extra_path: str) -> dict:
    """Run `code` with the checkout's root first on sys.path (as `python -m pytest` or `python -c`
    from the root have it) and `extra_path` after site-packages; it prints one JSON value."""
    prelude = f"import sys; sys.path[:0] = [{str(ROOT)!r}]; sys.path += {list(extra_path)!r}\n"
    out = subprocess.run(
        [sys.executable, "-c", prelude + code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _origins(names) -> dict:
    code = (
        "import importlib.util, json\n"
        "def where(n):\n"
        "    s = importlib.util.find_spec(n)\n"
        "    return None if s is None else [s.origin, list(s.submodule_search_locations or [])]\n"
        f"print(json.dumps({{n: where(n) for n in {list(names)!r}}}))"
    )
    return code


def _inside_checkout(spec) -> bool:
    if spec is None:
        return False
    origin, locations = spec
    paths = [p for p in [origin, *locations] if p and p.startswith("/")]
    return any(Path(p).resolve().is_relative_to(ROOT) for p in paths)


def test_no_installed_distribution_is_shadowed_by_a_top_level_folder():
    folders = sorted(p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith("."))
    provided = importlib.metadata.packages_distributions()
    installed = [f for f in folders if f in provided]
    assert "kernels" in installed or "kernels" not in folders, (
        "transformers' dependency `kernels` is expected in the test environment"
    )
    specs = _from_root(_origins(installed))
    shadowed = {n: specs[n] for n in installed if _inside_checkout(specs[n])}
    assert not shadowed, f"checkout folders shadow installed distributions: {shadowed}"


def test_a_regular_package_of_any_folder_name_wins_over_the_checkout(tmp_path):
    """What a future distribution named `runtime`, `grammar`, `radix` or `kernels` would get:
    a regular package later on sys.path than the root is the one found."""
    for name in NAMESPACE_FOLDERS:
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("")
    specs = _from_root(_origins(NAMESPACE_FOLDERS), str(tmp_path))
    for name in NAMESPACE_FOLDERS:
        assert not (ROOT / name / "__init__.py").exists(), f"{name}/__init__.py makes it shadow"
        origin = specs[name][0]  # ours, or an installed one (kernels) that sits earlier still
        assert origin and origin.endswith("__init__.py"), (name, specs[name])
        assert not _inside_checkout(specs[name]), (name, specs[name])


def test_lang_is_provided_by_no_distribution():
    # lang/ is loom's __init__ (a regular package): an installed `lang` would be shadowed from the
    # root. Should one ever be needed, the fix belongs in the layout, not in this assertion.
    assert "lang" not in importlib.metadata.packages_distributions()


def test_transformers_hub_kernels_and_loom_kernels_from_the_root():
    pytest.importorskip("kernels")
    code = (
        "import json, kernels, loom.kernels.interpret as own\n"
        "from transformers.integrations import hub_kernels\n"
        "print(json.dumps([kernels.__file__, own.__file__, hub_kernels.__name__]))"
    )
    hf, own, hub = _from_root(code)
    assert not Path(hf).resolve().is_relative_to(ROOT), hf
    assert Path(own).resolve() == ROOT / "kernels" / "interpret.py"
    assert hub == "transformers.integrations.hub_kernels"
