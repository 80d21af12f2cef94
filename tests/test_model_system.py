"""Pieces of the model system a model directory relies on, each against what HF does:

- rotary tables: a nested ``rope_parameters`` gives one table per name (Gemma 3 by layer type,
  DeepSeek-V4 ``main`` / ``compress``), partial rotary sized by ``partial_rotary_factor``;
  interleaved and trailing-partial rotation equal the complex-number definition;
- config: legacy keys (``sliding_window_pattern``, a bare ``rope_theta``) win over the
  recorded config-class defaults, as HF's config classes derive them;
- weights: keep-in-fp32 patterns match runner names too; integer tensors are never cast;
  names the weight map renames are loaded, not dropped as unknown;
- parity.toml: ``[tolerances.bfloat16]`` tightens one dtype only;
- the attention backend's sinks: an fp32 sink makes the softmax fp32 (torch promotion, as HF);
- layer kinds: a checkpoint pairing a layer type and an MLP type its model directory's source
  never paired (DeepSeek-V4 with other ``layer_types`` / ``mlp_layer_types``) runs, composed
  from the recorded kinds, and passes parity; an MLP type the record has nowhere is refused;
  a sub-module present by config, not by kind (GLM-5.3-Flash's indexer, absent where
  ``indexer_types`` says ``shared``), is required exactly where the config has it;
- ``hidden_act`` in model directories: Qwen3-Next (experts, shared expert, the linear
  attention's conv), DeepSeek-V4 and GLM-5.3-Flash (clamped SwiGLU; GLM's routed experts stay
  SiLU, as HF's) compute the config's activation, as HF's ``ACT2FN[hidden_act]`` does.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from resin.loading.rope import parse_rope_tables, rope_inv_freq  # noqa: E402
from resin.runners.torch.layers import RotaryEmbedding, apply_rotary  # noqa: E402
from resin.scaffold.layer_map import layer_types_from_config  # noqa: E402


def test_nested_rope_parameters_give_one_table_each() -> None:
    raw = {
        "max_position_embeddings": 4096,
        "partial_rotary_factor": 0.5,
        "rope_parameters": {
            "main": {"rope_type": "default", "rope_theta": 10000.0},
            "compress": {
                "rope_type": "yarn",
                "rope_theta": 160000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 1024,
            },
        },
    }
    tables = parse_rope_tables(raw, 10000.0, 4096)
    assert set(tables) == {"main", "compress"}
    assert tables["compress"].rope_type == "yarn" and tables["main"].partial_rotary_factor == 0.5
    inv_freq, _ = rope_inv_freq(tables["main"], 16)
    assert inv_freq.shape == (4,)  # half the head rotates: 8 dims, 4 frequencies
    flat = parse_rope_tables({"rope_theta": 5e5, "max_position_embeddings": 64}, 1e4, 64)
    assert list(flat) == ["*"] and flat["*"].theta == 5e5


def test_interleaved_and_trailing_partial_rotation() -> None:
    tokens, heads, dim = 5, 2, 8
    x = torch.randn(tokens, heads, dim)
    positions = torch.arange(tokens)
    inv_freq = 1.0 / (10000 ** (np.arange(0, dim, 2) / dim))
    cos, sin = RotaryEmbedding(inv_freq, 1.0, torch.device("cpu"), interleaved=True).cos_sin(
        positions, torch.float32
    )
    got = apply_rotary(x, cos, sin, interleaved=True)
    angles = positions[:, None].float() * torch.tensor(inv_freq, dtype=torch.float32)[None]
    want = torch.view_as_real(
        torch.view_as_complex(x.reshape(tokens, heads, dim // 2, 2))
        * torch.polar(torch.ones_like(angles), angles)[:, None]
    )
    assert torch.allclose(got, want.reshape(tokens, heads, dim), atol=1e-6)
    half = RotaryEmbedding(inv_freq[:2], 1.0, torch.device("cpu"))
    cos, sin = half.cos_sin(positions, torch.float32)
    trailing = apply_rotary(x, cos, sin, trailing=True)
    assert torch.equal(trailing[..., :4], x[..., :4])  # the leading half passes
    assert torch.allclose(trailing[..., 4:], apply_rotary(x[..., 4:], cos, sin))
    leading = apply_rotary(x, cos, sin)
    assert torch.equal(leading[..., 4:], x[..., 4:])


def test_legacy_window_pattern_matches_transformers() -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.Gemma3TextConfig(
        num_hidden_layers=6, sliding_window=8, sliding_window_pattern=3
    )
    legacy = SimpleNamespace(num_hidden_layers=6, sliding_window=8, sliding_window_pattern=3)
    assert [t for t, _ in layer_types_from_config(legacy)] == list(hf.layer_types)
    assert [w for _, w in layer_types_from_config(legacy)] == [8, 8, None, 8, 8, None]


def test_checkpoint_legacy_keys_beat_recorded_defaults(tmp_path: Path) -> None:
    from resin.runners.torch.model_dir import ModelRecord, load_model_args

    record = ModelRecord(
        name="m",
        architectures=["X"],
        model_types=["x"],
        layer_kinds={},
        norm=None,
        rotary=None,
        checkpoint_patterns=[],
        config_defaults={
            "num_hidden_layers": 26,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
            "layer_types": ["sliding_attention"] * 26,
        },
    )
    (tmp_path / "config.json").write_text(
        json.dumps({"num_hidden_layers": 4, "rope_theta": 5e5, "sliding_window_pattern": 2})
    )
    args = load_model_args(tmp_path, record)
    assert args.rope_theta == 5e5 and args.get("rope_parameters") is None
    assert args.get("layer_types") is None and args.rms_norm_eps == 1e-6


def test_weights_keep_fp32_by_runner_name_and_never_cast_integers(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from resin.runners.torch.model_weights import load_model_weights

    save_file(
        {
            "model.layers.0.attn.attn_sink": torch.randn(4),
            "model.layers.0.ffn.gate.tid2eid": torch.randint(0, 8, (16, 2)),
            "model.layers.0.ffn.gate.weight": torch.randn(8, 4),
            "embed.weight": torch.randn(16, 4),
        },
        str(tmp_path / "model.safetensors"),
    )
    weights = load_model_weights(
        tmp_path,
        1,
        dtype=torch.bfloat16,
        keep_in_fp32=["sinks"],
        weight_map={
            "model.layers.{layer}.attn.attn_sink": "layers.{layer}.self_attn.sinks",
            "embed.weight": "embed_tokens.weight",
        },
        known_patterns=[
            "model.layers.{layer}.ffn.gate.tid2eid",
            "model.layers.{layer}.ffn.gate.weight",
        ],
    )
    layer = weights.layers[0]
    assert layer["self_attn.sinks"].dtype == torch.float32  # HF's pattern, runner's name
    assert layer["ffn.gate.tid2eid"].dtype == torch.int64
    assert layer["ffn.gate.weight"].dtype == torch.bfloat16
    assert "embed_tokens.weight" in weights.globals and weights.unused == []


def test_per_dtype_tolerances_in_parity_toml(tmp_path: Path) -> None:
    from resin.evals.model_ref import ModelRef, ModelRefError, parity_settings

    ref = ModelRef(
        name="m",
        checkpoint_dir=tmp_path,
        model_dir=tmp_path,
        parity_spec={
            "reference": {"dtype": "float32"},
            "tolerances": {"hidden": 1e-4, "bfloat16": {"hidden": 5e-3}},
        },
    )
    settings = parity_settings(ref)
    assert settings["tolerances"] == {"hidden": 1e-4}
    assert settings["dtype_tolerances"]["bfloat16"] == {"hidden": 5e-3}
    ref.parity_spec["tolerances"]["bfloat16"]["hiden"] = 1.0
    with pytest.raises(ModelRefError, match="bfloat16.hiden"):
        parity_settings(ref)


def test_fp32_sinks_make_the_softmax_fp32() -> None:
    from resin.runners.torch.attention import ReferenceBackend
    from resin.runners.torch.layers import SequenceView

    backend = ReferenceBackend()
    slots = torch.arange(4)
    mask = torch.ones(4, 4, dtype=torch.bool).tril()
    backend.views = [[SequenceView(slice(0, 4), slots, mask, slots.clone())]]
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(1, 4, 1, 8, generator=gen) * 4
    q = torch.randn(4, 2, 8, generator=gen) * 4
    sinks32 = torch.tensor([0.3, -0.7])
    out16 = backend.attend(q.bfloat16(), k.bfloat16(), k.bfloat16(), 0, scale=0.35, sinks=sinks32)
    out16_bf_sinks = backend.attend(
        q.bfloat16(), k.bfloat16(), k.bfloat16(), 0, scale=0.35, sinks=sinks32.bfloat16()
    )
    want = backend.attend(
        q.bfloat16().float(),
        k.bfloat16().float(),
        k.bfloat16().float(),
        0,
        scale=0.35,
        sinks=sinks32,
    )
    assert not torch.equal(out16, out16_bf_sinks)  # the fp32 sink changed the softmax dtype
    assert (out16.float() - want).abs().max() <= (out16_bf_sinks.float() - want).abs().max()


def test_a_mismatched_checkpoint_is_refused_before_loading(tmp_path: Path) -> None:
    """gpt_oss's record turns shapes into config formulas (q_proj rows = head_dim x heads): a
    checkpoint whose tensor disagrees with its own config.json is named, nothing loaded."""
    import shutil

    from safetensors.torch import load_file, save_file

    from resin.loading.weights import WeightsError
    from resin.registry import ModelRegistry

    tiny = Path(__file__).resolve().parents[1] / "resin" / "models" / "gpt_oss" / "tiny"
    broken = tmp_path / "broken"
    shutil.copytree(tiny, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    name = "model.layers.1.self_attn.q_proj.weight"
    tensors[name] = torch.cat([tensors[name], tensors[name][:16]])  # 16 extra rows
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    entry = ModelRegistry(use_cwd=False, use_env=False).for_checkpoint(broken)
    with pytest.raises(
        WeightsError, match=r"q_proj\.weight has shape \(80, 64\).*implies \(64, 64\)"
    ):
        entry.load_runner(broken)
    entry.load_runner(tiny)  # the intact checkpoint loads


@pytest.mark.parametrize(
    "edit,error",
    [
        ("extra", r"not in the model this directory was generated for"),
        ("no_norm", r"missing tensor\(s\) norm\.weight"),
        ("no_lm_head", r"missing tensor\(s\) lm_head\.weight"),
        ("mtp", None),  # a layer past the stack (MTP): loaded as unused, with a warning
    ],
)
def test_model_directory_checkpoints_are_checked_whole(
    tmp_path: Path, edit: str, error: str | None
) -> None:
    """A model directory refuses a checkpoint with a tensor its record does not know (a bias it
    was not generated with would otherwise be silently dropped) or without a non-layer tensor
    (a final norm, an untied lm_head), naming them; tensors of layers past the stack load as
    unused."""
    import shutil

    from safetensors.torch import load_file, save_file

    from resin.loading.weights import WeightsError
    from resin.registry import ModelRegistry

    tiny = Path(__file__).resolve().parents[1] / "resin" / "models" / "gpt_oss" / "tiny"
    changed = tmp_path / edit
    shutil.copytree(tiny, changed)
    tensors = load_file(str(changed / "model.safetensors"))
    if edit == "extra":
        tensors["model.layers.0.self_attn.extra_proj.bias"] = torch.zeros(4)
    elif edit == "no_norm":
        del tensors["model.norm.weight"]
    elif edit == "no_lm_head":
        del tensors["lm_head.weight"]
    else:
        tensors["model.layers.9.self_attn.q_proj.weight"] = torch.zeros(4, 4)
    save_file(tensors, str(changed / "model.safetensors"), metadata={"format": "pt"})
    entry = ModelRegistry(use_cwd=False, use_env=False).for_checkpoint(changed)
    if error is None:
        with pytest.warns(UserWarning, match="does not use"):
            runner = entry.load_runner(changed)
        assert runner.weights.unused == ["model.layers.9.self_attn.q_proj.weight"]
        return
    with pytest.raises(WeightsError, match=error):
        entry.load_runner(changed)


def _repaired_checkpoint(tmp_path: Path, model: str, changes: dict[str, object]) -> Path:
    """A random-weight checkpoint of ``model``'s tiny config with ``changes``, made by
    transformers."""
    import transformers

    tiny = Path(__file__).resolve().parents[1] / "resin" / "models" / model / "tiny"
    raw = {**json.loads((tiny / "config.json").read_text()), **changes}
    out = tmp_path / model
    out.mkdir()
    (out / "config.json").write_text(json.dumps(raw))
    torch.manual_seed(0)
    hf_class = getattr(transformers, raw["architectures"][0])
    hf_class(transformers.AutoConfig.from_pretrained(out)).save_pretrained(out)
    return out


def test_a_layer_kind_the_record_lacks_is_composed_from_its_parts(tmp_path: Path) -> None:
    from resin.evals.parity import run_parity
    from resin.registry import ModelRegistry
    from resin.runners.torch.model_dir import ModelRecord, layer_kinds, load_model_args

    changed = _repaired_checkpoint(
        tmp_path,
        "deepseek_v4_flash",
        {
            "layer_types": [
                "compressed_sparse_attention",
                "heavily_compressed_attention",
                "sliding_attention",
                "heavily_compressed_attention",
            ],
            "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"],
        },
    )
    entry = ModelRegistry(use_cwd=False, use_env=False).for_checkpoint(changed)
    record = ModelRecord.load(entry.model_dir)
    kinds = [kind for _, _, kind in layer_kinds(load_model_args(changed, record), record)]
    assert "sliding_attention/moe" in kinds and "sliding_attention/moe" not in record.layer_kinds
    report = run_parity(
        changed, runner_factory=lambda path: entry.load_runner(path), checks=("layers",)
    )
    assert report.passed, report.summary()


def test_an_mlp_type_the_record_has_nowhere_is_refused_by_name(tmp_path: Path) -> None:
    from resin.registry import ModelRegistry

    changed = _repaired_checkpoint(tmp_path, "qwen3_next", {"decoder_sparse_step": 2})
    entry = ModelRegistry(use_cwd=False, use_env=False).for_checkpoint(changed)
    with pytest.raises(
        ValueError, match=r"layer 0 is of kind 'linear_attention/dense' and needs a 'dense' MLP"
    ):
        entry.load_runner(changed)


def test_a_layers_indexer_is_required_where_its_config_has_one(tmp_path: Path) -> None:
    """GLM-5.3-Flash with its indexed layers' ``indexer_types`` re-dealt: the dense indexed
    layer now runs its own indexer (its recorded kind had none) and a sparse one shares (its
    kind had one); the checkpoint loads and every layer matches HF."""
    from resin.evals.parity import run_parity
    from resin.registry import ModelRegistry

    changed = _repaired_checkpoint(
        tmp_path,
        "glm5_flash",
        {
            "layer_types": ["indexed_attention", "indexed_attention", "linear_attention"]
            + ["indexed_attention", "indexed_attention"],
            "indexer_types": ["full", "shared", "full", "full", "shared"],
            "mlp_layer_types": ["dense", "sparse", "sparse", "dense", "sparse"],
        },
    )
    entry = ModelRegistry(use_cwd=False, use_env=False).for_checkpoint(changed)
    report = run_parity(
        changed, runner_factory=lambda path: entry.load_runner(path), checks=("layers",)
    )
    assert report.passed, report.summary()
    # Layer 0 (dense, indexer "full") without its indexer: refused, naming the tensors.
    from safetensors.torch import load_file, save_file

    from resin.loading.weights import WeightsError

    tensors = load_file(str(changed / "model.safetensors"))
    prefix = "model.language_model.layers.0.self_attn.indexer."
    if not any(k.startswith(prefix) for k in tensors):
        prefix = "model.layers.0.self_attn.indexer."
    stripped = {k: v for k, v in tensors.items() if not k.startswith(prefix)}
    assert len(stripped) < len(tensors)
    save_file(stripped, str(changed / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(WeightsError, match=r"layer 0 is missing tensor\(s\) .*indexer"):
        entry.load_runner(changed)


@pytest.mark.parametrize(
    ("model", "hidden_act"),
    [
        ("qwen3_next", "gelu_new"),
        ("deepseek_v4_flash", "gelu_pytorch_tanh"),
        ("glm5_flash", "gelu"),
    ],
)
def test_model_directories_compute_the_configs_hidden_act(
    tmp_path: Path, model: str, hidden_act: str
) -> None:
    from resin.evals.parity import run_parity
    from resin.registry import ModelRegistry

    changed = _repaired_checkpoint(tmp_path, model, {"hidden_act": hidden_act})
    entry = ModelRegistry(use_cwd=False, use_env=False).for_checkpoint(changed)
    report = run_parity(
        changed, runner_factory=lambda path: entry.load_runner(path), checks=("layers",)
    )
    assert report.passed, report.summary()


@pytest.mark.parametrize(
    ("model", "field", "value"),
    [
        ("qwen3_next", "hidden_act", "mish"),
        ("deepseek_v4_flash", "hidden_act", "mish"),
        ("glm5_flash", "hidden_act", "relu2"),
        ("gemma3", "hidden_activation", "gelu"),
    ],
)
def test_a_model_directory_refuses_an_activation_it_does_not_compute_at_load(
    tmp_path: Path, model: str, field: str, value: str
) -> None:
    """The tiny checkpoint with only its config's activation changed: refused when the runner
    is built, naming the model and the field — not at the first forward."""
    import shutil

    from resin.registry import ModelRegistry

    tiny = Path(__file__).resolve().parents[1] / "resin" / "models" / model / "tiny"
    changed = tmp_path / model
    shutil.copytree(tiny, changed)
    config = json.loads((changed / "config.json").read_text())
    text = config.get("text_config", config)  # a wrapper keeps the text model's fields inside
    text[field] = value
    (changed / "config.json").write_text(json.dumps(config))
    entry = ModelRegistry(use_cwd=False, use_env=False).for_checkpoint(changed)
    with pytest.raises(ValueError, match=rf"{model}: {field} '{value}' is not supported"):
        entry.load_runner(changed)


def test_glm_indexer_ties_do_not_depend_on_later_tokens(tmp_path: Path) -> None:
    """GLM-5.3-Flash with ``index_topk`` 4 (one pool a query): its ReLU index scores tie
    exactly, and torch's ``topk`` orders ties by the call's size, so HF's one-shot forward
    picked other pools for a query when the sequence ran on past it (position 55 of a 70-token
    prompt), and so did the runner. Ties now go to the earlier pool in the runner and in the
    adjusted HF reference (``glm5_flash/reference.py``): a prefix's logits are the longer
    prefill's, and every greedy stage passes against HF's full forward."""
    from resin.evals.parity import default_prompts, run_parity
    from resin.evals.parity_engine import runner_capture_prefill
    from resin.registry import ModelRegistry

    changed = _repaired_checkpoint(tmp_path, "glm5_flash", {"index_topk": 4})
    entry = ModelRegistry(use_cwd=False, use_env=False).for_checkpoint(changed)
    runner = entry.load_runner(changed)
    sequence = default_prompts(384)[5] + default_prompts(384, seed=1)[1]  # 70 + 7 tokens
    whole, _, _ = runner_capture_prefill(runner, sequence, 384)
    assert whole is not None
    for length in (56, 70):
        prefix, _, _ = runner_capture_prefill(runner, sequence[:length], 384)
        assert prefix is not None
        torch.testing.assert_close(prefix["logits"], whole["logits"][:length])
    report = run_parity(
        changed,
        runner_factory=lambda path: runner,
        greedy_reference="full_forward",
        max_new_tokens=8,
    )
    assert report.passed, report.summary()
    assert report.reference_adjustments and "ties" in report.reference_adjustments[0]
    assert not report.reference_findings[0]["departs"]


def test_a_model_directory_with_dynamic_rope_is_capped_at_its_length(tmp_path: Path) -> None:
    """transformers' ``dynamic`` rope re-rotates every position once a sequence passes
    ``max_position_embeddings``, which a KV cache cannot follow: a model directory without a
    limit of its own (Gemma 2 here) gets the shared one, as the built-in families do — the
    default max_model_len capped there, a longer one refused by name."""
    import resin
    from resin.loading.fields import ConfigError
    from resin.loading.rope import dynamic_rope_limit

    dynamic = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    changed = _repaired_checkpoint(
        tmp_path, "gemma2", {"rope_parameters": dynamic, "max_position_embeddings": 48}
    )
    tiny = Path(__file__).resolve().parents[1] / "resin" / "models" / "gemma2" / "tiny"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (changed / name).write_bytes((tiny / name).read_bytes())
    assert resin.LLM(changed).engine.config.max_model_len == 48
    with pytest.raises(ConfigError, match=r"max_model_len 49 is past 48: rope type 'dynamic'"):
        resin.LLM(changed, max_model_len=49)
    # The rule reads every table of a nested config; other rope types are not limited here.
    nested = {"full_attention": dynamic, "sliding_attention": {"rope_type": "default"}}
    assert dynamic_rope_limit({"rope_parameters": nested, "max_position_embeddings": 99})
    assert dynamic_rope_limit({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}) is None
    assert dynamic_rope_limit({"rope_parameters": {"rope_type": "no-such-type"}}) is None


def test_ignored_prefixes_take_a_layer_placeholder() -> None:
    """``weights.IGNORED_PREFIXES`` entries with ``{layer}`` match any layer index (an MTP
    layer's copies of the embedding sit at ``model.layers.{num_hidden_layers}.``), and only an
    index; plain prefixes match as prefixes."""
    from resin.runners.torch.model_weights import _prefix_matcher

    ignored = _prefix_matcher(
        iter(("model.visual.", "model.layers.{layer}.embed_tokens.", "mtp.{layer}.head."))
    )
    assert ignored("model.visual.blocks.0.weight")
    assert ignored("model.layers.61.embed_tokens.weight")
    assert ignored("mtp.0.head.weight")
    assert not ignored("model.layers.61.self_attn.q_a_proj.weight")
    assert not ignored("model.layers.x.embed_tokens.weight")
    assert not ignored("model.embed_tokens.weight")
    assert not _prefix_matcher(())("anything")


def test_default_logits_add_the_heads_bias() -> None:
    """A checkpoint whose ``lm_head`` has a bias (Phi-2's): the default logits add it; it was
    loaded and silently dropped (found bringing Phi up by the skill)."""
    torch = pytest.importorskip("torch")
    from resin.runners.torch.model_definition import default_logits

    hidden, weight, bias = torch.randn(3, 8), torch.randn(5, 8), torch.randn(5)
    out = default_logits(hidden, {"lm_head.weight": weight, "lm_head.bias": bias}, None)
    torch.testing.assert_close(out, hidden @ weight.T + bias)
    tied = default_logits(hidden, {"embed_tokens.weight": weight}, None)
    torch.testing.assert_close(tied, hidden @ weight.T)
