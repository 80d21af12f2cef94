"""resin/models/olmo3 (OLMo 3 7B / 32B, brought up with `resin new-model`; OLMo 2's blocks
reused by import) passes the parity harness on its committed tiny checkpoint and on variants of
it, and the harness would catch it if OLMo 3's own math were wrong.

- The tiny checkpoint (resin/models/olmo3/NOTES.md; made from Olmo-3-1125-32B's config) has
  three sliding layers and one full one (OLMo 3's pattern) with a window (32) narrower than the
  parity prompts (48 and 70 tokens); YaRN x8 with attention factor 1.208 on the full layer
  only, at a rope base (2e6) other than the sliding layers' (5e5); GQA (4 query / 2 KV heads);
  randomised norm weights; an untied ``lm_head``.
- fp32: every stage; bf16: the layers bit-exact (fp32 cos/sin tables from transformers' own
  fp32 frequencies, checked bit for bit against ``Olmo3RotaryEmbedding``).
- Planted bugs: the window ignored (or one token off) fails at layer 0 self_attn; the full
  layers' YaRN table on every layer fails at layer 0 self_attn, the sliding layers' default
  table on every layer (YaRN dropped) at layer 3 self_attn; rope tables cast to the model dtype
  are no longer bit-exact in bf16.
- Variants (another config.json, the tiny's weights or some of them redrawn): the hub spelling
  (no ``layer_types``, top-level ``rope_theta`` + ``rope_scaling``), transformers' rule that a
  legacy ``rope_theta`` reaches the full layers only, a sliding rope base of its own, no rope
  scaling, and the 7B shape (as many KV heads as query heads); ``layer_types`` derived as
  ``Olmo3Config`` derives them at the 7B / 32B depths; a legacy ``dynamic`` rope capped at
  ``max_position_embeddings``; ``attention_bias`` refused at load.

torch runs one thread here (shared 2-core machines).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from resin.evals.model_ref import import_model_module  # noqa: E402
from tests.model_variants import model_parity, tiny_variant  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO / "resin" / "models" / "olmo3"
TINY = MODEL_DIR / "tiny"
variant = partial(tiny_variant, TINY)
parity = partial(model_parity, MODEL_DIR)
LONGEST_PROMPT = 70  # resin.evals.parity.DEFAULT_PROMPT_LENS

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def blocks() -> Any:
    return import_model_module(MODEL_DIR, "blocks", "olmo3")


def assert_departs_at(report: Any, layer: int, module: str) -> None:
    assert not report.passed
    first = report.first_departure
    assert first is not None and (first["layer"], first["module"]) == (layer, module), (
        report.summary()
    )
    assert first["scaled_diff"] > 0.01


def test_tiny_checkpoint_is_small_and_cannot_hide_olmo3_bugs() -> None:
    assert sum(f.stat().st_size for f in TINY.iterdir()) < 2_000_000
    config = json.loads((TINY / "config.json").read_text())
    assert config["architectures"] == ["Olmo3ForCausalLM"]
    assert config["layer_types"] == ["sliding_attention"] * 3 + ["full_attention"]
    assert config["sliding_window"] < 48 < LONGEST_PROMPT  # two prompts cross the window
    rope = config["rope_parameters"]
    full, sliding = rope["full_attention"], rope["sliding_attention"]
    assert full["rope_type"] == "yarn" and sliding["rope_type"] == "default"
    assert full["attention_factor"] != 1.0 and full["rope_theta"] != sliding["rope_theta"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    assert 1 < kv_heads < heads and not config["tie_word_embeddings"]
    assert config["rms_norm_eps"] != 1e-5  # Olmo3Config's default
    from safetensors.torch import load_file

    tensors = load_file(str(TINY / "model.safetensors"))
    assert "lm_head.weight" in tensors
    head_dim = config["hidden_size"] // heads
    assert tensors["model.layers.0.self_attn.k_norm.weight"].shape == (kv_heads * head_dim,)
    norms = [t for name, t in tensors.items() if "norm" in name]
    assert norms and all(float((t - 1).abs().max()) > 0.1 for t in norms)


@pytest.mark.parametrize("source", ["tiny", "source"])
def test_rotary_frequencies_are_transformers_own(blocks: Any, source: str) -> None:
    """Each layer type's inverse frequencies and cos/sin scale equal Olmo3RotaryEmbedding's
    bit for bit (default on sliding layers, YaRN on full ones), on the tiny config and on the
    real 32B one (head_dim 128); the shared float64 ones are an ulp off."""
    import numpy as np
    import transformers
    from transformers.models.olmo3.modeling_olmo3 import Olmo3RotaryEmbedding

    from resin.loading.rope import parse_rope_config, rope_inv_freq

    raw = json.loads((MODEL_DIR / source / "config.json").read_text())
    hf = Olmo3RotaryEmbedding(transformers.Olmo3Config.from_dict(raw))
    config = blocks.normalise_config(raw)
    head_dim = raw["hidden_size"] // raw["num_attention_heads"]
    by_type = blocks.rope_parameters_by_type(config)
    assert by_type["full_attention"]["rope_type"] == "yarn"
    assert by_type["sliding_attention"]["rope_type"] == "default"
    tables = blocks.olmo3_rotary_embedding(config, head_dim, torch.device("cpu"))
    for layer_type, params in by_type.items():
        rope = parse_rope_config({"rope_parameters": params}, 5e5, raw["max_position_embeddings"])
        table = tables[layer_type].table
        expected = getattr(hf, f"{layer_type}_inv_freq")
        assert torch.equal(table.inv_freq, expected), layer_type
        assert table.attention_scaling == getattr(hf, f"{layer_type}_attention_scaling")
        shared, _ = rope_inv_freq(rope, head_dim)
        assert not torch.equal(torch.from_numpy(shared.astype(np.float32)), expected)


def test_parity_fp32_every_stage() -> None:
    report = parity()
    assert report.passed, report.summary()
    assert {
        "layers",
        "logits",
        "greedy/page_size=1",
        "greedy/chunked_prefill",
        "greedy/prefix_cache",
        "greedy/preemption",
    } <= {s.name for s in report.stages}
    layers = report.stage("layers").metrics
    assert layers["max_scaled_diff"] < 1e-6 and not layers["missing"]
    names = {c["name"] for c in report.layers}
    assert {"layers.3.self_attn", "layers.3.post_feedforward_layernorm"} <= names


def test_parity_bf16_layers_bit_exact() -> None:
    report = parity(dtype="bfloat16", layers_only=True)
    assert report.passed, report.summary()
    assert report.stage("layers").metrics["max_scaled_diff"] == 0.0
    assert report.stage("logits").metrics["scaled_diff"] == 0.0


@pytest.mark.parametrize("wrong_window", [1 << 20, 33], ids=["ignored", "one_too_wide"])
def test_wrong_window_fails_at_self_attn(
    blocks: Any, monkeypatch: pytest.MonkeyPatch, wrong_window: int
) -> None:
    """The sliding layers attending over everything (a window wider than every prompt), or
    one key more than transformers' window, in Resin only (the HF reference keeps 32)."""
    normalise = blocks.normalise_config

    def wrong(config: dict[str, Any]) -> dict[str, Any]:
        return {**normalise(config), "sliding_window": wrong_window}

    monkeypatch.setattr(blocks, "normalise_config", wrong)
    assert_departs_at(parity(layers_only=True), 0, "self_attn")


@pytest.mark.parametrize(
    ("table", "layer"), [("full_attention", 0), ("sliding_attention", 3)], ids=lambda v: str(v)
)
def test_one_rope_table_for_every_layer_fails(
    blocks: Any, monkeypatch: pytest.MonkeyPatch, table: str, layer: int
) -> None:
    """One rotary table for both layer types: YaRN (and the full layers' base) on the sliding
    layers fails at the first sliding layer, the default rope on the full layer (YaRN dropped)
    at the full layer."""
    rotary = blocks.olmo3_rotary_embedding

    def one_table(config: Any, head_dim: int, device: Any) -> Any:
        tables = rotary(config, head_dim, device)
        return {layer_type: tables[table] for layer_type in tables}

    monkeypatch.setitem(blocks.ROTARY, "Olmo3RotaryEmbedding", one_table)
    assert_departs_at(parity(layers_only=True), layer, "self_attn")


def test_rope_tables_in_the_model_dtype_are_not_bit_exact_in_bf16(
    blocks: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Llama's rotary (cos/sin cast to bf16, q/k rotated in bf16) instead of OLMo 3's fp32
    rotation: within bf16's tolerances (a rounding-order bug, as a non-bit-exact kernel's), but
    no longer HF's floats — the layers and logits bit-exactness
    (``test_parity_bf16_layers_bit_exact``) is what catches it."""
    rotary = blocks.olmo3_rotary_embedding

    def model_dtype_tables(config: Any, head_dim: int, device: Any) -> Any:
        return {k: t.table for k, t in rotary(config, head_dim, device).items()}

    monkeypatch.setitem(blocks.ROTARY, "Olmo3RotaryEmbedding", model_dtype_tables)
    report = parity(dtype="bfloat16", layers_only=True)
    assert report.stage("layers").metrics["max_scaled_diff"] > 0.0
    assert report.stage("logits").metrics["scaled_diff"] > 0.0


def hub_spelling(config: dict[str, Any]) -> None:
    """How OLMo 3's hub config.json files spell it (transformers 4.57): top-level
    ``rope_theta`` and a YaRN ``rope_scaling`` (transformers folds it into the full layers'
    entry); here without ``layer_types`` too (Olmo3Config derives 3 sliding : 1 full)."""
    full = config.pop("rope_parameters")["full_attention"]
    config.pop("layer_types")
    config["rope_theta"] = full.pop("rope_theta")
    config["rope_scaling"] = full


def legacy_theta_reaches_full_layers_only(config: dict[str, Any]) -> None:
    """A legacy ``rope_theta`` other than 5e5: Olmo3Config.convert_rope_params_to_dict pops it
    while filling the full layers' entry, so the sliding layers get ``default_theta`` 5e5
    (an implementation reading one base for every layer would give them 1e4; no released
    OLMo 3 differs: all have 5e5)."""
    hub_spelling(config)
    config["rope_theta"] = 10_000.0


def sliding_base_of_its_own(config: dict[str, Any]) -> None:
    """A nested ``rope_parameters`` whose sliding entry has its own base (1e4; the tiny's is
    5e5, Olmo3Config's default, which a block hard-coding it would pass)."""
    config["rope_parameters"]["sliding_attention"]["rope_theta"] = 10_000.0


def no_rope_scaling(config: dict[str, Any]) -> None:
    """Default rope on both layer types (a config without ``rope_scaling``)."""
    config["rope_parameters"]["full_attention"] = {"rope_type": "default", "rope_theta": 2e6}


@pytest.mark.parametrize(
    "edit",
    [
        hub_spelling,
        legacy_theta_reaches_full_layers_only,
        sliding_base_of_its_own,
        no_rope_scaling,
    ],
    ids=lambda f: f.__name__,
)
def test_parity_on_config_variants(tmp_path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    report = parity(variant(tmp_path, edit), layers_only=True)
    assert report.passed, report.summary()


def test_parity_with_as_many_kv_heads_as_query_heads(tmp_path: Path) -> None:
    """Olmo-3 7B: no GQA, so ``k_norm`` is as wide as ``q_norm``; the tiny's K / V projections
    and ``k_norm`` redrawn at 4 KV heads (the shape rules leave their rows free)."""
    from safetensors.torch import load_file, save_file

    def mha(config: dict[str, Any]) -> None:
        config["num_key_value_heads"] = config["num_attention_heads"]

    path = variant(tmp_path, mha)
    tensors = load_file(str(path / "model.safetensors"))
    generator = torch.Generator().manual_seed(0)
    for name in list(tensors):
        if name.endswith(("k_proj.weight", "v_proj.weight", "k_norm.weight")):
            old = tensors[name]
            rows = 2 * old.shape[0]
            new = torch.randn((rows, *old.shape[1:]), generator=generator) * float(old.std())
            tensors[name] = new + 1.0 if name.endswith("k_norm.weight") else new
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    report = parity(path, layers_only=True)
    assert report.passed, report.summary()
    assert report.stage("layers").metrics["max_scaled_diff"] < 1e-6


@pytest.mark.parametrize("num_layers", [4, 32, 64])
def test_layer_types_without_a_list_follow_transformers(
    blocks: Any, tmp_path: Path, num_layers: int
) -> None:
    """A config.json without ``layer_types`` at the tiny / 7B / 32B depths: every fourth layer
    full, as Olmo3Config derives them; the sliding ones get the window. (The record's 32-entry
    default list fits the 7B only; other depths take ``normalise_config``'s rule.)"""
    import transformers

    from resin.runners.torch.model_dir import ModelArgs, ModelRecord, layer_kinds, load_model_args

    config = json.loads((TINY / "config.json").read_text())
    hub_spelling(config)
    config["num_hidden_layers"] = num_layers
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf = transformers.Olmo3Config.from_dict(config)
    assert hf.layer_types is not None
    record = ModelRecord.load(MODEL_DIR)
    args = ModelArgs(**blocks.normalise_config(load_model_args(tmp_path, record).to_dict()))
    kinds = layer_kinds(args, record)
    assert [layer_type for layer_type, _, _ in kinds] == list(hf.layer_types)
    assert [window for _, window, _ in kinds] == [
        config["sliding_window"] if t == "sliding_attention" else None for t in hf.layer_types
    ]
    assert blocks.rope_parameters_by_type(args) == hf.rope_parameters


def test_attention_bias_is_refused_at_load(tmp_path: Path) -> None:
    from resin.registry import ModelRegistry

    checkpoint = variant(tmp_path, lambda config: config.update(attention_bias=True))
    entry = ModelRegistry(use_cwd=False, use_env=False).for_checkpoint(checkpoint)
    with pytest.raises(ValueError, match="olmo3: attention_bias true is not supported"):
        entry.load_runner(checkpoint)


def test_dynamic_rope_caps_max_model_len(tmp_path: Path) -> None:
    """The shared runner's cap (a model directory without its own limit) reads the nested
    tables ``normalise_config`` writes: a legacy ``dynamic`` ``rope_scaling`` (the full layers'
    rope) only up to ``max_position_embeddings``; the tiny's YaRN has no limit."""
    from resin.registry import ModelRegistry

    registry = ModelRegistry(use_cwd=False, use_env=False)
    assert registry.for_checkpoint(TINY).load_runner(TINY).max_model_len_limit is None

    def dynamic(config: dict[str, Any]) -> None:
        hub_spelling(config)
        config["rope_scaling"] = {"rope_type": "dynamic", "factor": 2.0}

    checkpoint = variant(tmp_path, dynamic)
    longest, why = registry.for_checkpoint(checkpoint).load_runner(checkpoint).max_model_len_limit
    config = json.loads((TINY / "config.json").read_text())
    assert longest == config["max_position_embeddings"] and "dynamic" in why
