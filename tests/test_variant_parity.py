"""Config variants end to end through the parity harness (every layer and the logits against
transformers):

- RoPE scaling: a tiny Llama with llama3 scaling and a tiny Qwen2 with YaRN, with prompts past
  `original_max_position_embeddings`;
- Qwen3-MoE routing without renormalisation (`norm_topk_prob=False`; the fixtures cover the
  renormalised case);
- the gated MLP's `hidden_act`: GELU variants in a dense and a MoE model, on the torch and the
  MLX runner, every activation transformers' own bit for bit; one the MLP does not compute is
  refused at load, never run as SiLU;
- a sliding window smaller than the prompts through every greedy stage (the preemption stage
  must still force a preemption);
- the fast attention backend in bf16, checked against HF's SDPA attention, which computes like
  it (against HF's eager attention, whose bf16 roundings it does not make, it departs past the
  tolerance)."""

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from resin.evals.parity import run_parity

PROMPTS = [list(range(3, 12)), [(7 * i + 1) % 120 for i in range(90)]]  # 90 > original 32


def save_tiny(tmp_path: Path, kind: str) -> Path:
    torch.manual_seed(0)
    common = dict(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    moe = dict(head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    if kind == "moe_gelu":
        model = transformers.Qwen3MoeForCausalLM(
            transformers.Qwen3MoeConfig(**common, **moe, hidden_act="gelu")
        )
    elif kind.startswith("act_"):
        model = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(**common, hidden_act=kind.removeprefix("act_"))
        )
    elif kind == "sliding8":
        model = transformers.MistralForCausalLM(
            transformers.MistralConfig(**common, sliding_window=8, head_dim=16)
        )
    elif kind == "ministral":
        layer_types = ["sliding_attention", "full_attention"]
        model = transformers.MinistralForCausalLM(
            transformers.MinistralConfig(
                **common, sliding_window=8, head_dim=16, layer_types=layer_types
            )
        )
    elif kind == "moe_unnormalised":
        model = transformers.Qwen3MoeForCausalLM(
            transformers.Qwen3MoeConfig(**common, **moe, norm_topk_prob=False)
        )
    elif kind == "llama3":
        rope = {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        }
        model = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(**common, rope_parameters=rope)
        )
    else:
        rope = {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 32,
        }
        model = transformers.Qwen2ForCausalLM(
            transformers.Qwen2Config(**common, rope_parameters=rope)
        )
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.3) if param.dim() > 1 else param.uniform_(0.5, 1.5)
    model.save_pretrained(tmp_path / kind)
    return tmp_path / kind


@pytest.mark.parametrize("kind", ["llama3", "yarn"])
def test_scaled_rope_matches_transformers_layer_by_layer(tmp_path: Path, kind: str) -> None:
    model_dir = save_tiny(tmp_path, kind)
    saved = transformers.AutoConfig.from_pretrained(model_dir)
    assert saved.rope_parameters["rope_type"] == kind  # the checkpoint really carries the variant
    report = run_parity(model_dir, prompts=PROMPTS, checks=("layers",))
    assert report.passed, report.summary()


def test_moe_without_renormalisation_matches_transformers(tmp_path: Path) -> None:
    model_dir = save_tiny(tmp_path, "moe_unnormalised")
    assert transformers.AutoConfig.from_pretrained(model_dir).norm_topk_prob is False
    report = run_parity(model_dir, prompts=PROMPTS, checks=("layers",))
    assert report.passed, report.summary()


@pytest.mark.parametrize("kind", ["act_gelu_pytorch_tanh", "act_gelu_new", "moe_gelu"])
def test_the_gated_mlp_computes_the_configs_hidden_act(tmp_path: Path, kind: str) -> None:
    model_dir = save_tiny(tmp_path, kind)
    assert transformers.AutoConfig.from_pretrained(model_dir).hidden_act != "silu"
    report = run_parity(model_dir, prompts=PROMPTS, checks=("layers",))
    assert report.passed, report.summary()


def test_a_hidden_act_the_mlp_does_not_compute_is_refused_at_load(tmp_path: Path) -> None:
    from resin.runners.torch import TorchRunner

    model_dir = save_tiny(tmp_path, "act_mish")
    with pytest.raises(ValueError, match="hidden_act 'mish' is not supported.*gelu"):
        TorchRunner.from_pretrained(model_dir)


def test_a_window_smaller_than_the_prompts_passes_every_greedy_stage(tmp_path: Path) -> None:
    model_dir = save_tiny(tmp_path, "sliding8")
    report = run_parity(model_dir, prompts=PROMPTS, max_new_tokens=8)
    assert report.passed, report.summary()
    stage = next(s for s in report.stages if s.name == "greedy/preemption")
    assert stage.metrics["num_preemptions"] > 0


def test_ministral_saved_by_transformers_runs_its_per_layer_windows(tmp_path: Path) -> None:
    """A checkpoint MinistralForCausalLM saves (model_type "ministral": Mistral's math with a
    per-layer window) passes every stage; the window (8) is smaller than the prompts."""
    from resin.loading import load_model_config

    model_dir = save_tiny(tmp_path, "ministral")
    config = load_model_config(model_dir)
    assert config.model_type == "ministral"
    assert config.layer_window_tokens(0) == 8 and config.layer_window_tokens(1) is None
    report = run_parity(model_dir, prompts=PROMPTS, max_new_tokens=8)
    assert report.passed, report.summary()


@pytest.mark.parametrize("kind", ["act_gelu_pytorch_tanh", "moe_gelu"])
def test_the_mlx_runners_gated_mlp_computes_the_configs_hidden_act(
    tmp_path: Path, kind: str
) -> None:
    pytest.importorskip("mlx.core")
    from resin.runners.mlx.runner import MlxRunner

    model_dir = save_tiny(tmp_path, kind)
    report = run_parity(
        model_dir,
        runner_factory=MlxRunner.from_pretrained,
        runner_name="mlx",
        prompts=PROMPTS,
        checks=("layers",),
    )
    assert report.passed, report.summary()


@pytest.mark.parametrize("kind", ["llama3", "act_gelu_new"])
def test_the_torch_backend_in_bf16_is_checked_against_hfs_sdpa(tmp_path: Path, kind: str) -> None:
    from resin.runners.torch import TorchRunner

    model_dir = save_tiny(tmp_path, kind)

    def runner(backend: str) -> Callable[[str], Any]:
        return lambda path: TorchRunner.from_pretrained(
            path, attention_backend=backend, dtype=torch.bfloat16
        )

    fast = run_parity(
        model_dir, runner("torch"), prompts=PROMPTS, dtype="bfloat16", checks=("layers",)
    )
    assert fast.hf_attention == "sdpa" and fast.passed, fast.summary()
    against_eager = run_parity(
        model_dir,
        runner("torch"),
        prompts=PROMPTS,
        dtype="bfloat16",
        checks=("layers",),
        hf_attention="eager",
    )
    assert against_eager.hf_attention == "eager" and not against_eager.passed
    reference = run_parity(
        model_dir, runner("reference"), prompts=PROMPTS, dtype="bfloat16", checks=("layers",)
    )
    assert reference.hf_attention == "eager" and reference.passed, reference.summary()
    # The reference backend rounds where HF's eager attention does: bit for bit.
    assert max(row["scaled_diff"] for row in reference.layers) == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_gate_activation_is_transformers_own_bit_for_bit(dtype: torch.dtype) -> None:
    from transformers.activations import ACT2FN

    from resin.runners.torch.layers import GATE_ACTIVATIONS

    x = torch.linspace(-8.0, 8.0, 4001).to(dtype)
    for name, fn in GATE_ACTIVATIONS.items():
        assert torch.equal(fn(x), ACT2FN[name](x)), name


def test_the_mlx_runner_computes_the_same_activations() -> None:
    pytest.importorskip("mlx.core")
    import mlx.core as mx
    import numpy as np

    from resin.runners.mlx.layers import GATE_ACTIVATIONS as MLX_ACTIVATIONS
    from resin.runners.torch.layers import GATE_ACTIVATIONS

    assert list(MLX_ACTIVATIONS) == list(GATE_ACTIVATIONS)
    x = np.linspace(-8.0, 8.0, 4001, dtype=np.float32)
    for name, fn in MLX_ACTIVATIONS.items():
        want = GATE_ACTIVATIONS[name](torch.from_numpy(x)).numpy()
        np.testing.assert_allclose(
            np.array(fn(mx.array(x))), want, rtol=2e-6, atol=2e-6, err_msg=name
        )
