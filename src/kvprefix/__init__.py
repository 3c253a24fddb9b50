"""kvprefix: a prefix-caching LLM engine and OpenAI-compatible server."""

__version__ = "0.1.0"
