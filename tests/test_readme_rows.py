"""README.md's figure rows (benchmarks/readme_rows.py, `run_all.py --readme`): every command
the README's table names runs a script that exists with flags it defines, and the row parsers
read the figures back from what the benchmarks' own formatting functions print."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.file_modules import load_file
from tests.test_bench_engine_room import _row

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def rows():
    return load_file("benchmarks/readme_rows.py", "readme_rows")


def _commands(text: str) -> list[str]:
    return re.findall(r"`python (benchmarks/\S+\.py[^`]*)`", text)


def _check_flags(command: str) -> None:
    script, *args = command.split()
    source = (ROOT / script).read_text()
    for flag in (a.split("=")[0] for a in args if a.startswith("--")):
        assert f'"{flag}"' in source, f"{script} defines no {flag} (README command: {command})"


def test_every_readme_table_command_names_a_script_and_its_flags(rows):
    table = (ROOT / "README.md").read_text().split("## Benchmarks", 1)[1]
    commands = _commands(table)
    assert len(commands) >= 8
    for command in commands:
        _check_flags(command)
    for row in rows.ROWS:  # and run_all --readme's own commands
        for c in row.commands:
            _check_flags("benchmarks/" + c.format(logdir="/tmp/x"))


def test_a_ratio_is_read_back_as_printed(rows):
    common = load_file("benchmarks/common.py", "common")
    printed = common.fmt_ratio([3.0, 2.0, 5.0], [2.0, 2.0, 2.0])
    assert printed == "1.50x (range 1.00-2.50, 3 rounds)"
    assert rows.ratio(printed) == "1.50x (1.00–2.50)"
    with pytest.raises(rows.RowError):
        rows.ratio("1.50x")  # no range: a ratio without its spread is not a row


def test_engine_room_rows_are_read_from_format_row(rows):
    """Two batch sizes as bench_engine_room prints them: loom's median decode tok/s, both -fa
    settings (the faster marked) and the ratio against the faster, with the rows' loads."""
    room = load_file("benchmarks/bench_engine_room.py", "bench_engine_room")
    printed = []
    for b, decode, load in ((1, 0.5, 3.25), (32, 1.3, 4.5)):
        row = _row(b, decode, 1.0)
        row["load"] = load
        row.update(llama_decode_fa_off=[1000.0, 990.0, 1010.0],
                   llama_decode_fa_auto=[900.0, 950.0, 800.0],
                   llama_prefill_fa_off=[4000.0] * 3, llama_prefill_fa_auto=[4100.0] * 3)  # fmt: skip
        row["cpu_paged_decode"] = [1000 * decode * x for x in (1.0, 0.9, 1.1)]
        room.quote_faster_fa(row)
        printed.append(room.format_row(row))
    text = "engine room: commit abc1234, load average 2.00 1.00 1.00\n" + "\n".join(printed)
    cells = rows.engine_room(text)
    assert [c[1] for c in cells] == ["500", "1300"]
    assert cells[0][2] == "llama.cpp -fa off 1000* / -fa auto 900"
    assert cells[0][3] == "0.50x (0.45–0.54)" and cells[1][3] == "1.30x (1.18–1.42)"
    assert rows.provenance(text) == "commit `abc1234`, load 2.0–4.5"


def test_a_missing_figure_fails_loudly(rows):
    with pytest.raises(rows.RowError, match="serving"):
        rows.serving("bench_serving: commit abc1234\nnothing measured\n")
