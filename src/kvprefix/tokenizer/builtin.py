"""An offline, deterministic byte-level BPE tokenizer with a ChatML-style chat template.

For test checkpoints, so nothing is downloaded; byte-level, so multi-byte characters split as with real ones.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

END_OF_TEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [END_OF_TEXT, IM_START, IM_END]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# A fixed training text: the merges only need to be plausible and reproducible, not good.
_CORPUS = """\
A prefix cache keeps the keys and values of a shared prompt prefix, so that later requests starting with the same
tokens skip straight to their suffix. The system prompt, the few-shot examples, the chat history and a long
document are computed once and reused by every request that follows. Blocks are hashed in a chain: each block's
hash depends on its parent, its tokens and the execution context. The scheduler admits a request with the cached
tokens already computed; only the remaining tokens use the prefill budget. When memory runs out the least recently
used free block is evicted first. You are a helpful assistant. What is the capital of France? The capital of France
is Paris. Please summarize the following document in three sentences. Translate the text into German and French.
def hello(name): return f"Hello, {name}!"  # code, numbers 0123456789 and punctuation: ()[]{}<>=+-*/.,;:!?'"
Caché, über, naïve, façade, smörgåsbord. Привет, мир. こんにちは世界。你好，世界。안녕하세요. 🙂🚀✨ — “quotes” … €£¥
"""


def build_tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Trains the byte-level BPE on the fixed corpus; the same vocab_size gives the same tokenizer."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=END_OF_TEXT,
        chat_template=CHAT_TEMPLATE,
    )
