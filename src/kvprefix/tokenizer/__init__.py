"""Text <-> token ids, no torch: tokenizer and chat template (Hugging Face or GGUF), streaming detokenizer, GGUF
reader and vocabularies, and the memos for repeated prompts."""

from kvprefix.tokenizer.detokenizer import IncrementalDetokenizer
from kvprefix.tokenizer.segment_cache import SegmentCachedTokenizer
from kvprefix.tokenizer.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer", "SegmentCachedTokenizer", "Tokenizer"]
