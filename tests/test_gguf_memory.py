"""The GGUF loader holds each weight once: loading a file's block-quantized tensors grows the
process by about their bytes, at the peak and after, and leaves none of the file's pages
resident (runtime/gguf/reader.py read_into / drop_all). A copy out of the memory map held
the map's pages beside the copy until each tensor was done: Gemma 3's 170 MB embedding
peaked +340 MB. Measured in a fresh interpreter, from /proc (Linux only)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.test_gguf_files import _random_blocks

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/smaps").is_file(), reason="reads /proc/self/status and smaps"
)

_MEASURE = r"""
import json, sys
from pathlib import Path

def status():
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, val = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(val.split()[0]) * 1024
    return out

def map_resident(path):  # bytes of `path`'s mappings resident in this process
    total, cur = 0, None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        f = line.split()
        if len(f) >= 5 and "-" in f[0] and ":" not in f[0]:
            cur = f[5] if len(f) > 5 else None
        elif f and f[0] == "Rss:" and cur == path:
            total += int(f[1]) * 1024
    return total

from loom.runtime.gguf.file import open_reader
from loom.runtime.gguf.weights import iterate_gguf_weights
from loom.runtime.layers.quant_types import QuantizedTensor

path = sys.argv[1]
open_reader(path)  # the header: parsed before the measure
before = status()["VmRSS"]
try:
    Path("/proc/self/clear_refs").write_text("5")  # the peak from here
except OSError:
    pass  # the peak then runs from the start: the imports', below the load's here
kept = list(iterate_gguf_weights(path, keep_quantized=True))
s = status()
print(json.dumps({
    "peak": s["VmHWM"] - before, "after": s["VmRSS"] - before, "map": map_resident(path),
    "blocks": sum(w.data.numel() for _, w in kept if isinstance(w, QuantizedTensor)),
}))
"""


def test_loading_holds_each_weight_once(tmp_path):
    import gguf

    rng = np.random.default_rng(0)
    file = tmp_path / "big.gguf"
    w = gguf.GGUFWriter(str(file), "llama")
    w.add_head_count(4)
    w.add_head_count_kv(2)
    # a 17.8 MB Q8_0 embedding (a double hold shows as +17.8 MB over the bound), q/k rows
    # the loader permutes (a copy of their own), a float norm
    w.add_tensor("token_embd.weight", _random_blocks("Q8_0", 16384, 1024, rng),
                 raw_dtype=gguf.GGMLQuantizationType.Q8_0)  # fmt: skip
    w.add_tensor("blk.0.attn_q.weight", _random_blocks("Q4_0", 1024, 1024, rng),
                 raw_dtype=gguf.GGMLQuantizationType.Q4_0)  # fmt: skip
    w.add_tensor("blk.0.attn_k.weight", _random_blocks("Q4_0", 512, 1024, rng),
                 raw_dtype=gguf.GGMLQuantizationType.Q4_0)  # fmt: skip
    w.add_tensor("blk.0.attn_norm.weight", rng.standard_normal(1024).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    out = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(file)], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    mb = 2**20
    assert got["blocks"] == 16384 * 1088 + 1024 * 576 + 512 * 576
    # the file's pages are not part of the process once loaded (their bytes live in the copies)
    assert got["map"] <= 64 * 1024, got
    # each weight once: what the load leaves, and its peak, are the blocks plus a little
    # (interpreter and allocator bookkeeping, one q/k tensor's permuted copy)
    assert got["after"] <= got["blocks"] + 4 * mb, got
    assert got["peak"] <= got["blocks"] + 6 * mb, got
