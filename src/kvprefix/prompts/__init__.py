"""OpenAI request bodies -> rendered text and token ids: the one renderer (chat, completions, tools) and the one
body adapter (``render_body``: vLLM's meaning of every field that changes the prompt). No torch."""

from kvprefix.prompts.body import completion_prompts, render_bodies, render_body, truncate_prompt
from kvprefix.prompts.render import (
    PromptError,
    RenderedPrompt,
    normalize_messages,
    render_chat,
    render_completion,
)

__all__ = [
    "PromptError",
    "RenderedPrompt",
    "completion_prompts",
    "normalize_messages",
    "render_bodies",
    "render_body",
    "render_chat",
    "render_completion",
    "truncate_prompt",
]
