"""Process-wide settings of the language (SGLang's `global_config`)."""

from __future__ import annotations


class GlobalConfig:
    def __init__(self) -> None:
        self.verbosity = 0  # 2 prints each finished program's text
        self.default_backend = None
        # Output detokenization, sent with every gen.
        self.skip_special_tokens_in_output = True
        self.spaces_between_special_tokens_in_out = True
        # Interpreter optimizations.
        self.enable_precache_with_tracing = (
            True  # run_batch prefills a program's constant prefix once
        )
        self.enable_parallel_encoding = True  # accepted for compatibility; joins append text


global_config = GlobalConfig()
