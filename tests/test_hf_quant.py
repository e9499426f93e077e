"""HF GPTQ / AWQ checkpoints (runtime/hf_quant.py): tiny checkpoints written here in each format
(packed as AutoGPTQ and AutoAWQ pack them, from the format's definition, not from loom's code)
load into loom's quantized layers, and the model's outputs equal those of the same model loaded
in float32 from the checkpoint's dequantized weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from loom.runtime import hf_quant
from loom.runtime.layers import quant_ops
from loom.runtime.layers.quant_linear import QuantWeight
from tests.test_quant_models import run

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def quantize(w: torch.Tensor, bits: int, group: int, sym: bool):
    """float [N, K] -> codes [N, K], zeros [N, K / group], f16 scales [N, K / group]."""
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    top = (1 << bits) - 1
    if sym:
        scale = g.abs().amax(-1) / (top // 2)
        zero = torch.full_like(scale, (top + 1) // 2)
    else:
        lo, hi = g.amin(-1), g.amax(-1)
        scale = (hi - lo) / top
        zero = torch.round(-lo / scale).clamp(0, top)
    scale = scale.to(torch.float16)
    codes = torch.round(g / scale.float().unsqueeze(-1)) + zero.unsqueeze(-1)
    return codes.clamp(0, top).long().reshape(n, k), zero.long(), scale


def pack_along(codes: np.ndarray, bits: int, axis: int, order=None) -> torch.Tensor:
    """Pack 32 / bits codes into each int32 along `axis` (nibble i <- element order[i])."""
    per = 32 // bits
    c = np.moveaxis(codes.astype(np.uint64), axis, 0)
    c = c.reshape(c.shape[0] // per, per, *c.shape[1:])
    word = np.zeros((c.shape[0], *c.shape[2:]), dtype=np.uint64)
    for i in range(per):
        word |= c[:, order[i] if order else i] << np.uint64(bits * i)
    return torch.from_numpy(np.moveaxis(word.astype(np.uint32).view(np.int32), 0, axis).copy())


def write_checkpoint(src: str, dst: Path, method: str, bits: int, group: int, sym: bool):
    """A copy of `src` with its projections in `method`'s packing, and beside it a float
    folder holding the same projections dequantized by the format's formula."""
    from safetensors.torch import load_file, save_file

    ref = dst.parent / f"{dst.name}-ref"
    for d in (dst, ref):
        shutil.copytree(src, d)
    tensors = {}
    for f in Path(src).glob("*.safetensors"):
        tensors.update(load_file(str(f)))
    packed, floats = {}, {}
    for name, t in tensors.items():
        prefix = name[: -len(".weight")]
        if not name.endswith(".weight") or prefix.rpartition(".")[2] not in PROJ:
            packed[name] = floats[name] = t.float()
            continue
        codes, zero, scale = quantize(t, bits, group, sym)
        floats[name] = (
            scale.float().repeat_interleave(group, 1)
            * (codes - zero.repeat_interleave(group, 1)).float()
        )
        if method == "gptq":  # codes along K, zeros along N and stored minus one (v1)
            packed[f"{prefix}.qweight"] = pack_along(codes.T.numpy(), bits, 0)
            packed[f"{prefix}.qzeros"] = pack_along((zero - 1).T.numpy(), bits, 1)
            packed[f"{prefix}.g_idx"] = torch.arange(t.shape[1], dtype=torch.int32) // group
        else:  # AWQ: both along N, interleaved
            packed[f"{prefix}.qweight"] = pack_along(codes.T.numpy(), 4, 1, AWQ_ORDER)
            packed[f"{prefix}.qzeros"] = pack_along(zero.T.numpy(), 4, 1, AWQ_ORDER)
        packed[f"{prefix}.scales"] = scale.T.contiguous()
    for d, out in ((dst, packed), (ref, floats)):
        for f in d.glob("*.safetensors"):
            f.unlink()
        save_file({k: v.contiguous() for k, v in out.items()}, str(d / "model.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    qc = {"quant_method": method, "bits": bits, "group_size": group}
    qc.update({"sym": sym, "desc_act": False} if method == "gptq" else {"zero_point": True})
    cfg["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst), str(ref)


@pytest.mark.parametrize(
    "method,bits,group,sym,qtype,tol",
    [
        ("gptq", 4, 32, True, "Q4_0", 2e-4),  # exact blocks: the kernels' rounding only
        ("gptq", 8, 64, True, "Q8_0", 2e-4),
        ("awq", 4, 32, False, "Q4_1", 5e-3),
    ],
)
def test_packed_checkpoint_equals_its_dequantized_twin(
    tiny_model_dir, tmp_path, monkeypatch, method, bits, group, sym, qtype, tol
):
    # f32 activations: this is about the format; int8 activations are test_quant_models'
    monkeypatch.setattr(quant_ops, "DEFAULT_MODE", "f32")
    path, ref = write_checkpoint(
        tiny_model_dir("llama"), tmp_path / method, method, bits, group, sym
    )
    ours, sq = run(path)
    theirs, _ = run(ref)
    held = {n: p.quant for n, p in sq.runner.model.named_parameters() if getattr(p, "quant", None)}
    assert len(held) == 2 * 4 and all(isinstance(q, QuantWeight) for q in held.values())
    assert {qt.qtype for q in held.values() for _, qt in q.parts} == {qtype}
    for rid in ours:
        a, b = torch.tensor(ours[rid]["lp"][1:]), torch.tensor(theirs[rid]["lp"][1:])
        assert (a - b).abs().max().item() < tol, (rid, (a - b).abs().max().item())
        assert ours[rid]["ids"] == theirs[rid]["ids"], rid


def test_unpack_equals_the_format_on_one_tensor():
    """The blocks loom builds dequantize to the checkpoint's formula (exactly for sym GPTQ)."""
    from loom.kernels.quant_ref import dequantize_ref

    w = torch.randn(24, 96, generator=torch.Generator().manual_seed(3))
    for method, sym in (("gptq", True), ("gptq", False), ("awq", False)):
        codes, zero, scale = quantize(w, 4, 32, sym)
        want = scale.float().repeat_interleave(32, 1) * (codes - zero.repeat_interleave(32, 1))
        if method == "gptq":
            parts = {"qweight": pack_along(codes.T.numpy(), 4, 0),
                     "qzeros": pack_along((zero - 1).T.numpy(), 4, 1), "scales": scale.T}  # fmt: skip
        else:
            parts = {"qweight": pack_along(codes.T.numpy(), 4, 1, AWQ_ORDER),
                     "qzeros": pack_along(zero.T.numpy(), 4, 1, AWQ_ORDER), "scales": scale.T}  # fmt: skip
        qc = {"quant_method": method, "bits": 4, "group_size": 32}
        c, z, s, bits, group = hf_quant.unpack(parts, qc)
        assert torch.equal(c, codes) and torch.equal(z, zero)
        qt = hf_quant.to_blocks(c, z, s, bits, group)
        got = dequantize_ref(qt.qtype, qt.data, qt.shape)
        if sym:  # exact
            assert qt.qtype == "Q4_0" and torch.equal(got, want)
        else:
            assert qt.qtype == "Q4_1"
            torch.testing.assert_close(got, want, rtol=0, atol=float(scale.max()) * 8 * 2**-10)


def test_bad_quantization_configs_name_the_field():
    class Cfg:
        quantization_config = {"quant_method": "bitsandbytes"}

    with pytest.raises(ValueError, match="quantization_config: quant_method 'bitsandbytes'"):
        hf_quant.quant_method(Cfg())
    w = torch.randn(8, 64)
    codes, zero, scale = quantize(w, 4, 32, True)
    parts = {"qweight": pack_along(codes.T.numpy(), 4, 0),
             "qzeros": pack_along((zero - 1).T.numpy(), 4, 1), "scales": scale.T,
             "g_idx": torch.arange(64).flip(0) // 32}  # fmt: skip
    with pytest.raises(ValueError, match="quantization_config: desc_act"):
        hf_quant.unpack(parts, {"quant_method": "gptq", "bits": 4, "group_size": 32})
    with pytest.raises(ValueError, match="quantization_config: group_size 16"):
        hf_quant.unpack(
            {**parts, "g_idx": None}, {"quant_method": "gptq", "bits": 4, "group_size": 16}
        )


def write_compressed_tensors(src: str, dst: Path, bits: int, strategy: str, group, sym: bool):
    """`src` quantized and saved by compressed-tensors itself (llm-compressor's save path:
    apply_quantization_config, min-max scales from the library's calculate_qparams,
    ModelCompressor.compress_model, save_pretrained, update_config), and beside it a float
    folder of the weights the library's own decompressor reads back from that file."""
    from compressed_tensors.compressors import ModelCompressor, PackedQuantizationCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    args = QuantizationArgs(num_bits=bits, type="int", symmetric=sym, strategy=strategy,
                            group_size=group)  # fmt: skip
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    apply_quantization_config(
        model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"])
    )
    for m in model.modules():
        if hasattr(m, "weight_scale"):
            w = m.weight.data
            g = w.reshape(w.shape[0], -1, group or w.shape[1])
            s, z = calculate_qparams(g.amin(-1), g.amax(-1), args)
            m.weight_scale.data.copy_(s.reshape(m.weight_scale.shape))
            if hasattr(m, "weight_zero_point"):
                m.weight_zero_point.data.copy_(z.reshape(m.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    shutil.copytree(src, dst)  # the tokenizer; the weights and config are replaced
    for f in dst.glob("*.safetensors"):
        f.unlink()
    model.save_pretrained(dst)
    compressor.update_config(str(dst))
    ref = dst.parent / f"{dst.name}-ref"
    shutil.copytree(src, ref)
    tensors = load_file(str(dst / "model.safetensors"))
    floats = {}
    for name, t in tensors.items():
        prefix, _, leaf = name.rpartition(".")
        if leaf == "weight_packed":
            parts = {
                k.rpartition(".")[2]: v for k, v in tensors.items() if k.startswith(prefix + ".")
            }
            floats[f"{prefix}.weight"] = PackedQuantizationCompressor.decompress(parts, scheme)[
                "weight"
            ].float()
        elif not leaf.startswith("weight_"):
            floats[name] = t.float()
    for f in ref.glob("*.safetensors"):
        f.unlink()
    save_file({k: v.contiguous() for k, v in floats.items()}, str(ref / "model.safetensors"))
    return str(dst), str(ref)


@pytest.mark.parametrize(
    "bits,strategy,group,sym,qtype,tol",
    [
        (4, "group", 32, True, "Q4_0", 2e-3),  # W4A16: f32 scales rounded to the block's f16
        (4, "group", 64, False, "Q4_1", 5e-3),  # W4A16 asymmetric
        (8, "channel", None, True, "Q8_0", 2e-3),  # W8A16
    ],
)
def test_compressed_tensors_checkpoint_equals_its_decompressed_twin(
    tiny_model_dir, tmp_path, monkeypatch, bits, strategy, group, sym, qtype, tol
):
    monkeypatch.setattr(quant_ops, "DEFAULT_MODE", "f32")
    path, ref = write_compressed_tensors(
        tiny_model_dir("llama"), tmp_path / "ct", bits, strategy, group, sym
    )
    qc = json.loads((Path(path) / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    ours, sq = run(path)
    theirs, _ = run(ref)
    held = {n: p.quant for n, p in sq.runner.model.named_parameters() if getattr(p, "quant", None)}
    assert len(held) == 2 * 4 and {qt.qtype for q in held.values() for _, qt in q.parts} == {qtype}
    for rid in ours:
        a, b = torch.tensor(ours[rid]["lp"][1:]), torch.tensor(theirs[rid]["lp"][1:])
        assert (a - b).abs().max().item() < tol, (rid, (a - b).abs().max().item())
        assert ours[rid]["ids"] == theirs[rid]["ids"], rid


@pytest.mark.parametrize(
    "patch,field",
    [
        ({"format": "int-quantized"}, "config_groups.group_0.format 'int-quantized'"),
        ({"input_activations": {"num_bits": 8, "type": "int"}}, "input_activations"),
        ({"weights": {"num_bits": 2, "type": "int", "strategy": "group"}}, "weights: int"),
        ({"weights": {"num_bits": 4, "type": "int", "strategy": "block"}}, "strategy 'block'"),
    ],
)
def test_compressed_tensors_refusals_name_the_field(patch, field):
    group = {"format": "pack-quantized", "targets": ["Linear"],
             "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32}}  # fmt: skip

    class Cfg:
        quantization_config = {"quant_method": "compressed-tensors", "format": "pack-quantized",
                               "config_groups": {"group_0": {**group, **patch}}}  # fmt: skip

    with pytest.raises(ValueError, match=f"quantization_config: .*{field.replace('.', '[.]')}"):
        hf_quant.quant_method(Cfg())
    Cfg.quantization_config = {**Cfg.quantization_config, "config_groups": {"group_0": group},
                               "sparsity_config": {"format": "sparse-24-bitmask"}}  # fmt: skip
    with pytest.raises(ValueError, match="quantization_config: sparsity_config"):
        hf_quant.quant_method(Cfg())
