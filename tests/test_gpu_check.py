"""scripts/gpu_check.sh cannot rot: its --dry-run (the same code on the CPU, tiny shapes,
Triton's interpreter) runs here and writes the table; without CUDA the full run refuses."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.sh"


def test_dry_run_writes_the_table(tmp_path):
    out = tmp_path / "table.md"
    run = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    table = out.read_text()
    assert "| | decode batch 1 | decode batch 2 | prefill |" in table
    for name in ("loom, triton backend", "loom, torch backend", "HF generate"):
        row = re.search(rf"^\| {name} tok/s \| (.*) \|$", table, re.M)
        assert row, table
        assert all(float(x.replace(",", "")) > 0 for x in row.group(1).split(" | ")), row
    assert "triton and torch backends: 2 of 2 requests" in table
    micro = re.search(r"Triton kernel [\d,]+ us, torch .* [\d,]+ us .*difference (\S+)\)", table)
    assert micro and float(micro.group(1)) < 1e-4, table


@pytest.mark.skipif(torch.cuda.is_available(), reason="the full run needs no CUDA to refuse")
def test_full_run_refuses_without_cuda(tmp_path):
    run = subprocess.run(
        ["bash", str(SCRIPT), "--out", str(tmp_path / "t.md")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode != 0 and "no CUDA device" in run.stderr
    assert not (tmp_path / "t.md").exists()
