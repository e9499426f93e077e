"""The MaskBench subsets the tests use, vendored in tests/data (see tests/data/README.md), so a
fresh clone runs every test without the full corpus beside it."""

from __future__ import annotations

import json
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data" / "maskbench"
_SUBSETS = json.loads((DATA.parent / "maskbench_subsets.json").read_text())["subsets"]


def subset(name: str) -> list[str]:
    """File names of one subset: every n-th file of the full corpus in sorted name order."""
    return _SUBSETS[name]
