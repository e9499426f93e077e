"""Tokenizer loading (offline, from the model folder) and the ids that end generation."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

_GENERIC_FAST = ("PreTrainedTokenizerFast", "TokenizersBackend")


def _tokenizer_class(path: str) -> str | None:
    try:
        config = json.loads((Path(path) / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    return config.get("tokenizer_class") if isinstance(config, dict) else None


@lru_cache(maxsize=8)
def load_tokenizer(path: str):
    import transformers

    from loom.runtime.gguf.file import gguf_file

    if (file := gguf_file(path)) is not None:
        from loom.runtime.gguf.tokenizer import gguf_tokenizer
        from loom.runtime.process import release_free_heap

        tok = gguf_tokenizer(str(file))
        release_free_heap()  # the build's transient lists and Rust parse buffers, freed
        return tok
    # AutoTokenizer imports transformers' configuration module, and with it torch (~200 MB in
    # the owner process, which never runs the model); a folder that names the generic fast
    # class gets the same object from that class directly
    auto = _tokenizer_class(path) not in _GENERIC_FAST
    cls = transformers.AutoTokenizer if auto else transformers.PreTrainedTokenizerFast
    try:
        return cls.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"tokenizer_path: cannot load a tokenizer from {path!r}: {e}") from e


def eos_token_ids(model_path: str, tokenizer) -> set[int]:
    """EOS ids from generation_config.json, config.json and the tokenizer, merged (a GGUF
    file: its EOS / end-of-turn ids)."""
    from loom.runtime.gguf.file import gguf_file

    ids: set[int] = set()
    if (file := gguf_file(model_path)) is not None and tokenizer is not None:
        from loom.runtime.gguf.tokenizer import end_of_turn_ids

        ids |= end_of_turn_ids(str(file), tokenizer)
    for name in ("generation_config.json", "config.json"):
        file = Path(model_path) / name
        if file.is_file():
            value = json.loads(file.read_text()).get("eos_token_id")
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, list):
                ids.update(v for v in value if isinstance(v, int))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
