"""A small GPT-2-style byte-level BPE encoder built from a GGUF's ``tokenizer.ggml.*`` fields.

The `gguf` package reads the vocabulary but has no encoder, so this is one:
pre-tokenize with the pattern llama.cpp uses for ``tokenizer.ggml.pre =
"smollm"`` (digits split one by one, then the GPT-2 pattern), map bytes to
GPT-2's printable alphabet, and apply merges lowest rank first. Python's `re`
has no ``\\p{L}``; ``[^\\W\\d_]`` (letters) and ``\\d`` (digits) stand in,
which is exact on ASCII text such as the Lee corpus.
"""
from __future__ import annotations

import re
from functools import lru_cache

_LETTER, _DIGIT = r"[^\W\d_]", r"\d"
_PRETOKEN = re.compile(
    rf"'s|'t|'re|'ve|'m|'ll|'d| ?{_LETTER}+|{_DIGIT}| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map of the 256 byte values onto printable characters."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(keep, chars)}


class BPETokenizer:
    """Encode text with a byte-level BPE vocabulary (``tokens``) and ``merges`` ("a b" strings)."""

    def __init__(self, tokens: list[str], merges: list[str]):
        self.ids = {t: i for i, t in enumerate(tokens)}
        self.tokens = tokens
        self.ranks = {tuple(m.split(" ", 1)): i for i, m in enumerate(merges)}
        self.byte_map = _bytes_to_unicode()
        self._word = lru_cache(maxsize=1 << 16)(self._encode_word)

    @classmethod
    def from_gguf(cls, reader) -> "BPETokenizer":
        """From a `gguf.GGUFReader` whose ``tokenizer.ggml.model`` is ``gpt2``."""
        model = reader.fields["tokenizer.ggml.model"].contents()
        if model != "gpt2":
            raise ValueError(f"only gpt2-style BPE vocabularies are supported, not {model!r}")
        return cls(reader.fields["tokenizer.ggml.tokens"].contents(),
                   reader.fields["tokenizer.ggml.merges"].contents())

    def _encode_word(self, word: str) -> tuple[int, ...]:
        parts = [self.byte_map[b] for b in word.encode("utf-8")]
        while len(parts) > 1:
            pairs = [(self.ranks.get(p, 1 << 30), i) for i, p in enumerate(zip(parts, parts[1:]))]
            rank, i = min(pairs)
            if rank == 1 << 30:
                break
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        return tuple(self.ids[p] for p in parts)

    def encode(self, text: str) -> list[int]:
        return [t for w in _PRETOKEN.findall(text) for t in self._word(w)]

    def decode(self, ids) -> str:
        inv = {c: b for b, c in self.byte_map.items()}
        return bytes(inv[c] for i in ids for c in self.tokens[i]).decode("utf-8", errors="replace")
