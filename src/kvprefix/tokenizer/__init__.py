"""Text <-> token ids, no torch: the tokenizer and its chat template (Hugging Face files or a GGUF file), the
streaming detokenizer, the GGUF reader and vocabularies, and the memos that make tokenizing a repeated prompt
cheap. The renderer of request bodies (`kvprefix.prompts`) and the engine use it."""

from kvprefix.tokenizer.detokenizer import IncrementalDetokenizer
from kvprefix.tokenizer.segment_cache import SegmentCachedTokenizer
from kvprefix.tokenizer.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer", "SegmentCachedTokenizer", "Tokenizer"]
