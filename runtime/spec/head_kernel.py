"""Compiled draft heads on the CPU: EAGLE / EAGLE-3's whole draft round and Medusa's heads, one
C call each.

At batch 1 on a small target the eager head is mostly overhead (a few hundred small aten and
module calls per draft round, ~5 ms against a ~2 ms target step), so drafting costs more than
the accepted tokens save. This module runs it in C: norms, biases and embeddings read in place,
every matmul (fc, the projections, the LM head) on a copy packed into the C forward's 16-row
panels (`cpu_forward.pack`, made once at build: weights changed later are not seen), the
layout the target's own steps read:

- `CompiledEagleHead.run`: the catch-up (one head extend over the rows the target step
  committed: its K/V stored into the head's pool at the target's slots, causal attention read
  in place through the req-to-token table), then the greedy chain loop (`num_steps - 1` head
  decode steps from its own output, each attending to the committed entries plus the loop's
  own entries, kept in C scratch and never written to the pool), the LM head (EAGLE: the
  target's, EAGLE-3: its own over the draft vocabulary, mapped through d2t) and the argmax.
  Chains only (`--speculative-eagle-topk 1`, the default); trees stay eager.
- `CompiledMedusaHeads.run`: every head's residual SiLU blocks, its LM head (the target's when
  shared), the log-softmax and the top-k, for all rows.

The C source is kernels/cpu/heads.c (on forward.c's gemm_packed, rms, qk_norm_rope,
silu_mul), part of loom's one C library (`native.load`). `build` returns None (and says why)
for anything it does not cover; the eager head is the reference it is tested against
(tests/test_head_kernel.py).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from array import array

import torch

from loom.runtime import cpu_forward, native
from loom.runtime.cpu_forward import PANEL, _Layer, _ptr, pack

logger = logging.getLogger(__name__)


class _Head(ctypes.Structure):
    _fields_ = [
        *[
            (n, ctypes.c_int64)
            for n in (
                "variant", "hidden", "heads", "kv_heads", "head_dim", "inter", "layers",
                "max_pos", "vocab", "dvocab", "fc_in",
            )
        ],
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        *[
            (n, ctypes.c_void_p)
            for n in (
                "embed", "fc_w", "fc_b", "in_norm", "hidden_norm", "norm", "lm_head", "cos",
                "sin", "d2t",
            )
        ],
        ("layer", ctypes.POINTER(_Layer)),
        *[(n, ctypes.c_void_p) for n in ("fc_p", "lm_p", "fc_bf", "lm_bf", "layer_bf")],
        ("bf16_inputs", ctypes.c_int64),
    ]  # fmt: skip


@functools.cache
def load() -> ctypes.CDLL | None:
    """loom's C library (built once per machine, cached), its Head checked against `_Head`
    (and Layer against cpu_forward's); None without a compiler."""
    lib = cpu_forward.load()
    if lib is not None:
        native.check_layout(lib, "Head", _Head)
    return lib


def _f32(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()


def _pack_bf16(w: torch.Tensor) -> torch.Tensor | None:
    """w packed (cpu_forward.pack) as bfloat16 bits (int16) for the kernel's bf16 panels, or
    None where an entry is not a bfloat16 value (the copy would round it: the float32 panels
    run instead)."""
    w = w.detach()
    if w.shape[1] % 2 or not torch.equal(w.to(torch.bfloat16).float(), w):
        return None
    panels = pack(w).to(torch.bfloat16).view(torch.int16)  # [panels, K, 16]
    n, k = panels.shape[0], panels.shape[1]
    return panels.view(n, k // 2, 2, PANEL).transpose(2, 3).contiguous()  # k in pairs


def _pack_each(w: torch.Tensor) -> torch.Tensor:
    """[..., N, K] -> every [N, K] matrix packed (cpu_forward.pack), one after another."""
    n, k = w.shape[-2:]
    return torch.stack([pack(m) for m in w.detach().reshape(-1, n, k)]).contiguous()


def eagle_unsupported(head, pool, topk: int) -> str | None:
    """Why the compiled EAGLE round cannot run this head (None: it can)."""
    from loom.runtime.layers.activation import SiluAndMul
    from loom.runtime.layers.rotary import RotaryEmbedding
    from loom.runtime.models.llama import LlamaMLP

    if topk != 1:
        return f"speculative_eagle_topk {topk} (trees run eager; chains only)"
    layers = list(head.layers) if head.variant == "eagle" else [head.midlayer]
    tensors = [*head.parameters(), *head.buffers(), head.embed_tokens.weight]
    if head.variant == "eagle":
        tensors.append(head.target_lm_head.weight)
    if any(getattr(t, "quant", None) is not None for t in tensors):
        # a GGUF target's embedding keeps its blocks (float storage released): the C round
        # reads float rows, the eager head looks tokens up through the embedding module
        return "the target's embedding is block-quantized"
    if any(t.device.type != "cpu" for t in tensors):
        return "the head is not on the CPU"
    if any(t.is_floating_point() and t.dtype != torch.float32 for t in tensors):
        return "the head's weights are not float32"
    if any(b.dtype != torch.float32 for b in pool.k_buffers + pool.v_buffers):
        return "the head's KV pool is not float32"
    eps = set()
    for layer in layers:
        a, mlp = layer.self_attn, layer.mlp
        if type(mlp) is not LlamaMLP or type(mlp.act_fn) is not SiluAndMul:
            return "an MLP other than the SiLU-gated one"
        if type(a.rotary_emb) is not RotaryEmbedding:
            return "a rotary embedding other than the neox RotaryEmbedding"
        if a.num_heads % a.num_kv_heads or a.head_dim % 2:
            return "heads not a multiple of the KV heads, or an odd head_dim"
        norms = [layer.post_attention_layernorm] + [
            n for n in (layer.input_layernorm, getattr(layer, "hidden_norm", None))
            if n is not None and hasattr(n, "eps")
        ]  # fmt: skip
        if a.qk_norm:
            norms += [a.q_norm, a.k_norm]
        eps |= {n.eps for n in norms}
    if head.variant == "eagle3":
        eps.add(head.norm.eps)
    if len(eps) != 1:
        return "RMSNorm epsilons differ inside the head"
    if getattr(head.config, "hidden_act", "silu") != "silu":
        return f"hidden_act {head.config.hidden_act!r}"
    return None


class CompiledEagleHead:
    """The C draft round bound to one head and its KV pool; `build` returns None (logged) where
    the eager head must run."""

    def __init__(self, lib: ctypes.CDLL, head, pool, bf16_inputs: bool = True):
        self.lib, self.head, self.pool = lib, head, pool
        self.profile = torch.zeros(2, dtype=torch.float64)  # wall s: catch-up, draft loop
        self._keep: list[torch.Tensor] = []

        def p(t: torch.Tensor | None) -> int | None:
            if t is None:
                return None
            t = t.detach()
            assert _f32(t) or t.dtype in (torch.int64, torch.int16), "float32, contiguous"
            self._keep.append(t)
            return t.data_ptr()

        # bfloat16 panels where the build has their kernel (AVX-512) and the weights allow
        bf16 = lib.loom_isa_bits() == 512

        def pb(w: torch.Tensor) -> int | None:
            return p(_pack_bf16(w)) if bf16 else None

        eagle3 = head.variant == "eagle3"
        layers = [head.midlayer] if eagle3 else list(head.layers)
        structs = (_Layer * len(layers))()
        for i, layer in enumerate(layers):
            a, mlp = layer.self_attn, layer.mlp
            ln1 = layer.input_layernorm
            structs[i] = _Layer(
                None if eagle3 or not hasattr(ln1, "weight") else p(ln1.weight),
                p(a.qkv_proj.weight), p(a.qkv_proj.bias),
                p(a.q_norm.weight) if a.qk_norm else None,
                p(a.k_norm.weight) if a.qk_norm else None,
                p(a.o_proj.weight), p(a.o_proj.bias), p(layer.post_attention_layernorm.weight),
                p(mlp.gate_up_proj.weight), p(mlp.gate_up_proj.bias),
                p(mlp.down_proj.weight), p(mlp.down_proj.bias),
                p(pool.k_buffers[i]), p(pool.v_buffers[i]),
                p(pack(a.qkv_proj.weight)), p(pack(a.o_proj.weight)),
                p(pack(mlp.gate_up_proj.weight)), p(pack(mlp.down_proj.weight)),
            )  # fmt: skip
        self._layers = structs
        self._layer_bf = (ctypes.c_void_p * (4 * len(layers)))(*[
            pb(w)
            for layer in layers
            for w in (
                layer.self_attn.qkv_proj.weight, layer.self_attn.o_proj.weight,
                layer.mlp.gate_up_proj.weight, layer.mlp.down_proj.weight,
            )
        ])  # fmt: skip
        a0 = layers[0].self_attn
        rot = a0.rotary_emb
        # EAGLE-1 over a reduced vocabulary: a contiguous copy of the target's subset rows
        lm = head.lm_head.weight if eagle3 else head.draft_lm_weight().contiguous()
        dvocab = head.draft_vocab_size
        self._struct = _Head(
            int(eagle3), head.config.hidden_size, a0.num_heads, a0.num_kv_heads, a0.head_dim,
            layers[0].mlp.gate_up_proj.weight.shape[0] // 2, len(layers),
            rot.cos_cache.shape[0], head.embed_tokens.weight.shape[0], dvocab,
            head.fc.in_features, layers[0].post_attention_layernorm.eps, a0.attn.scaling,
            p(head.embed_tokens.weight), p(head.fc.weight), p(head.fc.bias),
            p(head.midlayer.input_layernorm.weight) if eagle3 else None,
            p(head.midlayer.hidden_norm.weight) if eagle3 else None,
            p(head.norm.weight) if eagle3 else None, p(lm),
            p(rot.cos_cache), p(rot.sin_cache), p(head.d2t) if hasattr(head, "d2t") else None,
            structs, p(pack(head.fc.weight)), p(pack(lm)), pb(head.fc.weight), pb(lm),
            ctypes.cast(self._layer_bf, ctypes.c_void_p),
        )  # fmt: skip
        # which matmuls read bfloat16 panels (the shipped heads: all but EAGLE-1's LM head,
        # the float32 target's rows)
        self.bf16 = bf16 and any(self._layer_bf)
        # and whether those round their inputs to bfloat16 as well, for VDPBF16PS (two products
        # a lane, no widening of the panels: a draft round 285 -> 224 us, the bundled EAGLE-3
        # head at batch 1). The drafts are then a bfloat16 model's, as a GPU runs a bf16 head;
        # verification is the target's, so only acceptance can move.
        self.bf16_inputs = self.bf16 and bf16_inputs and bool(lib.loom_head_bf16_dot())
        self._struct.bf16_inputs = int(self.bf16_inputs)
        self._ptr = ctypes.addressof(self._struct)
        self.dvocab = dvocab

    @classmethod
    def build(cls, head, pool, topk: int, bf16_inputs: bool = True) -> CompiledEagleHead | None:
        reason = eagle_unsupported(head, pool, topk)
        lib = None if reason else load()
        if reason is None and lib is None:
            reason = "no C compiler"
        if reason:
            logger.info("compiled EAGLE head off: %s; the eager head runs", reason)
            return None
        return cls(lib, head, pool, bf16_inputs)

    def run(
        self, ids, pos, slots, feats, starts, rows, seq_lens, table, draft_reqs, steps,
        want_logits: bool = False, want_hidden: bool = False,
    ):  # fmt: skip
        """One round: the catch-up over rows `ids` / `pos` / `slots` / `feats` [T, F] (request b:
        rows starts[b] .. starts[b+1]-1, seq_lens[b] committed entries after it, table row
        rows[b]), then `steps` greedy drafts for each request index in draft_reqs. Returns
        (tokens [nd, steps] int64, logits [steps, nd, dvocab] or None, hidden [T, H] or None).
        Integer arguments: int64 CPU tensors; feats float32 contiguous."""
        nd = len(draft_reqs)
        n = ids.numel()
        b = len(seq_lens)
        tokens = torch.empty((nd, steps), dtype=torch.int64)
        logits = torch.empty((steps, nd, self.dvocab)) if want_logits else None
        hidden = torch.empty((n, self._struct.hidden)) if want_hidden else None
        # the integer arguments as one int64 buffer (an array: ~1 us where a tensor was ~5)
        meta = array("q", [*starts, *rows, *seq_lens, *draft_reqs])
        base = meta.buffer_info()[0]
        rc = self.lib.loom_eagle_round(
            self._ptr, n, ids.data_ptr(), pos.data_ptr(), slots.data_ptr(), feats.data_ptr(),
            feats.stride(0), b, base, base + 8 * (b + 1), base + 8 * (2 * b + 1),
            table.data_ptr(), table.stride(0), nd, base + 8 * (3 * b + 1), steps,
            tokens.data_ptr(), _ptr(logits), _ptr(hidden), torch.get_num_threads(),
            self.profile.data_ptr(),
        )  # fmt: skip
        if rc == -1:
            raise IndexError("a draft position is past the head's rotary table")
        if rc == -2:
            raise IndexError(f"token id {int(ids.max())} is past the vocabulary")
        return tokens, logits, hidden


class CompiledMedusaHeads:
    """All Medusa heads (residual blocks, LM head, log-softmax, top-k) in one C call."""

    def __init__(self, lib: ctypes.CDLL, heads):
        self.lib, self.heads = lib, heads
        lm = heads.lm_rows()  # the draft vocabulary's rows
        self._keep = [
            _pack_each(heads.res_weight),
            heads.res_bias.detach().contiguous(),
            _pack_each(lm),
        ]  # packed copies (cpu_forward.pack) of the matrices, made here once
        self.vocab = lm.shape[-2]
        self.draft_ids = heads.draft_ids

    @classmethod
    def build(cls, heads) -> CompiledMedusaHeads | None:
        reason = None
        lm = heads.target_lm_head.weight
        if any(
            t.dtype != torch.float32 or t.device.type != "cpu" for t in (*heads.parameters(), lm)
        ):
            reason = "the heads are not float32 on the CPU"
        lib = None if reason else load()
        if reason is None and lib is None:
            reason = "no C compiler"
        if reason:
            logger.info("compiled Medusa heads off: %s; the eager heads run", reason)
            return None
        return cls(lib, heads)

    def run(self, hidden: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [n, H] -> (log-probabilities, target ids), each [n, k, topk], best first
        (over the heads' draft vocabulary)."""
        h = hidden.detach().float().contiguous()
        n, k = h.shape[0], self.heads.num_heads
        logp = torch.empty((n, k, topk), dtype=torch.float32)
        ids = torch.empty((n, k, topk), dtype=torch.int64)
        w, b, lm = self._keep
        self.lib.loom_medusa_heads(
            h.data_ptr(), n, h.shape[1], k, self.heads.num_layers, w.data_ptr(), b.data_ptr(),
            lm.data_ptr(), int(not self.heads.shares_lm_head), self.vocab, topk,
            logp.data_ptr(), ids.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        return logp, ids if self.draft_ids is None else self.draft_ids[ids]
