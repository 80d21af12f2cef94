"""resin/models/phi3 (Phi-3 / Phi-3.5 / Phi-4 / Phi-4-mini, brought up with `resin new-model`)
passes the parity harness on its committed tiny checkpoint and on variants of it, and refuses
what it cannot compute as transformers does.

- The tiny checkpoint (resin/models/phi3/NOTES.md) has partial rotary (0.75: 12 of 16 dims),
  longrope with distinct short / long factor lists and a derived cos/sin scale (factor 32:
  1.19), a sliding window narrower than the parity prompts, GQA and tied embeddings.
- fp32: every stage; bf16: the layers stage bit-exact.
- Variants (the tiny's weights, another config.json): the long factor list in use at every
  position (``original_max_position_embeddings`` 1: position 0 turns by angle 0 under either
  list, so HF and Resin agree at every length), Phi-4's spelling (no window: full-attention
  layers; default rope at another base), and the legacy hub spelling (``rope_scaling`` of type
  ``su``, top-level ``rope_theta`` / ``partial_rotary_factor``).
- longrope switches every position to the long list once a sequence passes the original
  length; a KV cache cannot follow, so ``resin.LLM`` caps max_model_len there and refuses more.

torch runs one thread here (shared 2-core machines).
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from resin.evals.model_ref import import_model_module  # noqa: E402
from tests.model_variants import model_parity, tiny_variant  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO / "resin" / "models" / "phi3"
TINY = MODEL_DIR / "tiny"
variant = partial(tiny_variant, TINY)
parity = partial(model_parity, MODEL_DIR)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def blocks() -> Any:
    return import_model_module(MODEL_DIR, "blocks", "phi3")


def long_factors_everywhere(config: dict[str, Any]) -> None:
    config["original_max_position_embeddings"] = 1
    config["rope_parameters"]["original_max_position_embeddings"] = 1
    config["rope_parameters"]["attention_factor"] = 1.3  # ln(1) = 0: HF's formula divides by it


def test_tiny_checkpoint_exercises_partial_rotary_and_longrope() -> None:
    assert sum(f.stat().st_size for f in TINY.iterdir()) < 2_000_000
    config = json.loads((TINY / "config.json").read_text())
    assert config["architectures"] == ["Phi3ForCausalLM"]
    rope = config["rope_parameters"]
    assert rope["rope_type"] == "longrope" and config["partial_rotary_factor"] == 0.75
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    assert len(rope["short_factor"]) == len(rope["long_factor"]) == int(head_dim * 0.75) // 2
    assert len(set(rope["short_factor"])) > 1 and rope["short_factor"] != rope["long_factor"]
    assert config["max_position_embeddings"] > config["original_max_position_embeddings"] > 78
    assert config["sliding_window"] < 70  # the longest parity prompt
    assert config["num_key_value_heads"] < config["num_attention_heads"]
    from safetensors.torch import load_file

    assert "lm_head.weight" not in load_file(str(TINY / "model.safetensors"))


def test_parity_fp32_every_stage() -> None:
    report = parity()
    assert report.passed, report.summary()
    assert {s.name for s in report.stages} >= {
        "layers",
        "logits",
        "greedy/page_size=1",
        "greedy/chunked_prefill",
        "greedy/prefix_cache",
        "greedy/preemption",
    }
    assert report.stage("layers").metrics["max_scaled_diff"] < 1e-6


def test_parity_bf16_layers_bit_exact() -> None:
    report = parity(dtype="bfloat16", layers_only=True)
    assert report.passed, report.summary()
    assert report.stage("layers").metrics["max_scaled_diff"] == 0.0
    assert report.stage("logits").metrics["scaled_diff"] == 0.0


def test_parity_with_the_long_factor_list(tmp_path: Path) -> None:
    report = parity(variant(tmp_path, long_factors_everywhere))
    assert report.passed, report.summary()


@pytest.mark.parametrize("spelling", ["phi4_no_window_default_rope", "legacy_su_rope_scaling"])
def test_parity_other_config_spellings(tmp_path: Path, spelling: str) -> None:
    def edit(config: dict[str, Any]) -> None:
        rope = config.pop("rope_parameters")
        if spelling == "phi4_no_window_default_rope":
            config.update(sliding_window=None, rope_theta=250000.0, rope_scaling=None)
        else:  # Phi-3.5 / Phi-4-mini on the hub: rope_scaling, rope_theta, a top-level factor
            config.update(
                rope_theta=10000.0,
                rope_scaling={
                    "type": "su",
                    "short_factor": rope["short_factor"],
                    "long_factor": rope["long_factor"],
                },
            )

    report = parity(variant(tmp_path, edit), layers_only=True)
    assert report.passed, report.summary()


def test_rotary_is_hf_per_forward_rule(blocks: Any, tmp_path: Path) -> None:
    """HF picks one factor list per forward (long iff max position + 1 > original): a one-token
    step at position p — what a cache feeds it — gets the list Resin's table gives p; a whole
    sequence past the original length turns every position long, which the table does not."""
    import transformers

    def short_original(config: dict[str, Any]) -> None:
        config["original_max_position_embeddings"] = 8
        config["rope_parameters"]["original_max_position_embeddings"] = 8

    checkpoint = variant(tmp_path, short_original)
    config = transformers.AutoConfig.from_pretrained(checkpoint)
    hf = transformers.models.phi3.modeling_phi3.Phi3RotaryEmbedding(config)
    args = json.loads((checkpoint / "config.json").read_text())
    from resin.runners.torch.model_dir import ModelArgs

    table = blocks.phi3_rotary_embedding(ModelArgs(**args), 16, torch.device("cpu"))
    x = torch.zeros(1, dtype=torch.float32)
    for p in (0, 5, 7, 8, 9, 30):
        hf_cos, hf_sin = hf(x, torch.tensor([[p]]))
        cos, sin = table.cos_sin(torch.tensor([p]), torch.float32)
        assert torch.equal(cos, hf_cos[0]) and torch.equal(sin, hf_sin[0]), p
    positions = torch.arange(12)
    hf_cos, _ = hf(x, positions[None])
    cos, _ = table.cos_sin(positions, torch.float32)
    assert torch.equal(cos[8:], hf_cos[0, 8:]) and not torch.equal(cos[1:8], hf_cos[0, 1:8])


def test_llm_caps_max_model_len_at_the_original_length(tmp_path: Path) -> None:
    import resin
    from resin.loading.fields import ConfigError

    def original_64(config: dict[str, Any]) -> None:
        config["original_max_position_embeddings"] = 64
        config["rope_parameters"]["original_max_position_embeddings"] = 64

    checkpoint = variant(tmp_path, original_64)
    llm = resin.LLM(checkpoint)
    assert llm.engine.config.max_model_len == 64
    with pytest.raises(
        ConfigError,
        match=r"max_model_len 65 is past 64: rope type 'longrope': past "
        r"original_max_position_embeddings 64 .*'long_factor'",
    ):
        resin.LLM(checkpoint, max_model_len=65)


@pytest.mark.parametrize(
    ("rope", "message"),
    [
        ({"rope_type": "dynamic", "factor": 2.0}, "rope type 'dynamic' is not supported"),
        ({"short_factor": [1.0, 2.0]}, "rope longrope: 'short_factor' must list 6 numbers"),
        ({"original_max_position_embeddings": 1}, "rope longrope: no 'attention_factor' given"),
    ],
)
def test_unsupported_rope_is_refused_at_load(
    tmp_path: Path, rope: dict[str, Any], message: str
) -> None:
    from resin.registry import ModelRegistry

    def edit(config: dict[str, Any]) -> None:
        config["rope_parameters"].update(rope)
        if "original_max_position_embeddings" in rope:  # the top-level one wins in HF
            config["original_max_position_embeddings"] = rope["original_max_position_embeddings"]

    checkpoint = variant(tmp_path, edit)
    entry = ModelRegistry(use_cwd=False, use_env=False).for_checkpoint(checkpoint)
    with pytest.raises(ValueError, match=f"phi3: {message}"):
        entry.load_runner(checkpoint)


def test_scaffold_sizes_longrope_lists_and_records_both_window_kinds() -> None:
    """What `resin new-model --tiny` needed for Phi-3: factor lists resampled to the tiny head
    (HF refuses the source's 48 for 6 rotated pairs), and both layer kinds recorded, since a
    config's ``sliding_window`` alone decides whether its layers slide."""
    from resin.runners.torch.model_dir import ModelRecord
    from resin.scaffold.tiny_checkpoint import tiny_config

    source = json.loads((MODEL_DIR / "source" / "config.json").read_text())
    rope = tiny_config(MODEL_DIR / "source" / "config.json").rope_parameters
    for key in ("short_factor", "long_factor"):
        assert len(rope[key]) == 6
        assert rope[key][0] == source["rope_scaling"][key][0]
        assert rope[key][-1] == source["rope_scaling"][key][-1]
    record = ModelRecord.load(MODEL_DIR)
    assert set(record.layer_kinds) == {"sliding_attention/dense", "full_attention/dense"}
    assert record.windowed_layer_types == ["sliding_attention"]
