"""A Hugging Face fast tokenizer built from a GGUF file's vocabulary metadata.

GGUF carries no tokenizer.json: the vocabulary, the merges (byte-level BPE files) or per-token
scores (sentencepiece files), token types and special ids are metadata under llama.cpp's key
names. From them this builds the `tokenizers` pipeline the model was trained with:
- `gpt2` (byte-level BPE, SmolLM2): the file's merges; llama.cpp's `pre` names the split
  (`smollm` splits digits one by one before the GPT-2 regex, as SmolLM2's own tokenizer does);
- `llama` (sentencepiece as BPE with byte fallback, Gemma): no merges in the file, so they are
  recovered from the vocabulary, ranked by the merged token's position in the file (Gemma's
  scores do not follow its merge order; the token order does); spaces are written as '▁'.
Tokens typed CONTROL become special tokens, USER_DEFINED ones plain added tokens, so both are
matched whole, as llama.cpp matches them.
"""

from __future__ import annotations

import os
import tempfile

from loom.runtime.gguf.file import metadata

CONTROL, USER_DEFINED = 3, 4
_SPIECE = "\u2581"
# chat templates for files that carry none (Gemma 3's GGUFs): the model's published one
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set first_user_prefix = "
    "messages[0]['content'] + '\n\n' %}{% set loop_messages = messages[1:] %}{% else %}"
    "{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}{% set role = 'model' if message['role'] == 'assistant' "
    "else message['role'] %}{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first "
    "else '') + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
_DEFAULT_TEMPLATES = {"gemma3": GEMMA3_CHAT_TEMPLATE}
# the tokenizer's special tokens, by the metadata key of their ids
_SPECIAL_KEYS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
                 "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}  # fmt: skip
# turn-ending tokens the file does not mark as EOS but the model's generation config does
_END_OF_TURN = {"gemma3": ("<end_of_turn>",)}


def gguf_tokenizer(path: str):
    """A transformers fast tokenizer equivalent to the one the model was published with."""
    import transformers
    from tokenizers import AddedToken

    meta = metadata(path)
    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if kind == "gpt2":
        tok, is_piece = _byte_level(meta, tokens)
    elif kind == "llama":
        tok, is_piece = _sentencepiece(tokens, meta.get("tokenizer.ggml.unknown_token_id"))
    else:
        raise ValueError(
            f"model_path: GGUF tokenizer model {kind!r} is not supported (gpt2, llama)"
        )
    tok.add_special_tokens(
        [
            AddedToken(t, normalized=False, special=True)
            for t, kind_ in zip(tokens, types)
            if kind_ == CONTROL and is_piece(t)
        ]
    )
    vocab = tok.get_vocab()
    tok.add_tokens(
        [
            AddedToken(t, normalized=False, special=False)
            for t, kind_ in zip(tokens, types)
            if kind_ == USER_DEFINED and t in vocab
        ]
    )

    ids = {name: meta.get(f"tokenizer.ggml.{key}") for name, key in _SPECIAL_KEYS.items()}
    arch = meta.get("general.architecture")
    kwargs = dict(
        **{name: None if i is None else tokens[i] for name, i in ids.items()},
        # llama.cpp adds BOS to a sentencepiece vocabulary unless the file says otherwise
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama")),
        add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        chat_template=meta.get("tokenizer.chat_template") or _DEFAULT_TEMPLATES.get(arch),
        clean_up_tokenization_spaces=False,
    )
    # transformers deep-copies a `tokenizer_object` (a JSON round trip: this tokenizer, its
    # JSON and the copy alive at once); from a file it parses once, after this one is gone.
    # Gemma 3's 262k tokens / 515k merges: ~100 MB less at the peak of a load.
    del vocab, tokens, types
    with tempfile.TemporaryDirectory(prefix="loom-tokenizer-") as tmp:
        file = os.path.join(tmp, "tokenizer.json")
        tok.save(file, pretty=False)
        del tok
        return transformers.PreTrainedTokenizerFast(tokenizer_file=file, **kwargs)


def end_of_turn_ids(path: str, tokenizer) -> set[int]:
    """EOS and end-of-turn ids the file names or its family is known to use."""
    meta = metadata(path)
    ids = {
        meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta
    }
    for text in _END_OF_TURN.get(meta.get("general.architecture"), ()):
        i = tokenizer.convert_tokens_to_ids(text)
        if isinstance(i, int) and i != tokenizer.unk_token_id:
            ids.add(i)
    return ids


def _byte_level(meta, tokens):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = bytes_to_unicode()
    spelled = set(alphabet.values())
    # every real token is written in the byte alphabet already; respell any that is not
    vocab = {
        t if set(t) <= spelled else "".join(alphabet[b] for b in t.encode()): i
        for i, t in enumerate(tokens)
    }
    merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if meta.get("tokenizer.ggml.pre") == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    # a CONTROL token outside the byte alphabet is a converter mislabel: adding it would
    # grow the vocabulary past the model's
    return tok, lambda t: set(t) <= spelled


def _sentencepiece(tokens, unk_id: int | None):
    from tokenizers import Tokenizer, decoders, models, normalizers

    # a token of spaces only is stored with real spaces; the vocabulary spells them '▁'
    pieces = [_SPIECE * len(t) if t and not t.strip(" ") else t for t in tokens]
    vocab = {t: i for i, t in enumerate(pieces)}
    tok = Tokenizer(
        models.BPE(
            vocab, _merges_by_position(vocab), fuse_unk=True, byte_fallback=True,
            unk_token=pieces[unk_id] if unk_id is not None else None,
        )
    )  # fmt: skip
    tok.normalizer = normalizers.Replace(" ", _SPIECE)
    tok.decoder = decoders.Sequence(
        [decoders.Replace(_SPIECE, " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return tok, lambda t: True


def _merges_by_position(vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, earliest merged token first (ties: the longer
    left part, then the longer right part, then the lower ids)."""
    merges = []
    for piece, rank in vocab.items():
        local = [
            (piece[:i], piece[i:], rank)
            for i in range(1, len(piece))
            if piece[:i] in vocab and piece[i:] in vocab
        ]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (-m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]
