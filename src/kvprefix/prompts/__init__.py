"""OpenAI request bodies -> rendered text and token ids: the one renderer, and the tokenizer it uses. No torch."""

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
from kvprefix.prompts.segment_cache import SegmentCachedTokenizer
from kvprefix.prompts.tokenizer import Tokenizer

__all__ = [
    "PromptError",
    "RenderedPrompt",
    "SegmentCachedTokenizer",
    "Tokenizer",
    "completion_prompts",
    "normalize_messages",
    "render_bodies",
    "render_body",
    "render_chat",
    "render_completion",
    "truncate_prompt",
]
