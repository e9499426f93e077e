"""A byte-level BPE tokenizer (digits split one per token) saved as a transformers fast tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    # Single digits make arithmetic learnable (as Qwen and Llama 3 do).
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Special tokens are split out before BPE sees the text.
    for s in SPECIAL_TOKENS:
        texts = [t.replace(s, "\n") for t in texts]
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def save_hf_tokenizer(tok: Tokenizer, folder: Path, model_max_length: int) -> None:
    """tokenizer.json + tokenizer_config.json + special_tokens_map.json, loadable offline."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    hf.chat_template = CHATML_TEMPLATE
    hf.save_pretrained(str(folder))
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = (
        CHATML_TEMPLATE  # keep it in tokenizer_config.json, not only chat_template.jinja
    )
    cfg["bos_token"] = None
    cfg["add_bos_token"] = False
    # Portable across transformers 4.x and 5.x.
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg.pop("backend", None)
    cfg["additional_special_tokens"] = cfg.pop(
        "extra_special_tokens", ["<|im_start|>", "<|im_end|>"]
    )
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    jinja = folder / "chat_template.jinja"
    if jinja.exists():
        jinja.unlink()
