"""How big a prompt can be before it is tokenized, and tokenizing big prompts off the event loop.

Two guards keep one huge prompt from stalling every other client:

- :class:`PromptBound` — a sound lower bound on the number of tokens a text encodes to, from its
  length alone: ``tokens >= len(text) / (max_chars_per_token * shrink)``. ``max_chars_per_token``
  is the longest vocabulary entry (added tokens included), and each token of a tokenizer that
  drops nothing covers at most that many characters of the (normalized) text; ``shrink`` is 4
  when the normalizer composes characters (NFC / NFKC fold at most 4 code points into one) and
  the text is not pure ASCII, else 1. A text whose bound already exceeds the context is
  rejected as ``context_length_exceeded`` without being tokenized (a 10 MB prompt costs a length
  check, not seconds of tokenization and GBs of token objects). The bound is only used when it
  holds for the checkpoint's tokenizer: a BPE model (with byte fallback, or byte-level with the
  whole byte alphabet in its vocabulary), pre-tokenizers and normalizers that never delete
  text, and no added token that absorbs surrounding whitespace (``lstrip`` / ``rstrip``).
  Anything else (WordPiece, Unigram, ``Strip``, ``WhitespaceSplit``, a precompiled charsmap,
  ...) gets no bound, and such prompts are only limited by the request body size.
- :func:`encode_releasing_gil` — ``tokenizers``' ``encode`` holds the GIL for the whole call
  (1.6 s for 2 MB of text on the test machine, during which no other thread runs);
  ``encode_batch`` of one text gives the same ids and releases it. Handlers prepare large
  requests (render + tokenize) in a worker thread with it, so the event loop keeps serving.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from resin.tokenizer import Tokenizer

NFC_SHRINK = 4  # the longest canonical decomposition: at most 4 code points compose into 1
_COMPOSING = {"NFC", "NFKC"}
_EXPANDING_OR_NEUTRAL = {"NFD", "NFKD", "Lowercase", "Prepend", "ByteLevel"}
_KEEPING_BEHAVIOURS = {"Isolated", "MergedWithPrevious", "MergedWithNext", "Contiguous"}
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts"}


def _byte_level_alphabet() -> set[str]:
    """The 256 characters byte-level BPE writes bytes as (GPT-2's ``bytes_to_unicode``)."""
    keep = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, extra = [], 0
    for byte in range(256):
        if byte in keep:
            chars.append(chr(byte))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return set(chars)


def _normalizer_shrink(spec: Mapping[str, Any] | None) -> float | None:
    """How many characters of input one normalized character can stand for (None: unbounded,
    the normalizer may delete text)."""
    if spec is None:
        return 1.0
    kind = spec.get("type")
    if kind == "Sequence":
        total = 1.0
        for part in spec.get("normalizers", []):
            shrink = _normalizer_shrink(part)
            if shrink is None:
                return None
            total *= shrink
        return total
    if kind in _COMPOSING:
        return float(NFC_SHRINK)
    if kind in _EXPANDING_OR_NEUTRAL:
        return 1.0
    if kind == "Replace":
        pattern, content = spec.get("pattern") or {}, spec.get("content")
        literal = pattern.get("String") if isinstance(pattern, Mapping) else None
        if (
            not isinstance(literal, str)
            or not literal
            or not isinstance(content, str)
            or not content
        ):
            return None  # a regex or an empty replacement can delete any amount of text
        return max(1.0, len(literal) / len(content))
    return None  # Strip, StripAccents, BertNormalizer, Precompiled, unknown: may delete


def _pre_tokenizer_keeps_text(spec: Mapping[str, Any] | None) -> bool:
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_pre_tokenizer_keeps_text(part) for part in spec.get("pretokenizers", []))
    if kind in _KEEPING_PRE_TOKENIZERS:
        return True
    if kind in ("Split", "Punctuation"):
        return spec.get("behavior") in _KEEPING_BEHAVIOURS
    return False  # Whitespace, WhitespaceSplit, BertPreTokenizer, CharDelimiterSplit, ...


def _uses_byte_level(spec: Mapping[str, Any] | None) -> bool:
    if spec is None:
        return False
    if spec.get("type") == "Sequence":
        return any(_uses_byte_level(part) for part in spec.get("pretokenizers", []))
    return spec.get("type") == "ByteLevel"


@dataclass(frozen=True)
class PromptBound:
    """``min_tokens(text)`` never exceeds the number of tokens ``text`` encodes to."""

    max_chars_per_token: int
    shrink: float  # applies to non-ASCII text only

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer) -> PromptBound | None:
        """The bound for this tokenizer, or None when no sound one is known."""
        try:
            spec = json.loads(tokenizer.backend.to_str())
        except (ValueError, AttributeError):
            return None
        model = spec.get("model") or {}
        if model.get("type") != "BPE" or model.get("dropout"):
            return None
        if any(
            token.get("lstrip") or token.get("rstrip") for token in spec.get("added_tokens") or []
        ):
            return None
        shrink = _normalizer_shrink(spec.get("normalizer"))
        if shrink is None or not _pre_tokenizer_keeps_text(spec.get("pre_tokenizer")):
            return None
        vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
        if not vocab:
            return None
        # every piece of text must map to some token, or it could vanish from the count
        if _uses_byte_level(spec.get("pre_tokenizer")):
            if not _byte_level_alphabet() <= vocab.keys():
                return None
        elif model.get("byte_fallback"):
            if not all(f"<0x{byte:02X}>" in vocab for byte in range(256)):
                return None
        elif model.get("unk_token") is None or model.get("fuse_unk"):
            return None
        return cls(max(len(token) for token in vocab), shrink)

    def min_tokens(self, text: str) -> int:
        chars_per_token = self.max_chars_per_token * (1 if text.isascii() else self.shrink)
        return math.ceil(len(text) / chars_per_token)

    def max_chars(self, max_model_len: int) -> int:
        """Texts longer than this (in characters) cannot fit ``max_model_len`` tokens, ASCII
        or not."""
        return int(max_model_len * self.max_chars_per_token * self.shrink)


def encode_releasing_gil(
    tokenizer: Tokenizer, text: str, add_special_tokens: bool = True
) -> list[int]:
    """``tokenizer.encode(text)``, letting other threads run meanwhile (see the module doc)."""
    if not isinstance(text, str):
        raise TypeError(f"encode expects a str, got {type(text).__name__}")
    return list(
        tokenizer.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
    )
