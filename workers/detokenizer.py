"""Incremental detokenization on raw bytes.

Why bytes: a byte-level BPE token can hold part of a UTF-8 code point (`[e4 bd]` then `[a0]` for
"你"). Each token id is mapped once to the bytes it adds to the text; a streaming UTF-8 decoder
then releases only whole code points, so the text never carries half a character, and the
concatenated output equals `tokenizer.decode(ids, skip_special_tokens=True)`. Special tokens map
to no bytes, so they are never shown.
"""

from __future__ import annotations

import codecs
import json
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's printable-character alphabet for bytes, inverted (char -> byte)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _decoder_kinds(tokenizer: Any) -> set[str]:
    """The decoder types of a fast tokenizer ("ByteLevel", "ByteFallback", ...)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return set()
    state = json.loads(decoder.__getstate__())
    parts = state.get("decoders", [state])
    return {part.get("type", "") for part in parts}


def _byte_level_bytes(piece: str) -> bytes:
    table = _byte_level_decoder()
    return bytes(table[c] for c in piece) if all(c in table for c in piece) else piece.encode()


def _sentencepiece_bytes(piece: str) -> bytes:
    match = _BYTE_FALLBACK.fullmatch(piece)
    return bytes([int(match.group(1), 16)]) if match else piece.replace("▁", " ").encode()


@dataclass(frozen=True, slots=True)
class TokenTable:
    """Per token id: the bytes it adds to the text (b"" for special tokens) and what logprobs show.

    `shown` is the token as logprobs name it: its own bytes, or a special token's literal text.
    """

    text_bytes: tuple[bytes, ...]
    shown: tuple[bytes, ...]

    def __len__(self) -> int:
        return len(self.text_bytes)

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, vocab_size: int | None = None) -> TokenTable:
        """Build once per model; `vocab_size` pads ids the model has but the tokenizer lacks."""
        size = max(len(tokenizer), vocab_size or 0)
        kinds = _decoder_kinds(tokenizer)
        added = {i: tok for i, tok in tokenizer.added_tokens_decoder.items() if i < size}
        if "ByteLevel" in kinds:
            to_bytes = _byte_level_bytes
        elif "ByteFallback" in kinds or "Metaspace" in kinds:
            to_bytes = _sentencepiece_bytes
        else:  # NOTE: word-piece and friends: per-token decode is the best we can do.
            ids = range(len(tokenizer))
            decoded = [tokenizer.decode([i], clean_up_tokenization_spaces=False) for i in ids]
            return cls._assemble(size, [d.encode() for d in decoded], added)
        pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        return cls._assemble(size, [to_bytes(p or "") for p in pieces], added)

    @classmethod
    def _assemble(cls, size: int, regular: list[bytes], added: dict[int, Any]) -> TokenTable:
        text = regular + [b""] * (size - len(regular))
        shown = list(text)
        for token_id, token in added.items():
            content = token.content.encode()
            text[token_id] = b"" if token.special else content
            shown[token_id] = content
        return cls(tuple(text), tuple(shown))

    def token_text(self, token_id: int) -> str:
        """The token as a string for logprobs (partial code points become U+FFFD)."""
        return self.shown[token_id].decode("utf-8", errors="replace")


class IncrementalDetokenizer:
    """Turns one sequence's token ids into text, one token at a time, whole code points only."""

    __slots__ = ("_decoder", "_text_bytes")

    def __init__(self, text_bytes: tuple[bytes, ...] | list[bytes]) -> None:
        self._text_bytes = text_bytes
        # NOTE: errors="replace" matches the tokenizer's lossy decode: an invalid byte becomes
        # U+FFFD at once, while a valid but incomplete prefix waits for its next bytes.
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Text completed by this token (often "", e.g. mid code point or a special token)."""
        return self._decoder.decode(self._text_bytes[token_id])

    def flush(self) -> str:
        """At the end: bytes still waiting for the rest of a code point become U+FFFD."""
        return self._decoder.decode(b"", final=True)
