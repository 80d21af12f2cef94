"""The parity harness's HF reference for a multimodal wrapper config (``text_config`` +
``vision_config``) that transformers maps only to ``AutoModelForImageTextToText``
(``resin.scaffold.hf_model``, used by ``resin.evals.parity``): GLM-5.3-Flash's ``glm5_next``,
built tiny with transformers. No shim registers a causal-LM class."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from resin.evals.parity import hf_activations, hf_num_layers, hf_vocab_size, load_hf_model  # noqa: E402
from resin.scaffold import hf_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEXT = dict(
    model_type="glm5_next_text",
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    layer_types=["linear_attention", "indexed_attention"],
    mlp_layer_types=["dense", "sparse"],
    n_routed_experts=4,
    num_experts_per_tok=2,
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_nope_head_dim=8,
    v_head_dim=8,
    index_head_dim=8,
    index_n_heads=2,
    index_topk=4,
    index_kpool=2,
    linear_num_heads=2,
    linear_head_dim=8,
    hc_mult=2,
    pad_token_id=1,
)
VISION = dict(
    model_type="glm5_next_vision",
    depth=3,
    hidden_size=16,
    num_heads=2,
    intermediate_size=16,
    out_hidden_size=32,
)


def _wrapper_checkpoint(path: Path) -> Any:
    config = transformers.Glm5NextConfig(text_config=TEXT, vision_config=VISION)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.Glm5NextForConditionalGeneration(config).eval()
    model.save_pretrained(path)
    return model


def test_wrapper_config_has_no_causal_lm_class_and_falls_back(tmp_path: Path) -> None:
    config = transformers.Glm5NextConfig(text_config=TEXT, vision_config=VISION)
    assert type(config) not in transformers.AutoModelForCausalLM._model_mapping
    assert hf_model.lm_auto_class(config) is transformers.AutoModelForImageTextToText
    assert hf_model.text_config(config).vocab_size == 96 and not hasattr(config, "vocab_size")
    with pytest.raises(ValueError, match="glm5_next_text"):  # a bare sub-config: no LM class
        hf_model.lm_auto_class(transformers.Glm5NextTextConfig(**TEXT))
    assert hf_model.shallow_towers(config) == ["vision_config.depth"]
    assert config.vision_config.depth == 1 and config.text_config.num_hidden_layers == 2


def test_reference_loads_the_wrapper_and_hooks_its_text_stack(tmp_path: Path) -> None:
    saved = _wrapper_checkpoint(tmp_path / "wrapper")
    ref = load_hf_model(tmp_path / "wrapper")
    assert type(ref) is transformers.Glm5NextForConditionalGeneration
    stack, path = hf_model.decoder_stack(ref)
    assert path == "model.language_model" and stack is ref.model.language_model
    assert (hf_vocab_size(ref), hf_num_layers(ref)) == (96, 2)
    ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(3))
    acts = hf_activations(ref, ids[0].tolist())
    assert list(acts)[:2] == ["embed_tokens", "layers.0.attn_hc"]
    assert {"layers.0.self_attn", "layers.1.mlp", "layers.1", "norm", "logits"} <= set(acts)
    with torch.no_grad():
        # the text weights as saved; only the never-run vision tower is rebuilt shallower (and
        # the experts run HF's eager loop, the saved model's grouped_mm: fp32 rounding apart)
        expected = saved(input_ids=ids).logits[0]
    torch.testing.assert_close(acts["logits"], expected, rtol=0, atol=1e-5)
    assert float(expected.abs().max()) > 1e-2  # not a vacuous comparison


def test_causal_lm_named_checkpoint_maps_onto_the_wrapper_stack(tmp_path: Path) -> None:
    """A text-only checkpoint whose tensors carry causal-LM names (``model.layers.*``, as
    GLM-5.3-Flash's flat tiny) loads into the wrapper's ``model.language_model``."""
    from safetensors.torch import load_file, save_file

    saved = _wrapper_checkpoint(tmp_path / "wrapper")
    flat = tmp_path / "flat"
    flat.mkdir()
    tensors = load_file(str(tmp_path / "wrapper" / "model.safetensors"))
    renamed = {
        k.replace("model.language_model.", "model.", 1): v
        for k, v in tensors.items()
        if not k.startswith("model.visual.")
    }
    save_file(renamed, str(flat / "model.safetensors"), metadata={"format": "pt"})
    (flat / "config.json").write_text((tmp_path / "wrapper" / "config.json").read_text())
    assert hf_model._saved_as_causal_lm(flat) and not hf_model._saved_as_causal_lm(
        tmp_path / "wrapper"
    )
    ref = load_hf_model(flat)
    ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        got, expected = ref(input_ids=ids).logits, saved(input_ids=ids).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    # the mapping is what loaded them: without it the stack would be freshly initialised
    random = type(ref)(ref.config).eval()
    with torch.no_grad():
        assert not torch.allclose(random(input_ids=ids).logits, expected, atol=1e-3)
