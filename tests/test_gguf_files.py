"""GGUF files written by the tests (tests/gguf_files.py): loom reads config, weights and
tokenizer from them exactly as from the Hugging Face checkpoint they were converted from."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from loom.runtime.gguf.file import gguf_file
from loom.runtime.gguf.weights import iterate_gguf_weights
from loom.runtime.layers.quant_types import BLOCKS, QuantizedTensor
from loom.runtime.model_loader import iterate_weights, load_config
from tests.gguf_files import permute, write_gguf

TEXTS = ["Paris is the capital of France.", ' {"name": "Alice", "age": 31} 0123', "héllo 你好 😀",
         "<|im_start|>user\nhi<|im_end|>"]  # fmt: skip


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")

    def get(family: str, qtype: str = "F32") -> tuple[Path, Path]:
        folder = Path(tiny_model_dir(family))
        out = root / f"{family}-{qtype}.gguf"
        return folder, out if out.is_file() else write_gguf(folder, out, qtype)

    return get


@pytest.mark.parametrize("family", ["llama", "llama-mqa", "gemma3"])
def test_f32_file_loads_the_checkpoint_it_came_from(tiny_gguf, family):
    folder, file = tiny_gguf(family)
    want = dict(iterate_weights(str(folder)))
    got = dict(iterate_weights(str(file)))
    tied = load_config(str(folder)).tie_word_embeddings
    assert set(got) == set(want) - ({"lm_head.weight"} if tied else set())
    for name, value in got.items():
        # Gemma's norms come back as (w + 1) - 1 in float32: exact up to rounding
        atol = 1e-6 if family == "gemma3" and name.endswith("norm.weight") else 0
        torch.testing.assert_close(value, want[name].float(), rtol=0, atol=atol, msg=name)
    a, b = load_config(str(folder)), load_config(str(file))
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings",
                "rms_norm_eps", "architectures"):  # fmt: skip
        got_v, want_v = getattr(b, key), getattr(a, key)
        assert got_v == pytest.approx(want_v) if isinstance(want_v, float) else got_v == want_v, key
    if family == "gemma3":
        assert b.layer_types == a.layer_types and b.sliding_window == a.sliding_window
        assert b.final_logit_softcapping == a.final_logit_softcapping
        assert b.rope_parameters == a.rope_parameters or (
            b.rope_parameters["sliding_attention"] == a.rope_parameters["sliding_attention"]
        )


def test_f32_file_generates_like_the_checkpoint(tiny_gguf):
    from tests.test_models_hf_parity import prompt_ids, run_loom

    folder, file = tiny_gguf("llama-mqa")  # (the "llama" one has llama3 rope scaling)
    prompts = prompt_ids(str(folder))
    want, got = run_loom(str(folder), prompts), run_loom(str(file), prompts)
    assert [got[r]["ids"] for r in sorted(got)] == [want[r]["ids"] for r in sorted(want)]


def test_tokenizer_from_metadata_equals_the_checkpoints(tiny_gguf):
    from loom.runtime.tokenizer import eos_token_ids, load_tokenizer

    folder, file = tiny_gguf("llama")
    want, got = load_tokenizer(str(folder)), load_tokenizer(str(file))
    for text in TEXTS:
        assert got(text).input_ids == want(text).input_ids, text
        assert got.decode(got(text).input_ids) == want.decode(want(text).input_ids)
    msgs = [{"role": "user", "content": "hi"}]
    assert got.apply_chat_template(msgs, tokenize=False) == want.apply_chat_template(
        msgs, tokenize=False
    )
    assert got.eos_token == want.eos_token and got.pad_token == want.pad_token
    assert eos_token_ids(str(file), got) == {want.eos_token_id}


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_quantized_file_loads_as_the_dequantized_reference(tiny_gguf, qtype):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize
    from safetensors.numpy import load_file

    folder, file = tiny_gguf("llama", qtype)
    q = GGMLQuantizationType[qtype]
    hf = load_file(str(folder / "model.safetensors"))
    floats = dict(iterate_gguf_weights(str(file)))
    kept = dict(iterate_gguf_weights(str(file), keep_quantized=True))
    name = "model.layers.0.self_attn.q_proj.weight"
    # the reference: what llama.cpp's converter stores, dequantized, rows put back in HF order
    stored = quantize(permute(hf[name].astype(np.float32), 4), q)
    ref = dequantize(stored, q).reshape(4, -1, 2, 64).swapaxes(1, 2).reshape(64, 64)
    torch.testing.assert_close(floats[name], torch.from_numpy(ref), rtol=0, atol=0)
    assert (floats[name] - torch.from_numpy(hf[name])).abs().max() < 0.1  # a real quantization
    for key, value in kept.items():
        if value.__class__ is QuantizedTensor:
            assert value.qtype == qtype and value.shape == tuple(floats[key].shape)
            back = dequantize(value.data.numpy(), q).reshape(value.shape)
            assert torch.equal(torch.from_numpy(back), floats[key]), key
        else:  # 1-D norms and the f32 embedding stay float
            assert torch.equal(value, floats[key]), key
    assert sum(v.__class__ is QuantizedTensor for v in kept.values()) == 2 * 7 + 1  # + lm_head


def _random_blocks(qtype: str, rows: int, cols: int, rng) -> np.ndarray:
    """Random bytes in `qtype`'s block layout with finite, small f16 scales."""
    values, nbytes = BLOCKS[qtype]
    blocks = rng.integers(0, 256, size=(rows, cols // values, nbytes), dtype=np.uint8)
    scales = lambda n: rng.uniform(-0.05, 0.05, size=(rows, cols // values, n)).astype(np.float16)
    if qtype == "Q4_K":  # d, dmin first
        blocks[..., 0:4] = scales(2).view(np.uint8)
    elif qtype == "Q6_K":  # d last
        blocks[..., 208:210] = scales(1).view(np.uint8)
    elif qtype in ("Q5_0", "Q5_1"):  # d (and Q5_1's m) first
        blocks[..., 0 : 2 * (1 + (qtype == "Q5_1"))] = scales(1 + (qtype == "Q5_1")).view(np.uint8)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q5_0", "Q5_1"])
def test_k_quant_blocks_load_as_the_dequantized_reference(tmp_path, qtype):
    import gguf
    from gguf.quants import dequantize

    rng = np.random.default_rng(0)
    q = gguf.GGMLQuantizationType[qtype]
    heads, kv_heads, head_dim, cols = 2, 1, 4, 512
    file = tmp_path / f"{qtype}.gguf"
    w = gguf.GGUFWriter(str(file), "llama")
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    raw = {
        "blk.0.attn_q.weight": _random_blocks(qtype, heads * head_dim, cols, rng),
        "blk.0.attn_k.weight": _random_blocks(qtype, kv_heads * head_dim, cols, rng),
        "blk.0.ffn_up.weight": _random_blocks(qtype, 6, cols, rng),
    }
    for name, data in raw.items():
        w.add_tensor(name, data, raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    floats = dict(iterate_gguf_weights(str(file)))
    kept = dict(iterate_gguf_weights(str(file), keep_quantized=True))

    for gname, hf, n in [("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight", heads),
                         ("blk.0.attn_k.weight", "model.layers.0.self_attn.k_proj.weight", kv_heads),
                         ("blk.0.ffn_up.weight", "model.layers.0.mlp.up_proj.weight", None)]:  # fmt: skip
        deq = dequantize(raw[gname], q)
        assert np.isfinite(deq).all()
        # inverse of permute(): rows (h, half, i) -> (h, i, half), as transformers' loader does
        want = (
            deq
            if n is None
            else deq.reshape(n, head_dim // 2, 2, cols).swapaxes(1, 2).reshape(deq.shape)
        )
        assert torch.equal(floats[hf], torch.from_numpy(want)), hf
        assert kept[hf].qtype == qtype and kept[hf].shape == want.shape
        assert torch.equal(torch.from_numpy(dequantize(kept[hf].data.numpy(), q)), floats[hf])
        if n is not None:  # permute() of the HF rows gives back the file's rows
            assert np.array_equal(permute(want, n), deq)


def test_gguf_file_rules(tmp_path, tiny_gguf):
    _, file = tiny_gguf("llama")
    assert gguf_file(file) == file
    one = tmp_path / "one"
    one.mkdir()
    (one / "m.gguf").write_bytes(file.read_bytes())
    assert gguf_file(one) == one / "m.gguf"
    assert load_config(str(one)).architectures == ["LlamaForCausalLM"]
    (one / "n.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="model_path: .*several GGUF files"):
        gguf_file(one)
    assert gguf_file(tmp_path) is None  # no .gguf here
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="model_path: .*not a readable GGUF"):
        load_config(str(bad))


def _same_as_gguf_reader(path) -> None:
    """loom's header reader gives GGUFReader's field contents and tensor views, equal."""
    import gguf

    from loom.runtime.gguf.reader import GGUFFile

    ours, ref = GGUFFile(str(path)), gguf.GGUFReader(str(path))
    theirs = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert ours.fields == theirs
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors, strict=True):
        assert a.tensor_type == b.tensor_type and np.array_equal(a.shape, b.shape), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data, b.data), a.name


@pytest.mark.parametrize(
    "family,qtype", [("llama", "F32"), ("llama", "Q5_0"), ("gemma3", "Q4_1"), ("llama-mqa", "Q8_0")]
)
def test_header_reader_equals_gguf_reader(tiny_gguf, family, qtype):
    _same_as_gguf_reader(tiny_gguf(family, qtype)[1])


def test_header_reader_rejects_truncated_and_foreign_files(tmp_path, tiny_gguf):
    from loom.runtime.gguf.file import open_reader

    _, file = tiny_gguf("llama")
    raw = file.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(raw[:200])  # inside the metadata
    with pytest.raises(ValueError, match="model_path: .*not a readable GGUF"):
        open_reader(str(cut))
    v9 = tmp_path / "v9.gguf"
    v9.write_bytes(raw[:4] + (9).to_bytes(4, "little") + raw[8:])
    with pytest.raises(ValueError, match="model_path: .*GGUF version 9"):
        open_reader(str(v9))


def test_dropped_pages_read_back_the_same_bytes(tiny_gguf):
    """drop_pages (the loader's way to keep the mapped file out of the resident set once a
    tensor is copied) loses nothing: every tensor reads back byte for byte afterwards, the
    neighbours of a dropped one included, and the resident pages of the map go down."""
    from loom.runtime.gguf.reader import GGUFFile

    _, file = tiny_gguf("llama", "Q8_0")
    ours = GGUFFile(str(file))
    before = [t.data.copy() for t in ours.tensors]

    def resident() -> int:  # kB of the map in this process (smaps: mincore sees the page cache)
        lines = Path("/proc/self/smaps").read_text().splitlines()
        for i, line in enumerate(lines):
            lo, _, hi = line.split()[0].partition("-")
            if hi and int(lo, 16) <= ours._base < int(hi, 16):
                return next(int(x.split()[1]) for x in lines[i + 1 :] if x.startswith("Rss:"))
        raise AssertionError("the map is not in smaps")

    full = resident()
    for t in ours.tensors:
        ours.drop_pages(t)
    assert resident() < full
    for t, b in zip(ours.tensors, before, strict=True):
        assert np.array_equal(t.data, b), t.name


@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 2.0}])
def test_llama_gguf_config_equals_transformers_llama_config(tiny_gguf, tmp_path, scaling):
    """runtime/gguf/config.py's plain Llama config (no transformers import: ~65 MB) has every
    model field of transformers' LlamaConfig built from the same values, with its values."""
    import gguf
    import transformers

    from loom.runtime.gguf.config import LlamaGGUFConfig

    _, file = tiny_gguf("llama")
    if scaling:  # the same file with linear rope scaling in its metadata
        scaled = tmp_path / "scaled.gguf"
        reader = gguf.GGUFReader(str(file))
        writer = gguf.GGUFWriter(str(scaled), "llama")
        for field in reader.fields.values():
            if field.name.startswith(("llama.", "tokenizer.", "general.name")):
                writer.add_key_value(field.name, field.contents(), field.types[0],
                                     field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None)  # fmt: skip
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(2.0)
        for t in reader.tensors:
            writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        file = scaled
    got = load_config(str(file))
    assert isinstance(got, LlamaGGUFConfig)
    fields = {k: v for k, v in got.to_dict().items() if k not in ("rope_parameters", "model_type")}
    fields.pop("architectures")
    theta = got.rope_parameters["rope_theta"]
    want = transformers.LlamaConfig(**fields, rope_theta=theta, rope_scaling=scaling)
    want.architectures = ["LlamaForCausalLM"]
    generic = set(transformers.PretrainedConfig().to_dict())  # labels, output flags, version
    model_fields = set(want.to_dict()) - generic
    assert model_fields <= set(got.to_dict()), model_fields - set(got.to_dict())
    for key in model_fields | {"architectures", "model_type", "tie_word_embeddings"}:
        assert getattr(got, key) == getattr(want, key), key
    assert got.rope_parameters == want.rope_parameters
    if scaling:
        assert got.rope_parameters["rope_type"] == "linear"
