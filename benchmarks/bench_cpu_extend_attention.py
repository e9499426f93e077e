"""Where the CPU extend kernel stops paying: cpu_paged's C extend attention against the torch
backend's path (per request: gather K/V through req_to_token, SDPA with the mask), one layer,
one thread, bundled-model shapes (4 query / 2 kv heads, head_dim 64), every request with a
cached prefix of --context tokens and E new tokens (causal; --tree: a draft tree's mask).

    python benchmarks/bench_cpu_extend_attention.py [--batch-sizes 1,8,32]
        [--extends 1,2,4,8,16,32,64] [--context 192] [--repeats 5] [--tree]

Per (B, E): median microseconds per layer call of each side over --repeats alternating
rounds, and torch / kernel (above 1: the kernel is faster). cpu_paged takes the kernel for
extends up to runtime/attention/cpu_paged.MAX_KERNEL_EXTEND new tokens per request.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from types import SimpleNamespace

import torch

from loom.runtime.attention import cpu_paged
from loom.runtime.attention.torch_backend import TorchAttnBackend
from loom.runtime.forward_batch import ForwardMode
from loom.runtime.model_runner import tree_mask


class _Pool:
    def __init__(self, k_buf, v_buf):
        self.k_buffers, self.v_buffers = [k_buf], [v_buf]

    def set_kv(self, layer_id, slots, k, v):
        self.k_buffers[0][slots] = k
        self.v_buffers[0][slots] = v

    def get_kv(self, layer_id):
        return self.k_buffers[0], self.v_buffers[0]


def _batch(b, e, context, tree, g):
    seq = context + e
    slots = torch.randperm(b * seq + 64, generator=g)[: b * seq] + 1
    table = slots.view(b, seq).contiguous()
    k_buf = torch.randn(b * seq + 65, 2, 64, generator=g)
    v_buf = torch.randn(b * seq + 65, 2, 64, generator=g)
    masks = None
    if tree:  # a breadth-first tree: node i's parent is (i - 1) // 2, the root's children -1
        masks = [tree_mask(context, [(i - 1) // 2 if i else -1 for i in range(e - 1)], "cpu")] * b
    return SimpleNamespace(
        mode=ForwardMode.EXTEND,
        seq_lens_cpu=[seq] * b,
        prefix_lens_cpu=[context] * b,
        req_pool_indices=torch.arange(b),
        req_to_token_pool=SimpleNamespace(req_to_token=table),
        token_to_kv_pool=_Pool(k_buf, v_buf),
        out_cache_loc=table[:, context:].reshape(-1).contiguous(),
        custom_masks=masks,
        attn_metadata=None,
    )


def _time(backend, batch, q, k, v, layer, n=20):
    backend.init_forward_metadata(batch)
    t0 = time.perf_counter()
    for _ in range(n):
        backend.forward_extend(q, k, v, layer, batch)
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--extends", default="1,2,4,8,16,32,64")
    p.add_argument("--context", type=int, default=192)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--tree", action="store_true", help="draft-tree masks instead of causal")
    args = p.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    layer = SimpleNamespace(layer_id=0, num_heads=4, v_head_dim=64, scaling=0.125, is_gqa=True)
    sides = {"torch": TorchAttnBackend(), "kernel": cpu_paged.CpuPagedAttnBackend()}
    cpu_paged.MAX_KERNEL_EXTEND = 1 << 30  # the kernel side takes every E measured here
    print(f"load {os.getloadavg()[0]:.1f}; context {args.context}; tree {args.tree}")
    print("| B | E | torch us | kernel us | torch / kernel |")
    print("|---|---|---|---|---|")
    for b in map(int, args.batch_sizes.split(",")):
        for e in map(int, args.extends.split(",")):
            if args.tree and e < 2:
                continue
            batch = _batch(b, e, args.context, args.tree, g)
            q = torch.randn(b * e, 4, 64, generator=g)
            k, v = torch.randn(b * e, 2, 64, generator=g), torch.randn(b * e, 2, 64, generator=g)
            times = {name: [] for name in sides}
            for _ in range(args.repeats):
                for name, side in sides.items():
                    times[name].append(_time(side, batch, q, k, v, layer))
            t, c = statistics.median(times["torch"]), statistics.median(times["kernel"])
            print(f"| {b} | {e} | {t:.0f} | {c:.0f} | {t / c:.2f}x |", flush=True)
    print(f"load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
