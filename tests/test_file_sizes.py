"""No Python file under runtime/ is over MAX_LINES lines: a file past it holds more than one
job (STYLE.md 1) and is split by job. Generated tables are the only exception, each named in
GENERATED with the command that writes it, and an entry stays only while its file exists and
is still over the limit."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 500
# path relative to the repository root -> the command that generates it
GENERATED: dict[str, str] = {}


def _line_count(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def test_no_runtime_file_is_over_the_limit():
    over = {
        str(p.relative_to(ROOT)): n
        for p in sorted((ROOT / "runtime").rglob("*.py"))
        if (n := _line_count(p)) > MAX_LINES
    }
    unlisted = {name: n for name, n in over.items() if name not in GENERATED}
    assert not unlisted, (
        f"runtime files over {MAX_LINES} lines (split each by job; only generated tables may "
        f"be listed in GENERATED): {unlisted}"
    )


def test_generated_exceptions_are_real():
    for name, command in GENERATED.items():
        path = ROOT / name
        assert path.is_file(), f"{name}: listed in GENERATED but missing"
        assert _line_count(path) > MAX_LINES, f"{name}: under the limit now; drop it from GENERATED"
        assert command, f"{name}: name the command that generates it"


def test_the_count_sees_a_long_file(tmp_path):
    """The counter the limit uses counts lines as wc -l does for a file ending in a newline."""
    f = tmp_path / "long.py"
    f.write_text("x = 1\n" * (MAX_LINES + 1))
    assert _line_count(f) == MAX_LINES + 1 > MAX_LINES
