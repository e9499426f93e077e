"""Chat templates as role prefixes and suffixes (what `with s.user():` wraps around text).

Built-ins: `default`, `chatml`, `qwen`, `llama-3-instruct` (alias `llama-3`). A model's own Jinja template is
turned into prefixes/suffixes by rendering probe conversations (`from_tokenizer`); when that
fails, the template is matched to a built-in by its markers.
"""

from __future__ import annotations

import dataclasses

_CHATML_ROLES = {
    "system": ("<|im_start|>system\n", "<|im_end|>\n"),
    "user": ("<|im_start|>user\n", "<|im_end|>\n"),
    "assistant": ("<|im_start|>assistant\n", "<|im_end|>\n"),
}


@dataclasses.dataclass
class ChatTemplate:
    name: str
    default_system_prompt: str | None
    role_prefix_and_suffix: dict[str, tuple[str, str]]
    stop_str: tuple[str, ...] = ()

    def get_prefix_and_suffix(self, role: str, hist_messages: list[dict]) -> tuple[str, str]:
        return self.role_prefix_and_suffix.get(role, ("", ""))

    def get_prompt(self, messages: list[dict]) -> str:
        prompt = ""
        for i, message in enumerate(messages):
            role, content = message["role"], message["content"]
            if role == "system" and content is None:
                content = self.default_system_prompt
                if content is None:
                    continue
            prefix, suffix = self.get_prefix_and_suffix(role, messages[:i])
            prompt += f"{prefix}{content}{suffix}"
        return prompt


_REGISTRY: dict[str, ChatTemplate] = {}


def register_chat_template(template: ChatTemplate) -> None:
    _REGISTRY[template.name] = template


def get_chat_template(name: str) -> ChatTemplate:
    if name not in _REGISTRY:
        raise ValueError(f"chat_template: unknown name {name!r}; known: {sorted(_REGISTRY)}")
    return _REGISTRY[name]


register_chat_template(
    ChatTemplate(
        "default",
        None,
        {"system": ("SYSTEM:", "\n"), "user": ("USER:", "\n"), "assistant": ("ASSISTANT:", "\n")},
    )
)
register_chat_template(ChatTemplate("chatml", None, dict(_CHATML_ROLES), ("<|im_end|>",)))
register_chat_template(ChatTemplate("qwen", None, dict(_CHATML_ROLES), ("<|im_end|>",)))
register_chat_template(
    ChatTemplate(
        "llama-3-instruct",
        None,
        {
            role: (f"<|start_header_id|>{role}<|end_header_id|>\n\n", "<|eot_id|>")
            for role in ("system", "user", "assistant")
        },
        ("<|eot_id|>",),
    )
)


_REGISTRY["llama-3"] = _REGISTRY["llama-3-instruct"]  # the short name


def match_by_text(text: str) -> ChatTemplate:
    """A built-in chosen from a template's (or a model path's) telltale markers."""
    lowered = text.lower()
    if "<|start_header_id|>" in text or "llama-3" in lowered or "llama3" in lowered:
        return get_chat_template("llama-3-instruct")
    if "qwen" in lowered:
        return get_chat_template("qwen")
    if "<|im_start|>" in text:
        return get_chat_template("chatml")
    return get_chat_template("default")


_MARK = "\x00LOOM_MARK\x00"


def from_tokenizer(tokenizer, name: str = "model") -> ChatTemplate:
    """The tokenizer's own chat template as prefixes/suffixes; `default` when it has none."""
    source = getattr(tokenizer, "chat_template", None)
    if not isinstance(source, str) or not source:
        return get_chat_template("default")
    try:
        return _derive(tokenizer, name)
    except Exception:  # noqa: BLE001 - any template quirk: fall back to a known shape
        return match_by_text(source)


def _derive(tokenizer, name: str) -> ChatTemplate:
    def render(messages: list[dict]) -> str:
        return tokenizer.apply_chat_template(messages, tokenize=False)

    def split(segment: str) -> tuple[str, str]:
        before, sep, after = segment.partition(_MARK)
        if not sep:
            raise ValueError("marker lost")
        return before, after

    def after(full: str, base: str) -> str:
        if not full.startswith(base):
            raise ValueError("template is not incremental")
        return full[len(base) :]

    bos = getattr(tokenizer, "bos_token", None) or ""
    sys_msg = {"role": "system", "content": "S"}
    user_msg = {"role": "user", "content": "U"}
    system = split(render([{"role": "system", "content": _MARK}]))
    if bos and system[0].startswith(bos):  # the tokenizer adds BOS itself
        system = (system[0][len(bos) :], system[1])
    base = render([sys_msg])
    user = split(after(render([sys_msg, {"role": "user", "content": _MARK}]), base))
    base = render([sys_msg, user_msg])
    assistant = split(
        after(render([sys_msg, user_msg, {"role": "assistant", "content": _MARK}]), base)
    )
    # A template that inserts a system turn on its own has a default system prompt.
    default_system = None
    lone_user = render([{"role": "user", "content": _MARK}])
    if bos and lone_user.startswith(bos):
        lone_user = lone_user[len(bos) :]
    head = lone_user.partition(_MARK)[0]
    if head != user[0] and head.startswith(system[0]) and head.endswith(system[1] + user[0]):
        default_system = head[len(system[0]) : len(head) - len(system[1] + user[0])] or None
    stop = assistant[1].strip()
    if not stop:
        stop = getattr(tokenizer, "eos_token", None) or ""
    return ChatTemplate(
        name,
        default_system,
        {"system": system, "user": user, "assistant": assistant},
        (stop,) if stop else (),
    )
