"""scripts/gpu_check.sh cannot rot: its --dry-run (the same code on the CPU, tiny shapes,
Triton's interpreter, the CUDA-graph row through the graph runner's eager replay) runs here
and writes the table; without CUDA the full run refuses."""

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
    assert "| | decode batch 1 | decode batch 3 | prefill |" in table
    names = ("loom, triton backend, CUDA graphs \\(eager replay\\)", "loom, triton backend",
             "loom, torch backend", "HF generate")  # fmt: skip
    for name in names:
        row = re.search(rf"^\| {name} tok/s \| (.*) \|$", table, re.M)
        assert row, table
        assert all(float(x.replace(",", "")) > 0 for x in row.group(1).split(" | ")), row
    assert "triton and torch backends: 3 of 3 requests" in table
    assert "with CUDA graphs on and off (triton): 3 of 3." in table
    # every decode step of the graphs-on row went through the graph runner's buffers
    steps = re.search(r"through the graph runner: (\d+) of (\d+)\.", table)
    assert steps and int(steps.group(1)) == int(steps.group(2)) > 0, table
    assert re.search(
        r"CUDA graphs on / off, decode tok/s \(triton backend\): batch 1 [\d.]+x", table
    )
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
