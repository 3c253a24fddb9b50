"""An independent, slow reference of llama.cpp's byte-level BPE tokenization (src/llama-vocab.cpp, unicode.cpp), to
check the fast tokenizer kvprefix builds from a GGUF file against: the pre-tokenizer regexes as llama.cpp lists
them per `tokenizer.ggml.pre`, applied one after another (the text between matches stays a piece), GPT-2's
byte-to-unicode mapping, then merges by rank, lowest first and leftmost on ties. Written from llama.cpp's rules,
sharing no code with kvprefix.tokenizer.gguf_tokenizer."""

from __future__ import annotations

import regex

_GPT2 = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)"
LLAMA_CPP_REGEXES = {
    "smollm": ("\\p{N}", _GPT2),
    "llama-bpe": (
        "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?"
        "[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    ),
    "qwen2": (
        "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?"
        "[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    ),
}
IGNORE_MERGES = {"llama-bpe"}  # llama.cpp sets ignore_merges for the Llama 3 vocabularies only

# Strings whose tokenization the pre-tokenizer decides: digits, other numerals, CJK, emoji, whitespace runs, code.
PARITY_STRINGS = (
    "Hello world",
    "The year 2024 had 366 days.",
    "1234567890",
    "3.14159 and 2,718 and 1e-9",
    "Phone: +1 (555) 010-9999",
    "½ ¼ ¾ ² ³ ⁴",
    "Ⅻ Ⅳ ⅷ",
    "٣٤٥ ४५६ 五六七",
    "你好，世界！",
    "日本語のテキスト",
    "한국어 문장입니다",
    "🤗 emoji 👍🏽 and 🇫🇷 flags",
    "   leading spaces",
    "trailing spaces   ",
    "a  b   c    d",
    "tabs\tand\t\ttabs",
    "new\nlines\n\n\nand\r\nCRLF",
    "  \n  \n",
    "def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < 10; ++i) { a[i] = i*i; }",
    "{'key': [1, 2, 3], \"v\": null}",
    "I'm sure you'll see they've done it, isn't it?",
    "I'M SURE YOU'LL SEE THEY'VE DONE IT",
    "naïve café résumé",
    "Ünïcödé ÀÉÎÕÜ",
    "x=1;y=22;z=333;w=4444;v=55555",
    "$100.00 or €99,99 or ¥1000",
    "https://example.com/path?q=1&r=22#frag",
    "email@example.com",
    "<|im_start|> is only text here",
    "",
    " ",
    "\n",
)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (byte-level BPE vocabularies are spelled in it)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


_BYTE_CHARS = bytes_to_unicode()


def split(text: str, regexes: tuple[str, ...]) -> list[str]:
    pieces = [text] if text else []
    for pattern in regexes:
        out = []
        for piece in pieces:
            pos = 0
            for m in regex.finditer(pattern, piece):
                if m.start() > pos:
                    out.append(piece[pos : m.start()])
                if m.end() > m.start():
                    out.append(m.group())
                pos = m.end()
            if pos < len(piece):
                out.append(piece[pos:])
        pieces = out
    return pieces


def _bpe(word: str, ranks: dict[tuple[str, str], int]) -> list[str]:
    symbols = list(word)
    while len(symbols) > 1:
        best = min(range(len(symbols) - 1), key=lambda i: (ranks.get((symbols[i], symbols[i + 1]), 1 << 60), i))
        if (symbols[best], symbols[best + 1]) not in ranks:
            break
        symbols[best : best + 2] = [symbols[best] + symbols[best + 1]]
    return symbols


def encode(text: str, tokens: list[str], merges: list[str], pre: str, specials: list[str]) -> list[int]:
    """Token ids for ``text``, special tokens (by their spelling) recognised first, as llama.cpp does."""
    vocab = {t: i for i, t in enumerate(tokens)}
    ranks = {tuple(m.split(" ", 1)): r for r, m in enumerate(merges)}
    ids: list[int] = []
    special_re = "|".join(regex.escape(s) for s in sorted(specials, key=len, reverse=True))
    parts = regex.split(f"({special_re})", text) if specials else [text]
    for part in parts:
        if part in specials:
            ids.append(vocab[part])
            continue
        for piece in split(part, LLAMA_CPP_REGEXES[pre]):
            word = "".join(_BYTE_CHARS[b] for b in piece.encode("utf-8"))
            if pre in IGNORE_MERGES and word in vocab:
                ids.append(vocab[word])
                continue
            for symbol in _bpe(word, ranks):
                ids += [vocab[symbol]] if symbol in vocab else [vocab[c] for c in symbol]
    return ids
