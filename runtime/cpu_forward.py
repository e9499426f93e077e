"""The compiled CPU forward for small batches: a whole llama-style decoder stack per C call.

At batch 1 the eager forward of a small model is mostly overhead: a few hundred small aten
calls and Python module calls per step, several times the matmuls themselves. This path runs
the step's whole forward in one C function (kernels/cpu/forward.c: norms, QKV, q/k norm,
RoPE, the KV store into the pool, paged attention read in place through the req-to-token
table, causal or under a draft tree's mask, O projection, the SiLU MLP, the final norm and
the LM head for the rows that need logits), reading the weights in place from the model's
parameters. It covers the dense Llama family (Llama, Mistral, Qwen2, Qwen3) and Gemma 3 (its
(1 + w) norms before and after attention and MLP, gelu(tanh) MLP, scaled embedding, per-layer
RoPE tables, sliding-window layers, soft-capped logits) in float32 with one rank, over a float32
or bfloat16 KV pool (`--kv-cache-dtype bf16`: K/V stored rounded as the eager path's stores round
them, widened to float32 in registers for the attention); steps of more than `MAX_TOKENS` tokens
go to the eager forward, and so does anything
the C code does not cover (`CpuForward.build` says why, once). Every step reads a copy of the
projection and LM-head weights packed into 16-row panels (`pack`; `PACK_BUDGET` bounds its
bytes): one sequential stream a panel, the only copy a decode step touches (the row-major
parameters stay for the eager path), so the bytes a step streams are one copy of the weights,
which is what keeps a small model's weights in the last-level cache; every loaded weight
vector serves up to 16 tokens (6 without AVX-512).
`--cpu-forward eager` turns it off; the eager modules stay the reference it is tested against.
"""

from __future__ import annotations

import ctypes
import logging

import torch

from loom.runtime.cpu_abi import PANEL, _Layer, _Model, _QMat, _QSeg, load
from loom.runtime.forward_batch import ForwardBatch, host_tensor
from loom.runtime.layers import quant_ops
from loom.runtime.layers.quant_linear import quant_of
from loom.runtime.layers.quant_ops import QTYPES

logger = logging.getLogger(__name__)

# tokens per step up to which the C forward runs: the largest step measured, and C took less
# CPU time than the eager forward at every size measured up to it (docs/benchmarks.md,
# "Session 5: multi-token kernel"); past it, eager.
MAX_TOKENS = 8192

# 16-bit KV pool dtypes the C forward stores and reads (forward.c, Model.kv_bf16): bfloat16,
# the one 16-bit --kv-cache-dtype loom offers (memory_pool._KV_DTYPES)
KV16 = (torch.bfloat16,)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


# bytes of packed copies one CpuForward may hold: the bundled model needs 15.7 MB, a
# Qwen2.5-0.5B-shape f32 model ~2.0 GB (1.4 GB of layer projections + the 0.54 GB LM head);
# matrices past the budget stay row-major only (their steps take the dot-product tiles)
PACK_BUDGET = 2 << 30


def pack(w: torch.Tensor) -> torch.Tensor:
    """A row-major [N, K] float32 weight as the multi-token kernel reads it: [ceil(N / 16), K,
    16], panel p holding output rows 16p .. 16p + 15 K-major, rows past N zero."""
    n, k = w.shape
    padded = torch.zeros(-(-n // PANEL) * PANEL, k, dtype=torch.float32)
    padded[:n] = w.detach()
    return padded.view(-1, PANEL, k).transpose(1, 2).contiguous()


class CpuForward:
    """The C forward bound to one model and its KV pool. `build` returns None (and logs why)
    when the model or the setup is outside what it covers; `covers(batch)` decides per step."""

    def __init__(self, lib: ctypes.CDLL, model, pool, max_tokens: int | None = None):
        self.lib, self.model, self.pool = lib, model, pool
        self.max_tokens = max_tokens or MAX_TOKENS
        # float64 [2]: when set, each call adds its CPU seconds in matmuls and in attention
        self.profile: torch.Tensor | None = None
        inner = model.model
        attn0 = inner.layers[0].self_attn
        rot = attn0.rotary_emb
        cfg = model.config
        self._keep: list[torch.Tensor] = []  # every tensor whose pointer the C side holds
        self._qkeep: list[ctypes.Structure] = []  # the _QSeg arrays and _QMats it points to

        def p(t: torch.Tensor | None) -> int | None:
            if t is None:
                return None
            assert t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu"
            self._keep.append(t)
            return t.data_ptr()

        budget = [PACK_BUDGET]

        def q(param: torch.Tensor) -> int | None:
            """A block-quantized weight as a _QMat the C side reads in place (None: float)."""
            qw = quant_of(param)
            if qw is None:
                return None
            segs = (_QSeg * len(qw.parts))(
                *[
                    _QSeg(QTYPES[t.qtype], off, t.shape[0], t.row_bytes, t.data.data_ptr())
                    for off, t in qw.parts
                ]
            )
            mat = _QMat(len(qw.parts), ctypes.addressof(segs))
            self._keep.extend(t.data for _, t in qw.parts)
            self._qkeep += [segs, mat]
            return ctypes.addressof(mat)

        kv_dtype = pool.k_buffers[0].dtype  # unsupported(): float32 or KV16 in every layer

        def kv(t: torch.Tensor) -> int:  # a layer's K or V buffer, written and read in place
            assert t.dtype == kv_dtype and t.is_contiguous() and t.device.type == "cpu"
            self._keep.append(t)
            return t.data_ptr()

        def f(param: torch.Tensor) -> int | None:  # the float weight, None where quantized
            return None if quant_of(param) is not None else p(param)

        def packed(t: torch.Tensor) -> int | None:
            if quant_of(t) is not None:
                return None
            need = -(-t.shape[0] // PANEL) * PANEL * t.shape[1] * 4
            if need > budget[0]:
                return None
            budget[0] -= need
            return p(pack(t))

        gemma = _is_gemma(model)
        layers = (_Layer * len(inner.layers))()
        for i, layer in enumerate(inner.layers):
            a, mlp = layer.self_attn, layer.mlp
            qk = gemma or a.qk_norm
            # Gemma: post_attention_layernorm norms the attention output, the MLP's input norm
            # is pre_feedforward_layernorm; Llama's post_attention_layernorm is the MLP's input
            ln2 = layer.pre_feedforward_layernorm if gemma else layer.post_attention_layernorm
            g_rot = a.rotary_emb if gemma else None
            layers[i] = _Layer(
                p(layer.input_layernorm.weight), f(a.qkv_proj.weight), p(a.qkv_proj.bias),
                p(a.q_norm.weight) if qk else None,
                p(a.k_norm.weight) if qk else None,
                f(a.o_proj.weight), p(a.o_proj.bias), p(ln2.weight),
                f(mlp.gate_up_proj.weight), p(mlp.gate_up_proj.bias),
                f(mlp.down_proj.weight), p(mlp.down_proj.bias),
                kv(pool.k_buffers[i]), kv(pool.v_buffers[i]),
                packed(a.qkv_proj.weight), packed(a.o_proj.weight),
                packed(mlp.gate_up_proj.weight), packed(mlp.down_proj.weight),
                q(a.qkv_proj.weight), q(a.o_proj.weight),
                q(mlp.gate_up_proj.weight), q(mlp.down_proj.weight),
                p(layer.post_attention_layernorm.weight) if gemma else None,
                p(layer.post_feedforward_layernorm.weight) if gemma else None,
                p(g_rot.cos_cache) if gemma else None, p(g_rot.sin_cache) if gemma else None,
                (a.attn.sliding_window or 0) if gemma else 0,
            )  # fmt: skip
        self._layers = layers
        # quant.c's mode for a step: "prefill" (--quantized-matmul prefill-int8: 8-bit
        # activations, quant_i8.c) on a prompt step's rows only, so every prompt row gets one
        # arithmetic however its prefill is chunked, and decode / verify rows take "auto"
        mode = quant_ops.DEFAULT_MODE
        self._q_prompt = quant_ops.MODES[mode]
        self._q_mode = quant_ops.MODES["auto" if mode == "prefill" else mode]
        self._struct = _Model(
            cfg.hidden_size, attn0.num_heads, attn0.num_kv_heads, attn0.head_dim,
            sum(inner.layers[0].mlp.gate_up_proj.output_sizes) // 2,
            model.lm_head.num_embeddings, len(inner.layers), rot.cos_cache.shape[0],
            inner.layers[0].input_layernorm.eps, attn0.attn.scaling,
            f(inner.embed_tokens.weight), p(inner.norm.weight), f(model.lm_head.weight),
            p(rot.cos_cache), p(rot.sin_cache), layers, packed(model.lm_head.weight),
            q(inner.embed_tokens.weight), q(model.lm_head.weight),
            self._q_mode,
            int(gemma), float(getattr(inner.embed_tokens, "scale", 1.0)), float(gemma),
            int(kv_dtype == torch.bfloat16),
        )  # fmt: skip
        # Gemma's final logit soft-cap (Gemma3ForCausalLM.forward), applied to the C logits
        self.softcap = getattr(model, "softcap", None) if gemma else None
        # bytes held in packed copies (the weights the C path reads a second time)
        self.packed_bytes = PACK_BUDGET - budget[0]
        self._model_ptr = ctypes.addressof(self._struct)
        self._aux_ids: dict[tuple[int, ...], torch.Tensor] = {}  # batch.capture -> its ids

    @classmethod
    def build(cls, model, pool, *, tp_size: int, pp_size: int) -> CpuForward | None:
        reason = unsupported(model, pool, tp_size=tp_size, pp_size=pp_size)
        lib = None if reason else load()
        if reason is None and lib is None:
            reason = "no C compiler"
        if reason:
            logger.info("compiled CPU forward off: %s; the eager forward runs", reason)
            return None
        return cls(lib, model, pool)

    def covers(self, batch: ForwardBatch) -> bool:
        """Whether this step runs in C: few enough tokens. A drafter's captures (final hidden
        states for Medusa / EAGLE, inner layers' residual streams for EAGLE-3) come back from
        C too; a capture of a layer the model lacks runs eager (and fails there as it would)."""
        capture = batch.capture
        n = self._struct.layers
        return 0 < batch.input_ids.numel() <= self.max_tokens and (
            capture is None or all(0 <= i < n for i in capture)
        )

    def __call__(self, batch: ForwardBatch) -> torch.Tensor:
        """float32 logits [N, vocab] for batch.logits_indices, the KV of this step's tokens
        written to batch.out_cache_loc (what the eager model call does)."""
        seq = batch.seq_lens_cpu
        ext = batch.extend_lens_cpu
        b = len(seq)
        starts = [0]
        for e in ext:
            starts.append(starts[-1] + e)
        masks, offs = None, [-1] * b
        if batch.custom_masks is not None:
            parts, at = [], 0
            for i, m in enumerate(batch.custom_masks):
                if m is not None:
                    assert tuple(m.shape) == (ext[i], seq[i]), "custom mask shape"
                    parts.append(m.reshape(-1).to(torch.uint8))
                    offs[i] = at
                    at += m.numel()
            masks = torch.cat(parts) if parts else None
        meta = host_tensor([*starts, *seq, *offs], torch.int64)
        ids = batch.input_ids.contiguous()
        pos = batch.positions.contiguous()
        slots = batch.out_cache_loc.contiguous()
        rows = batch.req_pool_indices.contiguous()
        table = batch.req_to_token_pool.req_to_token
        want = batch.logits_indices.contiguous()
        logits = torch.empty((want.numel(), self._struct.vocab), dtype=torch.float32)
        feats = aux_ids = None
        n_aux = 0
        capture = batch.capture
        if capture is not None:  # LlamaModel.forward's contract: (final hidden, [aux per layer])
            n_aux = len(capture)
            if capture:  # the same few tuples every step (a drafter's aux layers)
                aux_ids = self._aux_ids.get(capture)
                if aux_ids is None:
                    aux_ids = self._aux_ids[capture] = torch.tensor(capture, dtype=torch.int64)
            # the final hidden states [T, hidden], then each aux layer's: one allocation
            feats = torch.empty((1 + n_aux, ids.numel(), self._struct.hidden), dtype=torch.float32)
        aux_ptr = feats.data_ptr() + 4 * ids.numel() * self._struct.hidden if n_aux else None
        base = meta.data_ptr()
        self._struct.q_mode = self._q_prompt if batch.prompt else self._q_mode
        rc = self.lib.loom_forward_f32(
            self._model_ptr, ids.numel(), ids.data_ptr(), pos.data_ptr(), slots.data_ptr(),
            b, base, rows.data_ptr(), base + 8 * (b + 1), table.data_ptr(), table.stride(0),
            _ptr(masks), base + 8 * (2 * b + 1), want.numel(), want.data_ptr(),
            logits.data_ptr(), torch.get_num_threads(), _ptr(self.profile), _ptr(feats),
            n_aux, _ptr(aux_ids), aux_ptr,
        )  # fmt: skip
        if feats is not None:
            hidden, *aux = feats.unbind(0)
            batch.captured = (hidden, aux)
        if rc == -1:
            raise IndexError(f"position {int(pos.max())} is past the rotary table")
        if rc == -2:
            raise IndexError(f"token id {int(ids.max())} is past the vocabulary")
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def _is_gemma(model) -> bool:
    from loom.runtime.models.gemma3 import Gemma3ForCausalLM

    return isinstance(model, Gemma3ForCausalLM)


def _gemma_unsupported(model) -> str | None:
    """Why the C forward cannot run this Gemma 3 model (None: it can): its layers must be
    loom's own Gemma 3 modules, every sliding layer one window, every rotary table one length."""
    from loom.runtime.layers.rotary import RotaryEmbedding
    from loom.runtime.models.gemma3 import (
        GeluTanhAndMul,
        Gemma3Attention,
        Gemma3DecoderLayer,
        Gemma3MLP,
        GemmaRMSNorm,
        ScaledEmbedding,
    )

    inner = model.model
    if type(inner.embed_tokens) is not ScaledEmbedding:
        return f"{type(inner.embed_tokens).__name__} is not Gemma's scaled embedding"
    windows, lengths, scales = set(), set(), set()
    for layer in inner.layers:
        if type(layer).forward is not Gemma3DecoderLayer.forward:
            return f"{type(layer).__name__} has its own forward"
        a = layer.self_attn
        if type(a).forward is not Gemma3Attention.forward:
            return f"{type(a).__name__} has its own forward"
        if type(layer.mlp) is not Gemma3MLP or type(layer.mlp.act_fn) is not GeluTanhAndMul:
            return f"{type(layer.mlp).__name__} is not the gelu(tanh)-gated dense MLP"
        if type(a.rotary_emb) is not RotaryEmbedding:
            return "a rotary embedding other than the neox RotaryEmbedding"
        norms = [layer.input_layernorm, layer.post_attention_layernorm, a.q_norm, a.k_norm]
        norms += [layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm]
        if any(type(n) is not GemmaRMSNorm for n in norms):
            return "a norm other than GemmaRMSNorm"
        if a.attn.sliding_window:
            windows.add(a.attn.sliding_window)
        lengths.add(a.rotary_emb.cos_cache.shape[0])
        scales.add(a.attn.scaling)
    if len(windows) > 1:
        return f"sliding windows differ between layers: {sorted(windows)}"
    if len(lengths) > 1 or len(scales) > 1:
        return "rotary table lengths or attention scales differ between layers"
    return None


def unsupported(model, pool, *, tp_size: int, pp_size: int) -> str | None:
    """Why the C forward cannot run this model (None: it can)."""
    from loom.runtime.layers.activation import SiluAndMul
    from loom.runtime.layers.rotary import RotaryEmbedding
    from loom.runtime.models.llama import (
        LlamaAttention,
        LlamaDecoderLayer,
        LlamaForCausalLM,
        LlamaMLP,
    )

    if tp_size != 1 or pp_size != 1:
        return f"tp_size {tp_size}, pp_size {pp_size} (one rank only)"
    if not isinstance(model, LlamaForCausalLM):
        return f"{type(model).__name__} is not a dense Llama-family model"
    inner = model.model
    gemma = _is_gemma(model)
    reason = _gemma_unsupported(model) if gemma else None
    if reason:
        return reason
    for layer in [] if gemma else inner.layers:
        if type(layer).forward is not LlamaDecoderLayer.forward:
            return f"{type(layer).__name__} has its own forward"
        if type(layer.self_attn).forward is not LlamaAttention.forward:
            return f"{type(layer.self_attn).__name__} has its own forward"
        if type(layer.mlp) is not LlamaMLP or type(layer.mlp.act_fn) is not SiluAndMul:
            return f"{type(layer.mlp).__name__} is not the SiLU-gated dense MLP"
        if type(layer.self_attn.rotary_emb) is not RotaryEmbedding:
            return "a rotary embedding other than the neox RotaryEmbedding"
    act = getattr(model.config, "hidden_act", "silu")
    if act != "silu" and not gemma:  # Gemma's MLP is gelu(tanh) whatever the config says
        return f"hidden_act {act!r}"
    params = list(model.parameters())
    pool_dtype = pool.k_buffers[0].dtype
    for t in params:
        qw = getattr(t, "quant", None)
        if qw is not None and not qw.complete:
            return "a quantized weight with rows no segment covers"
    table = getattr(inner.embed_tokens.weight, "quant", None)
    if table is not None and (len(table.parts) != 1 or table.parts[0][0] != 0):
        return "a quantized embedding table in more than one segment"
    if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in params):
        return "weights are not float32 on the CPU"
    if any(
        b.dtype not in (torch.float32, *KV16) or b.device.type != "cpu" or b.dtype != pool_dtype
        for b in pool.k_buffers + pool.v_buffers
    ):
        return "the KV pool is not float32 or bfloat16 on the CPU"
    a = inner.layers[0].self_attn
    if a.num_heads % a.num_kv_heads or a.head_dim % 2:
        return "heads not a multiple of the KV heads, or an odd head_dim"
    eps = {
        n.eps
        for layer in inner.layers
        for n in (layer.input_layernorm, layer.post_attention_layernorm)
    }
    eps |= {inner.norm.eps}
    if gemma:
        eps |= {
            n.eps
            for layer in inner.layers
            for n in (layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm)
        }
    if gemma or a.qk_norm:
        eps |= {layer.self_attn.q_norm.eps for layer in inner.layers}
        eps |= {layer.self_attn.k_norm.eps for layer in inner.layers}
    if len(eps) != 1:
        return "RMSNorm epsilons differ between layers"
    return None
