"""Tokenizer of a Hugging Face checkpoint directory, and per-request incremental detokenization.

This module owns turning text into token ids and back for one checkpoint, with the same results
as ``transformers.AutoTokenizer.from_pretrained(model_dir)`` for ``tokenizer.json`` checkpoints:

- ``Tokenizer`` loads ``tokenizer.json`` with the ``tokenizers`` library and the special tokens
  from ``tokenizer_config.json`` (plus the legacy ``special_tokens_map.json``), adding to the
  backend, as special, any named special token it lacks (as transformers' ``_post_init`` does).
  ``encode`` / ``decode`` match transformers' ``encode`` / ``decode`` on the same files.
- ``eos_token_ids`` merges the tokenizer's EOS with ``generation_config.json``'s ``eos_token_id``
  (falling back to ``config.json``'s when the generation config names none), as vLLM does.
  ``sampling_defaults`` are the ``generation_config.json`` fields vLLM takes as request defaults.
- ``IncrementalDetokenizer`` turns one request's stream of token ids into text deltas. It never
  emits a delta ending in U+FFFD (an incomplete multi-byte character), holding those bytes back
  until the character completes, with vLLM's prefix/read offsets. After ``finish()``, ``text``
  equals ``tokenizer.decode(output_token_ids)`` for decoders that decode a sequence as the
  concatenation of its pieces (ByteLevel, Metaspace, ByteFallback+Fuse — every LLM tokenizer we
  know of).

It imports only ``tokenizers``, ``json`` and the standard library — never ``transformers``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as BackendTokenizer

# transformers' SPECIAL_TOKENS_ATTRIBUTES (tokenization_utils_base.py), in its order.
NAMED_SPECIAL_TOKENS: tuple[str, ...] = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
REPLACEMENT_CHAR = "\ufffd"
# generation_config.json field -> resin.SamplingParams field; the values transformers'
# GenerationConfig() has by default, which vLLM's to_diff_dict() leaves out.
SAMPLING_FIELDS: dict[str, str] = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
GENERATION_CONFIG_DEFAULTS: dict[str, Any] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 50,
    "repetition_penalty": 1.0,
}


def _gpt2_byte_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character each byte is written as in a
    byte-level BPE vocabulary, inverted (character -> byte)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


_BYTE_OF_CHAR = _gpt2_byte_table()
_BYTE_FALLBACK = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def read_json_file(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``; None when the file does not exist; ValueError naming it if bad."""
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def token_content(value: Any) -> str | None:
    """A special-token entry's text: a string, or an AddedToken dict ``{"content": ...}``."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _as_token_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        return list(value)
    raise ValueError(f"eos_token_id must be an int or a list of ints, got {value!r}")


def _added_token(value: Any, content: str) -> AddedToken:
    """An AddedToken for a config entry: a dict keeps its flags; a string is special, unnormalized."""
    if isinstance(value, Mapping):
        flags = {
            k: value[k]
            for k in ("single_word", "lstrip", "rstrip", "normalized", "special")
            if k in value
        }
        flags.setdefault("special", True)
        return AddedToken(content, **flags)
    return AddedToken(content, special=True, normalized=False)


class Tokenizer:
    """The checkpoint's tokenizer: ``encode``, ``decode``, special tokens, EOS ids, defaults.

    Build with ``Tokenizer.from_pretrained(model_dir)``. ``special_tokens_map`` is the same
    ``{name: text}`` mapping transformers passes to chat templates (``bos_token``, ``eos_token``,
    ... and model-specific ``*_token`` entries of ``tokenizer_config.json``).
    """

    def __init__(
        self,
        backend: BackendTokenizer,
        tokenizer_config: Mapping[str, Any],
        generation_config: Mapping[str, Any] | None = None,
        model_config: Mapping[str, Any] | None = None,
    ) -> None:
        self.backend = backend
        self.tokenizer_config: dict[str, Any] = dict(tokenizer_config)
        self.generation_config: dict[str, Any] = dict(generation_config or {})
        self.model_config: dict[str, Any] = dict(model_config or {})
        self._raw_special_tokens = self._collect_special_tokens()
        self.special_tokens_map: dict[str, str] = {}
        for name, value in self._raw_special_tokens.items():
            content = token_content(value)
            if content is not None:
                self.special_tokens_map[name] = content
        self._add_missing_special_tokens()
        self.clean_up_tokenization_spaces = bool(
            self.tokenizer_config.get("clean_up_tokenization_spaces", False)
        )
        self._is_bpe = type(backend.model).__name__ == "BPE"
        self._byte_level = "ByteLevel" in repr(backend.decoder)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` (required) and the optional config files of ``model_dir``."""
        root = Path(model_dir)
        if not root.is_dir():
            raise FileNotFoundError(f"model directory {root} does not exist")
        tokenizer_file = root / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"{tokenizer_file} not found: Resin loads tokenizers from tokenizer.json only "
                "(convert a slow/SentencePiece tokenizer with transformers and save_pretrained)"
            )
        try:
            backend = BackendTokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the Rust side raises a bare Exception
            raise ValueError(
                f"{tokenizer_file}: cannot be loaded by the tokenizers library ({exc})"
            ) from exc
        config = read_json_file(root / "tokenizer_config.json") or {}
        legacy_map = read_json_file(root / "special_tokens_map.json")
        if legacy_map and "added_tokens_decoder" not in config:
            # transformers reads the legacy map only without added_tokens_decoder, and its
            # entries then override tokenizer_config.json's (from_pretrained, "Legacy" branch).
            config = {**config, **legacy_map}
        return cls(
            backend,
            config,
            read_json_file(root / "generation_config.json"),
            read_json_file(root / "config.json"),
        )

    def _collect_special_tokens(self) -> dict[str, Any]:
        """Named special tokens as transformers keeps them (``PreTrainedTokenizerBase.__init__``)."""
        config = self.tokenizer_config
        tokens: dict[str, Any] = {
            name: config[name] for name in NAMED_SPECIAL_TOKENS if config.get(name) is not None
        }
        # Any other "*_token" string entry is a model-specific special token (e.g. image_token).
        for name, value in config.items():
            if (
                name.endswith("_token")
                and name not in NAMED_SPECIAL_TOKENS
                and token_content(value) is not None
            ):
                tokens[name] = value
        extra = config.get("extra_special_tokens", config.get("additional_special_tokens"))
        if isinstance(extra, Mapping):
            tokens.update({name: value for name, value in extra.items() if value is not None})
        padding = self.backend.padding
        if "pad_token" not in tokens and padding and padding.get("pad_token"):
            tokens["pad_token"] = padding["pad_token"]  # transformers takes it from tokenizer.json
        return tokens

    def _add_missing_special_tokens(self) -> None:
        """Register named and extra special tokens with the backend, as transformers' _post_init."""
        existing = {tok.content: tok for tok in self.backend.get_added_tokens_decoder().values()}
        to_add: list[AddedToken] = []
        entries: list[tuple[Any, str]] = [
            (v, self.special_tokens_map[k])
            for k, v in self._raw_special_tokens.items()
            if k in self.special_tokens_map
        ]
        extra = self.tokenizer_config.get(
            "extra_special_tokens", self.tokenizer_config.get("additional_special_tokens")
        )
        if isinstance(extra, list):
            entries += [(v, c) for v in extra if (c := token_content(v)) is not None]
        for value, content in entries:
            # An entry already in tokenizer.json keeps its own flags, as added_tokens_map does.
            token = existing.get(content) or _added_token(value, content)
            if not token.special or content not in existing:
                to_add.append(token)
        if to_add:
            self.backend.add_special_tokens(to_add)

    # -- vocabulary -------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (``len(hf_tokenizer)``)."""
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    @property
    def base_vocab_size(self) -> int:
        """Base vocabulary without added tokens (transformers' ``tokenizer.vocab_size``)."""
        return int(self.backend.get_vocab_size(with_added_tokens=False))

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def _special_id(self, name: str) -> int | None:
        content = self.special_tokens_map.get(name)
        return None if content is None else self.backend.token_to_id(content)

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens_map.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens_map.get("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._special_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._special_id("pad_token")

    @property
    def all_special_ids(self) -> list[int]:
        """Ids of all tokens the backend marks special (what ``skip_special_tokens`` drops)."""
        return sorted(
            i for i, tok in self.backend.get_added_tokens_decoder().items() if tok.special
        )

    @property
    def eos_token_ids(self) -> list[int]:
        """Every id that ends generation: the tokenizer's EOS first, then ``generation_config.json``'s
        ``eos_token_id`` (int or list), or ``config.json``'s (also under ``text_config``) when the
        generation config has none — vLLM's rule (tokenizer EOS + generation-config stop ids)."""
        ids: list[int] = []
        if self.eos_token_id is not None:
            ids.append(self.eos_token_id)
        from_generation = _as_token_ids(self.generation_config.get("eos_token_id"))
        if not from_generation:
            text_config = self.model_config.get("text_config") or {}
            from_generation = _as_token_ids(
                self.model_config.get(
                    "eos_token_id",
                    text_config.get("eos_token_id") if isinstance(text_config, dict) else None,
                )
            )
        ids += from_generation
        return list(dict.fromkeys(ids))

    @property
    def sampling_defaults(self) -> dict[str, float | int]:
        """``generation_config.json`` sampling fields that differ from transformers' defaults, keyed
        by ``resin.SamplingParams`` names (``max_new_tokens`` -> ``max_tokens``), as vLLM applies
        them (``get_diff_sampling_param``). Empty when there is no generation config."""
        defaults: dict[str, float | int] = {}
        for source, target in SAMPLING_FIELDS.items():
            value = self.generation_config.get(source)
            if value is None or GENERATION_CONFIG_DEFAULTS.get(source) == value:
                continue
            defaults[target] = value
        return defaults

    # -- text <-> ids ------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` applies tokenizer.json's post-processor
        (e.g. a BOS), exactly like transformers' ``encode``."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of ``token_ids``; ``skip_special_tokens`` drops tokens marked special."""
        return self.decode_ints([int(i) for i in token_ids], skip_special_tokens)

    def decode_ints(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        """``decode`` for a list of Python ints (no conversion: the detokenizer's hot path)."""
        text = self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)
        if self.clean_up_tokenization_spaces and not self._is_bpe:
            # transformers applies this cleanup to non-BPE models only (TokenizersBackend._decode).
            for before, after in (
                (" .", "."),
                (" ?", "?"),
                (" !", "!"),
                (" ,", ","),
                (" ' ", "'"),
                (" n't", "n't"),
                (" 'm", "'m"),
                (" 's", "'s"),
                (" 've", "'ve"),
                (" 're", "'re"),
            ):
                text = text.replace(before, after)
        return text

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, even where they are not UTF-8 on their own (a
        token holding part of a character, whose text decodes to U+FFFD): a byte-level BPE
        token's characters mapped back through GPT-2's byte table, a byte-fallback piece
        ``<0xHH>`` its byte; any other token its text's UTF-8 (OpenAI's logprob ``bytes``)."""
        text = self.decode_ints([token_id])
        if "\ufffd" not in text:
            return text.encode()
        piece = self.backend.id_to_token(token_id) or ""
        if _BYTE_FALLBACK.fullmatch(piece):
            return bytes([int(piece[3:5], 16)])
        if self._byte_level and piece and all(c in _BYTE_OF_CHAR for c in piece):
            return bytes(_BYTE_OF_CHAR[c] for c in piece)
        return text.encode()

    def incremental_detokenizer(
        self, prompt_token_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> IncrementalDetokenizer:
        """A fresh detokenizer for one request (see ``IncrementalDetokenizer``)."""
        return IncrementalDetokenizer(self, prompt_token_ids, skip_special_tokens)


class IncrementalDetokenizer:
    """Streams one request's output tokens into text deltas that are always whole characters.

    The text is decoded over a sliding window ``token_ids[prefix_offset:]``; the part already
    emitted is ``decode(token_ids[prefix_offset:read_offset])``, so a new delta is the rest of the
    window's text. A window whose text ends in U+FFFD (bytes of a character still to come) emits
    nothing and keeps its offsets; so does one that adds no text (a skipped special token).

    ``prompt_token_ids`` give the first output token its context (e.g. the space a Metaspace
    decoder strips at the start of a string): the window starts up to 5 tokens back in the
    prompt, as vLLM's ``INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET``.

    Usage: ``detok = tokenizer.incremental_detokenizer()``, then ``detok.add_tokens(new_ids)``
    each step and ``detok.finish()`` at the end; the deltas joined equal ``tokenizer.decode(ids)``.
    """

    CONTEXT_TOKENS_FROM_PROMPT = 5

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        num_context_tokens = min(len(prompt_token_ids), self.CONTEXT_TOKENS_FROM_PROMPT)
        # token_ids = the prompt's last few tokens (context only) + every output token so far
        self._token_ids: list[int] = [
            int(i) for i in prompt_token_ids[len(prompt_token_ids) - num_context_tokens :]
        ]
        self._num_context_tokens = num_context_tokens
        self.prefix_offset = 0
        self.read_offset = num_context_tokens
        self._prefix_text = self._decode(0, self.read_offset)
        self.text = ""
        self.finished = False

    @property
    def output_token_ids(self) -> list[int]:
        """The output tokens fed so far (without the prompt context)."""
        return self._token_ids[self._num_context_tokens :]

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode_ints(self._token_ids[start:end], self.skip_special_tokens)

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        """Feed new output token ids (one, or several when drafts were accepted); return the
        new text, possibly ``""`` while a multi-byte character is incomplete."""
        if self.finished:
            raise RuntimeError("IncrementalDetokenizer.add_tokens after finish()")
        self._token_ids.extend(int(i) for i in token_ids)
        if not token_ids:
            return ""
        window_text = self._decode(self.prefix_offset)
        if len(window_text) <= len(self._prefix_text) or window_text.endswith(REPLACEMENT_CHAR):
            return ""
        return self._emit(window_text)

    def _emit(self, window_text: str) -> str:
        delta = window_text[len(self._prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self._token_ids)
        self._prefix_text = self._decode(self.prefix_offset, self.read_offset)
        self.text += delta
        return delta

    def finish(self) -> str:
        """End of the stream: return the held-back text (a trailing U+FFFD stays if the model
        really stopped mid-character, exactly as ``decode`` shows it). Idempotent."""
        if self.finished:
            return ""
        self.finished = True
        window_text = self._decode(self.prefix_offset)
        if len(window_text) <= len(self._prefix_text):
            return ""
        return self._emit(window_text)
