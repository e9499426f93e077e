"""The C forward over numpy arrays: a GGUF model's forward without torch in the process.

runtime/cpu_forward.py binds kernels/cpu/forward.c to a torch model (its parameters, its KV
pool's tensors); this module binds the same C function to numpy arrays read straight from a
GGUF file: the file's quantized block rows (q/k rows un-permuted as loom's loader does), its
float32 norms, rotary tables computed as layers/rotary.py computes them, and a KV pool and
req-to-token table of its own. The Model / Layer structs are cpu_abi's, shared with
cpu_forward, so the two bindings hand the C side the same layout; for the same weights, tables,
pool and step the logits are the same bits (tests/test_cpu_model.py).

It is the torch-free base of the serving path on a GGUF / C-forward model: python + torch is
~213 MB of resident memory before any model, numpy ~15 MB (docs/benchmarks.md, "Issue 32: a
serving process without torch"). What it covers is what CpuForward covers for GGUF files
(Llama-family and Gemma 3, one rank, a float32 or bfloat16 pool, steps of up to MAX_TOKENS);
runtime/array_runner.py serves it to the scheduler.
"""

from __future__ import annotations

import ctypes
import math
import os
from types import SimpleNamespace

import numpy as np

from loom.runtime.cpu_abi import MODES, PANEL, QTYPES, _Layer, _Model, _QMat, _QSeg, load
from loom.runtime.gguf.config import _layer_types, _rope
from loom.runtime.gguf.file import metadata, open_reader
from loom.runtime.gguf.names import fix_float, fix_values, hf_name

MAX_TOKENS = 8192  # cpu_forward.MAX_TOKENS: the largest step the C forward is measured at
KV_DTYPES = {"float32": np.float32, "bf16": np.uint16}  # bfloat16 held as its 16 bits


def rope_tables(head_dim: int, rows: int, base: float, factor: float | None = None):
    """cos / sin [rows, head_dim] float32 of a default (or linearly scaled) neox rope, in
    layers/rotary.py's order of float32 operations."""
    inv_freq = np.float32(1.0) / (
        np.float32(base) ** (np.arange(0, head_dim, 2).astype(np.float32) / np.float32(head_dim))
    )
    if factor:
        inv_freq = inv_freq / np.float32(factor)
    freqs = np.arange(rows, dtype=np.float32)[:, None] * inv_freq[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(emb), np.sin(emb)


def pack(w: np.ndarray) -> np.ndarray:
    """cpu_forward.pack for a float32 [N, K] array: [ceil(N / 16), K, 16] panels."""
    n, k = w.shape
    padded = np.zeros((-(-n // PANEL) * PANEL, k), dtype=np.float32)
    padded[:n] = w
    return np.ascontiguousarray(padded.reshape(-1, PANEL, k).transpose(0, 2, 1))


def read_gguf(path: str) -> tuple[SimpleNamespace, dict[str, tuple[str, np.ndarray]]]:
    """(config, weights): weights[hf name] = (qtype, uint8 block rows) for a block type the C
    kernels read, ("F32", float32 array) otherwise, the values iterate_gguf_weights(
    keep_quantized=True) yields; the config holds the fields the C forward's Model struct takes.
    Block rows the loader does not permute stay views of the file's map (the cached reader
    keeps it open), so they are file-backed pages, not copies."""
    meta = metadata(path)
    arch = meta["general.architecture"]

    def get(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    heads, hidden = get("attention.head_count"), get("embedding_length")
    cfg = SimpleNamespace(
        arch=arch, gemma=arch == "gemma3", hidden=hidden, heads=heads,
        kv_heads=get("attention.head_count_kv", heads),
        head_dim=get("attention.key_length", hidden // heads),
        inter=get("feed_forward_length"), layers=get("block_count"),
        vocab=get("vocab_size") or len(meta["tokenizer.ggml.tokens"]),
        max_pos=get("context_length", 2048), eps=get("attention.layer_norm_rms_epsilon", 1e-6),
        softcap=get("final_logit_softcapping"),
    )  # fmt: skip
    if cfg.gemma:
        factor = get("rope.scaling.factor")
        cfg.global_rope = (float(get("rope.freq_base", 1_000_000.0)), factor and float(factor))
        cfg.local_rope = (float(get("rope.freq_base_swa", 10000.0)), None)
        cfg.window = get("attention.sliding_window", 4096)
        ns = SimpleNamespace(num_hidden_layers=cfg.layers)
        cfg.sliding = [t == "sliding_attention" for t in _layer_types(
            get("attention.sliding_window_pattern"), ns)]  # fmt: skip
    else:
        rope = _rope(get, "rope_theta")
        factor = (rope.get("rope_scaling") or {}).get("factor")
        cfg.global_rope = (float(rope["rope_theta"]), factor)
    weights = {}
    reader = open_reader(path)
    for tensor in reader.tensors:
        name = hf_name(arch, tensor.name)
        qtype = tensor.tensor_type.name
        shape = tuple(int(n) for n in reversed(tensor.shape))
        rows = fix_values(arch, name, np.asarray(tensor.data), heads, cfg.kv_heads)
        if qtype in QTYPES and np.shares_memory(rows, tensor.data):
            # read in place from the map (the C side only reads): no anonymous copy, and no
            # transient of map + copy (Gemma 3's Q8_0 embedding is 178 MB)
            weights[name] = (qtype, np.ascontiguousarray(rows))
            continue
        if qtype in QTYPES:  # un-permuted q / k rows: a copy
            weights[name] = (qtype, np.array(rows, dtype=np.uint8))
        elif qtype in ("F32", "F16"):
            values = fix_float(arch, name, rows.astype(np.float32).reshape(shape))
            weights[name] = ("F32", np.ascontiguousarray(values, dtype=np.float32))
        else:
            raise ValueError(f"model_path: GGUF tensor {tensor.name!r} is {qtype}, which the "
                             "torch-free C forward does not read")  # fmt: skip
        reader.drop_pages(tensor)
    return cfg, weights


class ArrayForward:
    """The C forward over one GGUF model's numpy weights and its own KV pool.

    Pool: `k[i]` / `v[i]` [kv_rows, kv_heads, head_dim] per layer (float32, or bfloat16 bits as
    uint16); `req_to_token` [max_reqs, max_context] int64, as memory_pool's. The caller owns
    slot and row allocation, as the scheduler owns them for CpuForward."""

    def __init__(self, path: str, *, kv_rows: int, max_reqs: int = 64, max_context: int = 4096,
                 kv_dtype: str = "float32", mode: str = "auto", rotary_rows: int | None = None,
                 isa: str = "native"):  # fmt: skip
        self.lib = load(isa)
        if self.lib is None:
            raise RuntimeError("the C forward needs a C compiler (runtime/native.py)")
        cfg, w = read_gguf(path)
        self.cfg, self.weights = cfg, w
        self._keep: list = []  # every array whose pointer the C side holds
        L, Hkv, D = cfg.layers, cfg.kv_heads, cfg.head_dim
        self.k = [np.zeros((kv_rows, Hkv, D), KV_DTYPES[kv_dtype]) for _ in range(L)]
        self.v = [np.zeros((kv_rows, Hkv, D), KV_DTYPES[kv_dtype]) for _ in range(L)]
        self.req_to_token = np.zeros((max_reqs, max_context), dtype=np.int64)
        rows = min(cfg.max_pos, rotary_rows or cfg.max_pos)
        tables = {key: rope_tables(D, rows, *key) for key in
                  {cfg.global_rope, *([cfg.local_rope] if cfg.gemma else [])}}  # fmt: skip

        def p(a: np.ndarray | None) -> int | None:
            if a is None:
                return None
            assert a.flags.c_contiguous and a.dtype in (np.float32, np.uint16)
            self._keep.append(a)
            return a.ctypes.data

        def get(name: str) -> tuple[str, np.ndarray] | None:
            return w.get(name)

        def fl(name: str) -> int | None:  # a float tensor, None when absent
            t = get(name)
            if t is not None and t[0] != "F32":
                raise ValueError(f"{name} is {t[0]}: a norm or bias must be float")
            return None if t is None else p(t[1])

        def mat(names: list[str]) -> tuple[int | None, int | None, int | None]:
            """(float row-major, packed panels, _QMat) pointers of the fused matrix `names`."""
            parts = [w[n] for n in names]
            if all(q != "F32" for q, _ in parts):
                segs, row0 = [], 0
                for qtype, data in parts:
                    segs.append(_QSeg(QTYPES[qtype], row0, data.shape[0], data.shape[1],
                                      data.ctypes.data))  # fmt: skip
                    row0 += data.shape[0]
                    self._keep.append(data)
                arr = (_QSeg * len(segs))(*segs)
                m = _QMat(len(segs), ctypes.addressof(arr))
                self._keep += [arr, m]
                return None, None, ctypes.addressof(m)
            if any(q != "F32" for q, _ in parts):
                raise ValueError(f"{names}: float and quantized parts in one fused matrix")
            full = np.ascontiguousarray(np.concatenate([a for _, a in parts]))
            return p(full), p(pack(full)), None

        layers = (_Layer * L)()
        for i in range(L):
            pre = f"model.layers.{i}."
            a, m = pre + "self_attn.", pre + "mlp."
            if any(get(f"{a}{x}_proj.bias") is not None for x in "qkvo"):
                raise ValueError("attention biases are not read by the torch-free C forward")
            qkv = mat([f"{a}{x}_proj.weight" for x in "qkv"])
            o = mat([a + "o_proj.weight"])
            gu = mat([m + "gate_proj.weight", m + "up_proj.weight"])
            down = mat([m + "down_proj.weight"])
            ln2 = pre + ("pre_feedforward_layernorm" if cfg.gemma else "post_attention_layernorm")
            slide = cfg.gemma and cfg.sliding[i]
            cos, sin = tables[cfg.local_rope if slide else cfg.global_rope]
            layers[i] = _Layer(
                fl(pre + "input_layernorm.weight"), qkv[0], None,
                fl(a + "q_norm.weight"), fl(a + "k_norm.weight"), o[0], None,
                fl(ln2 + ".weight"), gu[0], None, down[0], None,
                p(self.k[i]), p(self.v[i]), qkv[1], o[1], gu[1], down[1],
                qkv[2], o[2], gu[2], down[2],
                fl(pre + "post_attention_layernorm.weight") if cfg.gemma else None,
                fl(pre + "post_feedforward_layernorm.weight") if cfg.gemma else None,
                p(cos) if cfg.gemma else None, p(sin) if cfg.gemma else None,
                cfg.window if slide else 0,
            )  # fmt: skip
        head = "lm_head.weight" if "lm_head.weight" in w else "model.embed_tokens.weight"
        emb, lm = mat(["model.embed_tokens.weight"]), mat([head])
        cos, sin = tables[cfg.local_rope if cfg.gemma and cfg.sliding[0] else cfg.global_rope]
        self._layers, self._tables = layers, tables
        # quant.c's mode of a step (CpuForward's): "prefill" (8-bit activations) on prompt
        # steps only, so a prompt row's arithmetic does not depend on its chunking
        self._q_prompt = MODES[mode]
        self._q_mode = MODES["auto" if mode == "prefill" else mode]
        self._struct = _Model(
            cfg.hidden, cfg.heads, Hkv, D, cfg.inter, cfg.vocab, L, rows, cfg.eps, D**-0.5,
            emb[0], fl("model.norm.weight"), lm[0], p(cos), p(sin), layers, lm[1], emb[2], lm[2],
            self._q_mode, int(cfg.gemma), float(math.sqrt(cfg.hidden)) if cfg.gemma else 1.0,
            float(cfg.gemma), int(kv_dtype == "bf16"),
        )  # fmt: skip
        self._ptr = ctypes.addressof(self._struct)
        # None, or float64 [2] the C forward adds the calling thread's CPU seconds to: in
        # matmuls, in attention (CpuForward.profile's; benchmarks/bench_step_overhead.py)
        self.profile: np.ndarray | None = None

    def __call__(self, ids, positions, slots, rows, seq_lens, extend_lens, logit_rows,
                 nthreads: int | None = None, prompt: bool = False) -> np.ndarray:  # fmt: skip
        """float32 logits [len(logit_rows), vocab]; the step's K / V written to `slots`.
        ids / positions / slots: the step's T tokens, request by request; rows: each request's
        req_to_token row; seq_lens: its length after the step; extend_lens: its tokens here;
        prompt: every row a prompt row (ModelInput.prompt: the prompt's matmul mode)."""
        self._struct.q_mode = self._q_prompt if prompt else self._q_mode
        i64 = [np.ascontiguousarray(x, dtype=np.int64)
               for x in (ids, positions, slots, rows, logit_rows)]  # fmt: skip
        ids, pos, slots, rows, want = i64
        b = len(rows)
        if not 0 < len(ids) <= MAX_TOKENS:
            raise ValueError(f"a step of {len(ids)} tokens (1..{MAX_TOKENS})")
        meta = np.array([0, *np.cumsum(extend_lens), *seq_lens, *[-1] * b], dtype=np.int64)
        logits = np.empty((len(want), self.cfg.vocab), dtype=np.float32)
        base, t = meta.ctypes.data, self.req_to_token
        rc = self.lib.loom_forward_f32(
            self._ptr, len(ids), ids.ctypes.data, pos.ctypes.data, slots.ctypes.data, b, base,
            rows.ctypes.data, base + 8 * (b + 1), t.ctypes.data, t.shape[1], None,
            base + 8 * (2 * b + 1), len(want), want.ctypes.data, logits.ctypes.data,
            nthreads or len(os.sched_getaffinity(0)),
            None if self.profile is None else self.profile.ctypes.data, None, 0, None, None,
        )  # fmt: skip
        if rc == -1:
            raise IndexError(f"position {int(pos.max())} is past the rotary table")
        if rc == -2:
            raise IndexError(f"token id {int(ids.max())} is past the vocabulary")
        if self.cfg.softcap:
            logits = np.tanh(logits / np.float32(self.cfg.softcap)) * np.float32(self.cfg.softcap)
        return logits

    def greedy(self, prompts: list[list[int]], new_tokens: int, nthreads: int | None = None):
        """Each prompt's `new_tokens` greedy tokens: one prefill step of every prompt, then
        batched decode steps; request r takes req_to_token row r and consecutive slots."""
        starts, at = [], 1  # slot 0 stays unused, as memory_pool keeps it for padding
        for i, ids in enumerate(prompts):
            starts.append(at)
            self.req_to_token[i, : len(ids) + new_tokens] = np.arange(
                at, at + len(ids) + new_tokens
            )
            at += len(ids) + new_tokens
        lens = [len(x) for x in prompts]
        ids = [t for x in prompts for t in x]
        pos = [j for n in lens for j in range(n)]
        slots = [s + j for s, n in zip(starts, lens) for j in range(n)]
        logits = self(ids, pos, slots, range(len(prompts)), lens, lens,
                      np.cumsum(lens) - 1, nthreads)  # fmt: skip
        out = [[int(t)] for t in logits.argmax(-1)]
        for _ in range(new_tokens - 1):
            pos = [n + len(o) - 1 for n, o in zip(lens, out)]
            slots = [s + q for s, q in zip(starts, pos)]
            logits = self([o[-1] for o in out], pos, slots, range(len(prompts)),
                          [q + 1 for q in pos], [1] * len(prompts), range(len(prompts)), nthreads)  # fmt: skip
            for o, t in zip(out, logits.argmax(-1)):
                o.append(int(t))
        return out
