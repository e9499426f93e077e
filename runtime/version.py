"""loom's version: here, below the language and the HTTP layer, which both report it."""

__version__ = "0.1.0"
