"""GGUF model files: weights, config and tokenizer read through ggml's own `gguf` package."""
