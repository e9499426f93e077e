"""The language's chat templates: runtime/chat_template.py's registry (the server's
`--chat-template NAME` reads the same one), under the name programs import."""

from loom.runtime.chat_template import (
    ChatTemplate,
    from_tokenizer,
    get_chat_template,
    match_by_text,
    register_chat_template,
)

__all__ = [
    "ChatTemplate",
    "from_tokenizer",
    "get_chat_template",
    "match_by_text",
    "register_chat_template",
]
