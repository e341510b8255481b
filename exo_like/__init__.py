"""exo-like: one LLM across several machines, zero configuration."""

__version__ = "0.1.0"
