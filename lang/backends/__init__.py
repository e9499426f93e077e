"""Backends: where a program's gens and selects run (Engine, RuntimeEndpoint, OpenAI)."""
