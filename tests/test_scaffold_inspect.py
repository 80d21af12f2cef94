"""The scaffold's view of an HF model: windows per layer type, MLP types, unplaced modules,
full meta-forward output structures (resin.scaffold.layer_map / resin.scaffold.inspect).

Configs are built with transformers (DeepSeek-V4, Gemma 3 text, Qwen3-Next, gpt-oss) at small
widths, so every meta model builds in well under a second.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from resin.scaffold.layer_map import is_moe_type, layer_types_from_config, mlp_types_from_config

SMALL = dict(
    hidden_size=64, intermediate_size=128, num_attention_heads=4, head_dim=16, vocab_size=384
)


def _dsv4(**kw: Any) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.DeepseekV4Config(
        **{
            **SMALL,
            "num_key_value_heads": 1,
            "q_lora_rank": 32,
            "moe_intermediate_size": 32,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "o_lora_rank": 16,
            "o_groups": 2,
            "index_n_heads": 4,
            "index_head_dim": 16,
            "num_hidden_layers": 4,
            "sliding_window": 32,
            **kw,
        }
    )


def _new_model_cli(tmp_path: Path, config: dict[str, Any], architecture: str, name: str) -> Any:
    """``resin new-model`` run through the CLI on ``config`` (a config.json dict, given its
    ``architectures``), into ``tmp_path / "out"``: the click result."""
    from typer.testing import CliRunner

    from resin.cli import app

    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "config.json").write_text(
        json.dumps({**config, "architectures": [architecture]})
    )
    return CliRunner().invoke(
        app, ["new-model", str(tmp_path / "src"), "--name", name, "--out", str(tmp_path / "out")]
    )


def test_window_on_every_layer_type_whose_attention_uses_it() -> None:
    # DeepSeek-V4: all three attention types keep a raw sliding window
    v4 = SimpleNamespace(
        num_hidden_layers=3,
        sliding_window=128,
        layer_types=[
            "sliding_attention",
            "compressed_sparse_attention",
            "heavily_compressed_attention",
        ],
    )
    assert layer_types_from_config(v4) == [(t, 128) for t in v4.layer_types]
    # Gemma 3 / gpt-oss: only sliding layers; full / indexed / recurrent never
    mixed = SimpleNamespace(
        num_hidden_layers=4,
        sliding_window=512,
        layer_types=[
            "sliding_attention",
            "full_attention",
            "indexed_attention",
            "linear_attention",
        ],
    )
    assert [w for _, w in layer_types_from_config(mixed)] == [512, None, None, None]
    off = SimpleNamespace(
        num_hidden_layers=1,
        sliding_window=512,
        use_sliding_window=False,
        layer_types=["sliding_attention"],
    )
    assert layer_types_from_config(off) == [("sliding_attention", None)]


def test_real_configs_get_their_windows() -> None:
    transformers = pytest.importorskip("transformers")
    v4 = transformers.DeepseekV4Config(num_hidden_layers=6)
    assert {t for t, _ in layer_types_from_config(v4)} >= {
        "compressed_sparse_attention",
        "heavily_compressed_attention",
    }
    assert all(w == v4.sliding_window for _, w in layer_types_from_config(v4))
    gemma = transformers.Gemma3TextConfig(num_hidden_layers=6)
    assert layer_types_from_config(gemma)[5] == ("full_attention", None)
    assert layer_types_from_config(gemma)[0] == ("sliding_attention", gemma.sliding_window)
    assert mlp_types_from_config(v4) == ["hash_moe"] * 3 + ["moe"] * 3


def test_mlp_types_derived_from_moe_fields() -> None:
    assert mlp_types_from_config(SimpleNamespace(num_hidden_layers=2)) == ["dense", "dense"]
    qwen_moe = SimpleNamespace(
        num_hidden_layers=6, num_experts=8, decoder_sparse_step=2, mlp_only_layers=[3]
    )
    assert mlp_types_from_config(qwen_moe) == ["dense", "moe", "dense", "dense", "dense", "moe"]
    v3 = SimpleNamespace(num_hidden_layers=4, n_routed_experts=8, first_k_dense_replace=1)
    assert mlp_types_from_config(v3) == ["dense", "moe", "moe", "moe"]
    mixtral = SimpleNamespace(num_hidden_layers=2, num_local_experts=8)
    assert mlp_types_from_config(mixtral) == ["moe", "moe"]
    glm = SimpleNamespace(num_hidden_layers=2, mlp_layer_types=["dense", "sparse", "sparse"])
    assert mlp_types_from_config(glm) == ["dense", "sparse"]
    assert [is_moe_type(t) for t in ("dense", "sparse", "moe", "hash_moe")] == [
        False,
        True,
        True,
        True,
    ]
    with pytest.raises(ValueError, match="mlp_layer_types"):
        mlp_types_from_config(SimpleNamespace(num_hidden_layers=3, mlp_layer_types=["moe"]))


def test_deepseek_v4_hc_head_is_reported_unplaced_with_shapes() -> None:
    from resin.scaffold.inspect import inspect_architecture, unplaced_warnings

    arch = inspect_architecture(_dsv4())
    assert arch.meta_forward_error is None
    assert [(layer.layer_type, layer.window, layer.mlp_type) for layer in arch.layers] == [
        ("heavily_compressed_attention", 32, "hash_moe"),
        ("heavily_compressed_attention", 32, "hash_moe"),
        ("heavily_compressed_attention", 32, "hash_moe"),
        ("compressed_sparse_attention", 32, "moe"),
    ]
    extra = {m.path: m for m in arch.extra_modules}
    assert set(extra) == {"model.hc_head"}
    head = extra["model.hc_head"]
    assert head.cls_name == "DeepseekV4HyperHead" and head.called is True
    assert head.output_text == "Tensor[1,5,64]" and head.input_text.startswith("Tensor[1,5,4,64]")
    assert head.params and all(isinstance(s, tuple) for s in head.params.values())
    lines = Path(head.source_file).read_text().splitlines()
    assert "DeepseekV4HyperHead" in "\n".join(lines[head.source_line - 1 : head.source_line + 2])
    warnings = unplaced_warnings(arch)
    assert len(warnings) == 1
    assert (
        "module model.hc_head (DeepseekV4HyperHead, transformers/models/deepseek_v4/" in warnings[0]
    )
    assert "is not placed by the scaffold: write it as a hook in blocks.py" in warnings[0]
    # the full output structure, not only the first tensor: attention returns a tuple
    attn = arch.layers[0].children["self_attn"]
    assert attn.output == (1, 5, 64)
    assert attn.output_text.startswith("(Tensor[1,5,64], ") and attn.output_text.endswith(")")
    assert arch.layers[0].children["mlp"].buffers == {"gate.tid2eid": (384, 2)}
    # plain data: the lead serialises it to JSON
    json.dumps([dataclasses.asdict(m) for m in arch.extra_modules])
    json.dumps([dataclasses.asdict(layer) for layer in arch.layers])


def test_gemma3_places_everything_and_full_layers_have_no_window() -> None:
    transformers = pytest.importorskip("transformers")
    from resin.scaffold.inspect import inspect_architecture, unplaced_warnings

    arch = inspect_architecture(
        transformers.Gemma3TextConfig(
            **SMALL, num_key_value_heads=2, num_hidden_layers=6, sliding_window=32
        )
    )
    assert arch.extra_modules == []
    # every module is placed, but the embedding is not a plain lookup (Gemma scales it)
    (warning,) = unplaced_warnings(arch)
    assert "Gemma3TextScaledWordEmbedding" in warning and "embed hook" in warning
    assert [layer.window for layer in arch.layers] == [32] * 5 + [None]
    assert {layer.mlp_type for layer in arch.layers} == {"dense"}
    assert arch.layers[0].decoder.output_text == "Tensor[1,5,64]"


def test_unused_and_direct_tensors_are_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from resin.scaffold import inspect as insp

    real = insp.build_meta_model

    def with_extras(config: Any) -> Any:
        model = real(config)
        with torch.device("meta"):
            model.model.mtp_head = torch.nn.Linear(64, 64)  # never called by forward
            model.model.logit_scale = torch.nn.Parameter(torch.ones(1))
        return model

    monkeypatch.setattr(insp, "build_meta_model", with_extras)
    arch = insp.inspect_architecture(
        transformers.LlamaConfig(**SMALL, num_key_value_heads=2, num_hidden_layers=2)
    )
    extra = {m.path: m for m in arch.extra_modules}
    assert set(extra) == {"model", "model.mtp_head"}
    assert extra["model"].params == {"logit_scale": (1,)}
    assert extra["model.mtp_head"].called is False and extra["model.mtp_head"].output_text == ""
    warnings = "\n".join(insp.unplaced_warnings(arch))
    assert "module model.mtp_head (Linear" in warnings and "never calls it" in warnings
    assert "holds tensors directly (logit_scale)" in warnings


def test_meta_forward_retries_past_item_on_meta_masks() -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.utils import import_utils

    from resin.scaffold import inspect as insp

    config = transformers.Qwen3NextConfig(
        **{
            **SMALL,
            "num_key_value_heads": 2,
            "num_hidden_layers": 4,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
        }
    )
    _, first_error = insp._meta_forward(insp.build_meta_model(config))
    assert first_error is not None and ".item()" in first_error  # why the retry exists
    original = import_utils.is_tracing
    arch = insp.inspect_architecture(config)
    assert arch.meta_forward_error is None
    assert arch.layers[0].layer_type == "linear_attention"
    assert arch.layers[0].children["linear_attn"].output_text == "Tensor[1,5,64]"
    import transformers.masking_utils as mu

    assert import_utils.is_tracing is original and mu.is_tracing is original  # restored


def test_describe_structures() -> None:
    torch = pytest.importorskip("torch")
    from resin.scaffold.inspect import describe

    t = torch.zeros(1, 5, 64, device="meta")
    assert describe((t, None)) == "(Tensor[1,5,64], None)"
    assert (
        describe([t, torch.zeros(5, 2, dtype=torch.long)]) == "[Tensor[1,5,64], Tensor[5,2]:int64]"
    )
    assert describe({"a": t}) == "{a=Tensor[1,5,64]}"
    assert describe((t,)) == "(Tensor[1,5,64],)"
    assert len(describe(tuple([t] * 200), limit=60)) == 60


def test_new_model_prints_unplaced_modules(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    result = _new_model_cli(tmp_path, _dsv4().to_dict(), "DeepseekV4ForCausalLM", "dsv4")
    assert result.exit_code == 0, result.output
    assert "warning: module model.hc_head (DeepseekV4HyperHead" in result.output


def test_new_model_maps_compressed_and_gated_delta_net_layers_to_their_caches(
    tmp_path: Path,
) -> None:
    """CSA / HCA come out as a raw window plus compressed entries, gated-delta-net
    linear_attention as a recurrent state: no layer_cache stub, the specs the engine gets."""
    transformers = pytest.importorskip("transformers")

    from resin.runners.torch.model_dir import default_layer_cache

    raw = _dsv4(
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16}
    )
    out = tmp_path / "out"
    result = _new_model_cli(tmp_path, raw.to_dict(), "DeepseekV4ForCausalLM", "dsv4")
    assert result.exit_code == 0, result.output
    blocks = (out / "blocks.py").read_text()
    assert "def layer_cache" not in blocks and '"layer_cache"' not in blocks
    notes = (out / "NOTES.md").read_text()
    # CSA pools 2 windows of 4 (< sliding 32); HCA 16 tokens.
    assert "sliding_window(32) + compressed(ratio 4)" in notes
    assert "sliding_window(32) + compressed(ratio 16)" in notes
    assert "unknown (stub)" not in notes
    import torch

    dtype = torch.float32
    for layer_type, ratio, extra_buffers in (
        ("compressed_sparse_attention", 4, {"kv", "index_k"}),
        ("heavily_compressed_attention", 16, {"kv"}),
    ):
        main, extra = default_layer_cache(layer_type, 32, raw, 64, 1)
        assert (main.kind, main.window) == ("sliding_window", 32)
        entries = extra["entries"]
        assert (entries.kind, entries.ratio, set(entries.buffers)) == (
            "compressed",
            ratio,
            extra_buffers,
        )
        assert entries.spec(dtype).ratio == ratio
    # A wide ratio widens the raw window so an entry's carry stays in it.
    wide = _dsv4(
        compress_rates={"compressed_sparse_attention": 32, "heavily_compressed_attention": 128}
    )
    assert default_layer_cache("compressed_sparse_attention", 32, wide, 64, 1)[0].window == 64
    assert default_layer_cache("heavily_compressed_attention", 32, wide, 64, 1)[0].window == 128

    qwen3_next = transformers.Qwen3NextConfig(
        **SMALL,
        num_key_value_heads=2,
        num_hidden_layers=4,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
    )
    state = default_layer_cache("linear_attention", None, qwen3_next, 16, 2)
    conv_dim = 2 * 2 * 8 + 4 * 16
    assert (state.kind, state.buffers) == ("recurrent", {"conv": (conv_dim, 3), "ssm": (4, 8, 16)})
    assert state.spec(dtype).state_bytes == (conv_dim * 3 + 4 * 8 * 16) * 4  # fp32
    # A linear_attention type without the gated-delta-net fields stays a stub.
    from resin.scaffold.layer_map import has_cache_declaration

    assert not has_cache_declaration("linear_attention", None, SimpleNamespace())
    assert has_cache_declaration("linear_attention", None, qwen3_next)


def test_glm5_caches_are_defaults_and_shared_indexer_layers_keep_the_latent_only() -> None:
    """GLM-5.3-Flash's mixers need no ``blocks.layer_cache``: KDA ``linear_attention`` gets the
    Kimi-delta-attention state, ``indexed_attention`` the latent plus, where ``indexer_types`` is
    ``full``, the indexer's window and pools; a ``shared`` layer (it reuses the previous layer's
    selection) keeps the latent only once its index is known, and the scaffold writes no stub."""
    transformers = pytest.importorskip("transformers")
    import torch

    from resin.runners.torch.model_dir import declare_layer_cache, default_layer_cache
    from resin.scaffold.layer_map import cache_kind, has_cache_declaration

    config = transformers.Glm5NextTextConfig(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        layer_types=[
            "linear_attention",
            "indexed_attention",
            "indexed_attention",
            "linear_attention",
        ],
        indexer_types=["full", "full", "shared", "full"],
        linear_num_heads=2,
        linear_head_dim=8,
        linear_conv_kernel_dim=3,
        kv_lora_rank=24,
        index_head_dim=12,
        index_kpool=4,
    )
    assert cache_kind("indexed_attention", None) == "indexed"
    for layer_type in ("linear_attention", "indexed_attention"):
        assert has_cache_declaration(layer_type, None, config)
    assert not has_cache_declaration("indexed_attention", None, SimpleNamespace())

    state = declare_layer_cache(default_layer_cache, 0, "linear_attention", None, config, 0, 4)
    assert (state.kind, state.buffers) == ("recurrent", {"conv": (3 * 2 * 8, 2), "ssm": (2, 8, 8)})
    assert state.spec(torch.bfloat16).state_bytes == (48 * 2 + 2 * 8 * 8) * 4  # fp32 state
    main, extra = declare_layer_cache(
        default_layer_cache, 1, "indexed_attention", None, config, 0, 4
    )
    assert (main.kind, main.buffers) == ("full", {"latent": (24,)})
    assert extra["window"].buffers == {"index_k": (12,), "index_gate": (12,)}
    assert (extra["window"].window, extra["pools"].ratio) == (4, 4)
    shared = declare_layer_cache(default_layer_cache, 2, "indexed_attention", None, config, 0, 4)
    assert (shared.kind, shared.buffers) == ("full", {"latent": (24,)})
    # Without the index (an older caller): every indexed layer declares the indexer caches.
    assert isinstance(default_layer_cache("indexed_attention", None, config, 0, 4), tuple)

    seen: list[int | None] = []

    def old_hook(layer_type, window, cfg, head_dim, num_kv_heads):  # type: ignore[no-untyped-def]
        seen.append(None)
        return main

    def new_hook(layer_type, window, cfg, head_dim, num_kv_heads, layer_index=None):  # type: ignore[no-untyped-def]
        seen.append(layer_index)
        return main

    declare_layer_cache(old_hook, 3, "indexed_attention", None, config, 0, 4)
    declare_layer_cache(new_hook, 3, "indexed_attention", None, config, 0, 4)
    assert seen == [None, 3]


def test_layer_types_of_a_wrapper_config_come_from_its_text_config() -> None:
    """A multimodal wrapper (GLM-5.3-Flash's ``Glm5NextConfig``: ``text_config`` +
    ``vision_config``) has no ``num_hidden_layers`` at the top: the layer and MLP types are read
    from its text config (the HF object's ``get_text_config()``, or a ``text_config`` mapping)."""
    transformers = pytest.importorskip("transformers")
    text = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        layer_types=["linear_attention", "indexed_attention"],
        mlp_layer_types=["dense", "sparse"],
    )
    wrapper = transformers.Glm5NextConfig(text_config=text)
    assert getattr(wrapper, "num_hidden_layers", None) is None
    expected = [("linear_attention", None), ("indexed_attention", None)]
    assert layer_types_from_config(wrapper) == expected
    assert mlp_types_from_config(wrapper) == ["dense", "sparse"]
    as_json = SimpleNamespace(text_config=text, vision_config={"depth": 1})  # config.json form
    assert layer_types_from_config(as_json) == expected
    assert mlp_types_from_config(as_json) == ["dense", "sparse"]


def test_config_scalars_the_forward_multiplies_inline_are_warned() -> None:
    """Granite's embedding / residual / attention multipliers scale activations inline in the
    HF forward (no module of their own): each is named, its logits scaling as the logits hook's;
    a multiplier of 1 changes nothing and is not."""
    from resin.scaffold.inspect import inspect_architecture, unplaced_warnings

    source = Path(__file__).resolve().parents[1] / "resin" / "models" / "granite" / "source"
    warnings = unplaced_warnings(inspect_architecture(source / "config.json"))
    scalars = [w.split(" = ")[0] for w in warnings if "multiplies activations" in w]
    assert scalars == [
        "config.attention_multiplier",
        "config.embedding_multiplier",
        "config.residual_multiplier",
    ]
    assert any(w.startswith("config.logits_scaling = 16.0") for w in warnings)


def test_stacks_named_other_than_llamas_are_found() -> None:
    """GPT-NeoX keeps its stack at ``gpt_neox`` with ``embed_in`` / ``final_layer_norm``; Phi
    names its final norm ``final_layernorm``: the scaffold finds both as the Llama names (once
    GPT-NeoX was refused outright and Phi's norm left unplaced), and the parity harness hooks
    the final norm under ``norm``."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from resin.evals.parity import hf_activations
    from resin.scaffold.inspect import inspect_architecture, unplaced_warnings

    small = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, vocab_size=384)
    neox = inspect_architecture(transformers.GPTNeoXConfig(**small, num_hidden_layers=2))
    assert neox.stack_path == "gpt_neox" and neox.wrapper_config is None
    assert neox.checkpoint_prefix == "gpt_neox."
    assert neox.embed is not None and neox.norm is not None
    phi_config = transformers.PhiConfig(**small, num_hidden_layers=2)
    phi = inspect_architecture(phi_config)
    assert phi.norm is not None
    assert not any("final_layernorm" in w for w in unplaced_warnings(phi))
    torch.manual_seed(0)
    model = transformers.PhiForCausalLM(phi_config).eval()
    assert "norm" in hf_activations(model, [1, 2, 3])


def test_dropout_is_no_stub_and_no_warning(tmp_path: Path) -> None:
    """``nn.Dropout`` computes nothing at inference: a layer's dropout child is generated as
    ``return x`` and a model-level one is not reported as math to place (Phi has both)."""
    transformers = pytest.importorskip("transformers")
    raw = transformers.PhiConfig(**SMALL, num_hidden_layers=2).to_dict()
    out = tmp_path / "out"
    result = _new_model_cli(tmp_path, raw, "PhiForCausalLM", "p")
    assert result.exit_code == 0, result.output
    assert "Dropout" not in result.output  # neither a stub nor an unplaced-module warning
    assert "return x  # Dropout: nothing at inference" in (out / "blocks.py").read_text()
