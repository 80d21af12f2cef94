"""``resin.tokenizer``: encode/decode equal transformers' on the same files; EOS ids and sampling
defaults from the config files; the incremental detokenizer never emits a broken character and
its deltas add up to ``decode(all ids)``.

The checkpoints are tiny tokenizers trained here with the ``tokenizers`` library (byte-level BPE
like Llama-3 / Qwen, and a Metaspace + byte-fallback BPE like Llama-2 / Mistral / Gemma), saved
as ``tokenizer.json`` + ``tokenizer_config.json`` so Resin and
``transformers.AutoTokenizer.from_pretrained`` read the same files. ``write_checkpoint`` is also
used by ``test_chat_template.py``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

from resin.tokenizer import REPLACEMENT_CHAR, Tokenizer

CORPUS = [
    "hello world, this is a small test of the tokenizer",
    "the quick brown fox jumps over the lazy dog",
    "def main():\n    return 42\n",
    "You are a helpful assistant. What is the weather like today?",
] * 20
SPECIAL_TOKENS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|eot_id|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|python_tag|>",
    "<|eom_id|>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<s>",
    "</s>",
    "<|endoftext|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
]
TEXTS = [
    "hello world",
    "  leading and trailing spaces  ",
    "héllo wörld — naïve café",
    "emoji 😀👍🏽 and a family 👨‍👩‍👧",
    "中文分词测试，日本語のテキスト、한국어",
    "tabs\tand\nnewlines\r\n",
    "<|im_start|>user\nhi<|im_end|>\n<|eot_id|>",
    "",
]


def _byte_level_backend() -> BackendTokenizer:
    tok = BackendTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    bos_id = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A",
        pair="<|begin_of_text|> $A $B",
        special_tokens=[("<|begin_of_text|>", bos_id)],
    )
    return tok


def _metaspace_backend() -> BackendTokenizer:
    """Llama-2-style: Metaspace "▁", byte fallback <0xXX> tokens, Replace/ByteFallback/Fuse/Strip."""
    tok = BackendTokenizer(models.BPE())
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(CORPUS, trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):  # byte-fallback tokens, as SentencePiece conversions have
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    spec["model"].update(byte_fallback=True, unk_token="<unk>", fuse_unk=True)
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": "<s>", "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
        ],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<s>": {"id": "<s>", "ids": [vocab["<s>"]], "tokens": ["<s>"]}},
    }
    return BackendTokenizer.from_str(json.dumps(spec))


_BACKENDS: dict[str, str] = {}


def write_checkpoint(
    directory: Path,
    tokenizer_config: dict[str, Any],
    *,
    kind: str = "byte_level",
    generation_config: dict[str, Any] | None = None,
    model_config: dict[str, Any] | None = None,
) -> Path:
    """Write tokenizer.json (trained once per kind) and the given JSON configs into ``directory``."""
    if kind not in _BACKENDS:
        backend = _byte_level_backend() if kind == "byte_level" else _metaspace_backend()
        _BACKENDS[kind] = backend.to_str()
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(_BACKENDS[kind], encoding="utf-8")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **tokenizer_config}
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    for name, value in (
        ("generation_config.json", generation_config),
        ("config.json", model_config),
    ):
        if value is not None:
            (directory / name).write_text(json.dumps(value), encoding="utf-8")
    return directory


def hf_tokenizer(directory: Path) -> Any:
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(directory))


LLAMA3_CONFIG = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
LLAMA2_CONFIG = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}


@pytest.fixture(params=["byte_level", "metaspace"])
def checkpoint(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    config = LLAMA3_CONFIG if request.param == "byte_level" else LLAMA2_CONFIG
    return write_checkpoint(tmp_path / request.param, config, kind=request.param)


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_decode_match_transformers(checkpoint: Path, add_special_tokens: bool) -> None:
    ours, theirs = Tokenizer.from_pretrained(checkpoint), hf_tokenizer(checkpoint)
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=add_special_tokens)
        assert ids == theirs.encode(text, add_special_tokens=add_special_tokens), text
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
                ids, skip_special_tokens=skip
            ), (text, skip)


def test_token_bytes_join_back_into_the_text(tmp_path: Path) -> None:
    """A byte-level BPE's tokens each stand for their own bytes, a character split over several
    tokens included (its pieces decode to U+FFFD alone): joined, they are the text's UTF-8."""
    tokenizer = Tokenizer.from_pretrained(
        write_checkpoint(tmp_path, LLAMA3_CONFIG, kind="byte_level")
    )
    num_partial = 0
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        pieces = [tokenizer.token_bytes(i) for i in ids]
        num_partial += sum(tokenizer.decode([i]) == "\ufffd" for i in ids)
        assert b"".join(pieces) == tokenizer.decode(ids).encode(), text
    assert num_partial > 0  # the texts split characters over tokens


def test_vocab_and_special_tokens_match_transformers(checkpoint: Path) -> None:
    ours, theirs = Tokenizer.from_pretrained(checkpoint), hf_tokenizer(checkpoint)
    assert ours.vocab_size == len(theirs)
    assert ours.base_vocab_size == theirs.vocab_size
    assert ours.special_tokens_map == theirs.special_tokens_map
    assert (ours.bos_token_id, ours.eos_token_id) == (theirs.bos_token_id, theirs.eos_token_id)
    assert ours.bos_token_id is not None and ours.eos_token_id is not None
    assert set(ours.all_special_ids) >= set(theirs.all_special_ids)


def test_special_token_missing_from_tokenizer_json_is_added(tmp_path: Path) -> None:
    """A config names tokens tokenizer.json lacks: transformers adds them as special; so do we."""
    config = {
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|new_eos|>",
        "pad_token": {
            "__type": "AddedToken",
            "content": "<|pad|>",
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "single_word": False,
            "special": True,
        },
        "image_token": "<|image|>",
        "extra_special_tokens": ["<|extra_0|>"],
    }
    directory = write_checkpoint(tmp_path / "ckpt", config)
    ours, theirs = Tokenizer.from_pretrained(directory), hf_tokenizer(directory)
    assert ours.special_tokens_map == theirs.special_tokens_map
    assert ours.special_tokens_map["image_token"] == "<|image|>"
    assert ours.vocab_size == len(theirs)
    for name in ("eos_token_id", "pad_token_id"):
        assert getattr(ours, name) == getattr(theirs, name) is not None
    text = "a<|new_eos|>b<|pad|><|image|><|extra_0|>c"
    ids = ours.encode(text)
    assert ids == theirs.encode(text)
    for skip in (False, True):
        assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
            ids, skip_special_tokens=skip
        )


def test_eos_ids_merge_tokenizer_generation_config_and_config(tmp_path: Path) -> None:
    probe = Tokenizer.from_pretrained(write_checkpoint(tmp_path / "probe", LLAMA3_CONFIG))
    eot, end = probe.token_to_id("<|eot_id|>"), probe.token_to_id("<|end_of_text|>")
    eom = probe.token_to_id("<|eom_id|>")
    both = write_checkpoint(
        tmp_path / "both",
        LLAMA3_CONFIG,
        generation_config={"eos_token_id": [end, eom, eot]},
        model_config={"eos_token_id": 7},
    )
    assert Tokenizer.from_pretrained(both).eos_token_ids == [eot, end, eom]
    # No generation config: config.json's eos (also nested under text_config) is the fallback.
    only_config = write_checkpoint(
        tmp_path / "cfg", LLAMA3_CONFIG, model_config={"text_config": {"eos_token_id": end}}
    )
    assert Tokenizer.from_pretrained(only_config).eos_token_ids == [eot, end]
    bare = write_checkpoint(tmp_path / "bare", {"bos_token": "<|begin_of_text|>"})
    assert Tokenizer.from_pretrained(bare).eos_token_ids == []
    bad = write_checkpoint(tmp_path / "bad", LLAMA3_CONFIG, generation_config={"eos_token_id": "x"})
    with pytest.raises(ValueError, match="eos_token_id"):
        _ = Tokenizer.from_pretrained(bad).eos_token_ids


def test_sampling_defaults_follow_vllm_diff_rule(tmp_path: Path) -> None:
    generation = {
        "do_sample": True,
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 50,
        "repetition_penalty": 1.0,
        "max_new_tokens": 256,
        "min_p": 0.05,
    }
    directory = write_checkpoint(tmp_path / "gen", LLAMA3_CONFIG, generation_config=generation)
    # top_k 50 and repetition_penalty 1.0 are transformers' defaults, so vLLM does not apply them.
    assert Tokenizer.from_pretrained(directory).sampling_defaults == {
        "temperature": 0.6,
        "top_p": 0.95,
        "min_p": 0.05,
        "max_tokens": 256,
    }
    plain = write_checkpoint(tmp_path / "plain", LLAMA3_CONFIG)
    assert Tokenizer.from_pretrained(plain).sampling_defaults == {}


def test_missing_or_bad_files_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Tokenizer.from_pretrained(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path / "empty")
    directory = write_checkpoint(tmp_path / "ckpt", LLAMA3_CONFIG)
    (directory / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="generation_config.json"):
        Tokenizer.from_pretrained(directory)


# -- incremental detokenizer -------------------------------------------------------------------

STREAM_TEXTS = [
    "emoji 😀👍🏽 split into bytes, a family 👨‍👩‍👧 and flags 🇯🇵",
    "中文分词测试，日本語のテキスト、한국어 mixed with english words",
    "héllo wörld — naïve café ✓ ∑ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "  spaces   and\nnewlines\n\n  def main():\n    return 42",
]


def _stream(
    tokenizer: Tokenizer, ids: list[int], chunk_sizes: list[int], skip_special_tokens: bool = True
) -> list[str]:
    detok = tokenizer.incremental_detokenizer(skip_special_tokens=skip_special_tokens)
    deltas, start = [], 0
    for size in chunk_sizes:
        deltas.append(detok.add_tokens(ids[start : start + size]))
        start += size
    assert start == len(ids)
    deltas.append(detok.finish())
    assert detok.text == "".join(deltas)
    assert detok.output_token_ids == ids
    return deltas


def test_multibyte_characters_really_split_across_tokens(checkpoint: Path) -> None:
    """Guard for the tests below: some token decodes alone to U+FFFD (half a character)."""
    tokenizer = Tokenizer.from_pretrained(checkpoint)
    ids = tokenizer.encode(STREAM_TEXTS[0], add_special_tokens=False)
    assert any(REPLACEMENT_CHAR in tokenizer.decode([i]) for i in ids)


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_token_by_token_deltas_are_whole_characters(checkpoint: Path, text: str) -> None:
    tokenizer = Tokenizer.from_pretrained(checkpoint)
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas = _stream(tokenizer, ids, [1] * len(ids))
    detok = tokenizer.incremental_detokenizer()
    for i in ids:
        detok.add_tokens([i])
        # the decode window stays a few tokens wide: the work per token does not grow
        assert (
            detok.read_offset - detok.prefix_offset <= 4
            and len(detok._token_ids) - detok.prefix_offset <= 8
        )
    assert all(REPLACEMENT_CHAR not in delta for delta in deltas)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
    assert "".join(deltas) == hf_tokenizer(checkpoint).decode(ids, skip_special_tokens=True)


def test_random_chunks_and_special_tokens(checkpoint: Path) -> None:
    """Several tokens per step (accepted drafts) and special tokens, kept or skipped."""
    tokenizer = Tokenizer.from_pretrained(checkpoint)
    rng = random.Random(1234)
    eos = [tokenizer.eos_token_id or 0]
    for trial in range(40):
        pieces = [
            tokenizer.encode(rng.choice(STREAM_TEXTS), add_special_tokens=False),
            eos,
            tokenizer.encode(rng.choice(STREAM_TEXTS)[: rng.randint(1, 30)], False),
        ]
        ids = [i for piece in pieces for i in piece]
        chunks = []
        while sum(chunks) < len(ids):
            chunks.append(min(rng.randint(0, 4), len(ids) - sum(chunks)))
        for skip in (True, False):
            deltas = _stream(tokenizer, ids, chunks, skip_special_tokens=skip)
            full = tokenizer.decode(ids, skip_special_tokens=skip)
            assert "".join(deltas) == full, trial
            if REPLACEMENT_CHAR not in full:
                assert all(REPLACEMENT_CHAR not in d for d in deltas), trial


def test_stream_that_stops_mid_character_flushes_like_decode(checkpoint: Path) -> None:
    tokenizer = Tokenizer.from_pretrained(checkpoint)
    ids = tokenizer.encode("ok 😀", add_special_tokens=False)
    truncated = ids[:-1]  # the emoji's last byte never comes
    assert tokenizer.decode(truncated).endswith(REPLACEMENT_CHAR)
    detok = tokenizer.incremental_detokenizer()
    streamed = "".join(detok.add_tokens([i]) for i in truncated)
    assert REPLACEMENT_CHAR not in streamed  # held back while the character might complete
    assert streamed + detok.finish() == tokenizer.decode(truncated)
    assert detok.finish() == ""
    with pytest.raises(RuntimeError, match="after finish"):
        detok.add_tokens([1])


def test_prompt_context_keeps_the_first_tokens_spacing(checkpoint: Path) -> None:
    """With the prompt as context the output reads as it does inside the whole sequence."""
    tokenizer = Tokenizer.from_pretrained(checkpoint)
    prompt = tokenizer.encode("hello world, this is", add_special_tokens=True)
    output = tokenizer.encode(" a small test 😀 中文", add_special_tokens=False)
    detok = tokenizer.incremental_detokenizer(prompt_token_ids=prompt)
    deltas = [detok.add_tokens([i]) for i in output] + [detok.finish()]
    whole = tokenizer.decode(prompt + output, skip_special_tokens=True)
    assert "".join(deltas) == whole[len(tokenizer.decode(prompt, skip_special_tokens=True)) :]
    assert all(REPLACEMENT_CHAR not in d for d in deltas)


def test_legacy_special_tokens_map_json_matches_transformers(tmp_path: Path) -> None:
    directory = write_checkpoint(
        tmp_path / "legacy", {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}
    )
    legacy = {
        "eos_token": {
            "content": "<|eot_id|>",
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "single_word": False,
        },
        "pad_token": "<|endoftext|>",
    }
    (directory / "special_tokens_map.json").write_text(json.dumps(legacy), encoding="utf-8")
    ours, theirs = Tokenizer.from_pretrained(directory), hf_tokenizer(directory)
    assert ours.special_tokens_map == theirs.special_tokens_map
    assert ours.eos_token == "<|eot_id|>" and ours.eos_token_id == theirs.eos_token_id
