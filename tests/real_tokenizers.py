"""Real tokenizers at real vocabulary sizes, built from pip packages (nothing from a model hub).

    from tests.real_tokenizers import llama3_tokenizer
    tok = llama3_tokenizer()          # Llama 3: 128,000 BPE tokens + 256 specials

The BPE ranks ship in the `llama-models` wheel (`llama_models/llama3/tokenizer.model`);
transformers' TikTokenConverter turns them into a fast HF tokenizer. The converted folder is
cached under ~/.cache/loom/tokenizers (or $LOOM_TOKENIZER_CACHE), so only the first call pays
the conversion (a few seconds). `llama3_tokenizer_path()` gives that folder, for code that takes
a path (`--tokenizer-path`, `AutoTokenizer.from_pretrained`).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

# Llama 3's pre-tokenizer split, as its tokenizer.json spells it.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_NAMED = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>",
    "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>",
]  # fmt: skip
LLAMA3_SPECIAL = _NAMED + [
    f"<|reserved_special_token_{i}|>" for i in range(2, 2 + 256 - len(_NAMED))
]


def _cache_dir() -> Path:
    root = os.environ.get("LOOM_TOKENIZER_CACHE") or Path.home() / ".cache" / "loom" / "tokenizers"
    return Path(root)


def llama3_tokenizer_path() -> str:
    """The folder of Llama 3's tokenizer in HF form, converted on first use."""
    out = _cache_dir() / "llama3"
    if (out / "tokenizer.json").exists():
        return str(out)
    try:
        import llama_models
    except ImportError as e:  # pragma: no cover - in the [test] extras
        raise RuntimeError("Llama 3's tokenizer needs `pip install llama-models`") from e
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    model = Path(llama_models.__file__).parent / "llama3" / "tokenizer.model"
    converted = TikTokenConverter(
        vocab_file=str(model), pattern=LLAMA3_PATTERN, extra_special_tokens=LLAMA3_SPECIAL
    ).converted()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=converted, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>"
    )
    tmp = out.with_name(f"llama3.tmp{os.getpid()}")
    fast.save_pretrained(tmp)
    tmp.replace(out) if not out.exists() else None  # another process may have won the race
    return str(out)


@functools.lru_cache(maxsize=1)
def llama3_tokenizer():
    """Llama 3's 128,256-token tokenizer as a transformers fast tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(llama3_tokenizer_path())
