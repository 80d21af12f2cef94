"""The torch reference runner: the built-in Llama family on the shared paged runner.

Owns :class:`TorchRunner`, the runner of the built-in families — Llama, Mistral (sliding
window), Qwen2 (qkv bias), Qwen3 (q/k norm), Qwen3-MoE, Mixtral — defined from the checkpoint's
config as :mod:`resin.loading` parses it (no ``transformers`` at run time) and run by
:class:`~.paged_runner.PagedRunner` with the shared blocks of :mod:`.blocks`. Weights are checked
against the parsed config (:func:`resin.loading.weights.load_weights`) before anything is
copied. Same code on CPU and CUDA; the device and dtype are chosen at load. Parity capture:
see :mod:`.paged_runner`.
"""

from __future__ import annotations

import os

import torch

from resin.loading import ModelConfig, load_model_config
from resin.loading.weights import load_weights
from resin.runners.torch.attention import AttentionBackend
from resin.runners.torch.blocks import (
    gqa_attention_block,
    prenorm_decoder_layer,
    rms_norm_block,
    swiglu_mlp_block,
    topk_moe_block,
)
from resin.runners.torch.layers import RotaryEmbedding, gate_activation
from resin.runners.torch.model_definition import (
    LayerDefinition,
    ModelDefinition,
    attention_cache,
)
from resin.runners.torch.model_weights import ModelWeights, default_runner_name
from resin.runners.torch.paged_runner import PagedRunner
from resin.runners.torch.rope_frequencies import hf_rope_inv_freq

MIXTRAL_EXPERT_NAMES = ("w1", "w3", "w2")


class TorchRunner(PagedRunner):
    """Runs a built-in-family checkpoint for the engine. Build with :meth:`from_pretrained`."""

    model_config: ModelConfig

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | os.PathLike[str],
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        attention_backend: str | AttentionBackend | None = None,
    ) -> TorchRunner:
        """Load ``config.json`` and the safetensors weights of ``model_dir`` onto ``device``."""
        config = load_model_config(model_dir)
        device = torch.device(device)
        flat = load_weights(model_dir, config, device=device, dtype=dtype)
        weights = ModelWeights.from_flat(flat, config.num_hidden_layers, rename=_runner_name)
        runner = cls(
            llama_family_definition(config, device), weights, device, dtype, attention_backend
        )
        runner.model_config = config
        return runner

    @property
    def embed_tokens(self) -> torch.Tensor:
        return self.weights.globals["embed_tokens.weight"]

    @property
    def lm_head(self) -> torch.Tensor:
        """The output projection (the embedding table itself when tied)."""
        return self.weights.globals.get("lm_head.weight", self.embed_tokens)


def llama_family_definition(config: ModelConfig, device: torch.device) -> ModelDefinition:
    """The built-in families as a :class:`ModelDefinition`: pre-norm layers of RMSNorm, GQA
    attention (window per layer) and a gated or top-k MoE MLP; one rotary table. A
    ``hidden_act`` the MLP does not compute is refused here, at load."""
    gate_activation(config.hidden_act)
    moe = None
    if config.moe is not None:
        mixtral = config.architecture == "MixtralForCausalLM"
        moe = topk_moe_block(
            MIXTRAL_EXPERT_NAMES if mixtral else ("gate_proj", "up_proj", "down_proj"),
            renormalise=config.moe.norm_topk_prob,
            num_experts_per_tok=config.moe.num_experts_per_tok,
        )
    layers = []
    for i in range(config.num_hidden_layers):
        window = config.layer_window_tokens(i)
        layers.append(
            LayerDefinition(
                index=i,
                layer_type=config.layer_types[i],
                window=window,
                decoder=prenorm_decoder_layer,
                children={
                    "input_layernorm": rms_norm_block,
                    "self_attn": gqa_attention_block,
                    "post_attention_layernorm": rms_norm_block,
                    "mlp": moe if moe and config.is_moe_layer(i) else swiglu_mlp_block,
                },
                cache=attention_cache(config.num_key_value_heads, config.head_dim, window),
            )
        )
    inv_freq, attention_scaling = hf_rope_inv_freq(config.rope, config.head_dim)
    rotary = RotaryEmbedding(inv_freq, attention_scaling, device)
    return ModelDefinition(
        name=config.model_type,
        architecture=config.architecture,
        config=config,
        vocab_size=config.vocab_size,
        head_dim=config.head_dim,
        layers=layers,
        rotary={"*": rotary},
        final_norm=rms_norm_block,
    )


def _runner_name(checkpoint_name: str) -> str:
    """Mixtral's MoE block is saved as ``block_sparse_moe``; the runner calls it ``mlp``."""
    return default_runner_name(checkpoint_name.replace(".block_sparse_moe.", ".mlp."))
