"""A model's path and config, without torch: the Engine's and the server's own process checks
the path and reads the config here, and only the scheduler ranks import torch (runtime/
model_loader.py re-exports both)."""

from __future__ import annotations

from pathlib import Path

from loom.runtime.gguf.file import gguf_file


def check_model_folder(path: str) -> Path:
    if gguf_file(path) is not None:
        return Path(path)
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(
            f"model_path: {path!r} is not a local folder or .gguf file (loom loads models offline)"
        )
    if not (folder / "config.json").is_file():
        raise ValueError(f"model_path: {path!r} has no config.json")
    return folder


def load_config(path: str):
    import transformers

    if (file := gguf_file(path)) is not None:
        from loom.runtime.gguf.config import gguf_config

        return gguf_config(str(file))
    folder = check_model_folder(path)
    try:
        return transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except (ValueError, KeyError, OSError) as e:
        raise ValueError(f"model_path: cannot read {folder / 'config.json'}: {e}") from e
