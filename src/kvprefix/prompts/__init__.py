"""OpenAI request bodies -> rendered text and token ids: the one renderer (chat, completions, tools). No torch."""

from kvprefix.prompts.render import (
    PromptError,
    RenderedPrompt,
    completion_prompts,
    normalize_messages,
    render_bodies,
    render_body,
    render_chat,
    render_completion,
    truncate_prompt,
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
