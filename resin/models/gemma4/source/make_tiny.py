"""Make the tiny Gemma 4 checkpoint (``python make_tiny.py OUT_DIR``; the committed one is
../tiny): a ``Gemma4ForConditionalGeneration`` wrapper checkpoint as the hub ships them
(``model.language_model.*`` + one-layer vision and audio towers) whose text model has every
Gemma 4 sub-module at once; why each value, in ../NOTES.md ("The tiny checkpoint").

``text_config(**changes)`` / ``write(out, text, seed)`` are what tests/test_gemma4.py builds its
variants with (the E2B / 26B-A4B / 31B layouts).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import torch
import transformers

HERE = Path(__file__).resolve().parent
TOKENIZER = HERE.parents[2] / "scaffold" / "tiny_tokenizer"
SLIDING, FULL = "sliding_attention", "full_attention"


def text_config(**changes: Any) -> dict[str, Any]:
    """The tiny text config: 7 layers, two full; the last 3 reuse the K/V of layers 2 (full) and
    3 (sliding); MoE branch, per-layer embeddings, double-wide shared MLPs, K = V full layers."""
    out: dict[str, Any] = {
        "model_type": "gemma4_text",
        "vocab_size": 384,
        "vocab_size_per_layer_input": 384,
        "hidden_size": 48,  # sqrt(48) is not exact in bf16 (the embedding scale)
        "intermediate_size": 64,
        "num_hidden_layers": 7,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,  # 4 x 16 != 48
        "global_head_dim": 24,  # 1 KV head x 24 != 2 x 16: no shape rule confirms by chance
        "num_global_key_value_heads": 1,
        "attention_k_eq_v": True,
        "num_kv_shared_layers": 3,
        "use_double_wide_mlp": True,
        "hidden_size_per_layer_input": 8,  # sqrt(8) is not exact either
        "enable_moe_block": True,
        "num_experts": 4,
        "top_k_experts": 2,
        "moe_intermediate_size": 16,
        "layer_types": [SLIDING, SLIDING, FULL, SLIDING, FULL, SLIDING, FULL],
        "sliding_window": 8,  # < the 70-token probe prompt
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": 3.0,  # pre-cap logits reach |5|: the cap bends them
        "rope_parameters": {
            SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
            FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
        },
        "tie_word_embeddings": True,
        "initializer_range": 0.1,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 1,
    }
    out.update(changes)
    return out


def wrapper_config(text: dict[str, Any]) -> Any:
    """Gemma4Config around ``text`` with one-layer vision and audio towers (tiny widths)."""
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "position_embedding_size": 64,
    }
    audio = {
        "hidden_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "subsampling_conv_channels": [8, 4],
        "output_proj_dims": 32,
    }
    return transformers.Gemma4Config(
        text_config=text,
        vision_config=vision,
        audio_config=audio,
        tie_word_embeddings=text.get("tie_word_embeddings", True),
        image_token_id=380,
        video_token_id=381,
        audio_token_id=382,
        boi_token_id=378,
        eoi_token_id=379,
        boa_token_id=376,
        eoa_token_index=377,
    )


def randomise(model: torch.nn.Module, seed: int) -> None:
    """Weights HF initialises to ones (every Gemma4RMSNorm scale, the router's scales, the
    layers' ``layer_scalar``) drawn around 1, so a block that drops one shows in parity."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if not name.startswith("model.language_model."):
                continue
            if name.endswith(("norm.weight", "router.scale", "per_expert_scale", "layer_scalar")):
                tensor.copy_(1.0 + 0.3 * torch.randn(tensor.shape, generator=gen))


def write(out: str | Path, text: dict[str, Any], seed: int = 0) -> Path:
    """Save a random-weight wrapper checkpoint of ``text`` (fp32) with the tiny tokenizer."""
    out = Path(out)
    torch.manual_seed(seed)
    model = transformers.Gemma4ForConditionalGeneration(wrapper_config(text)).eval()
    randomise(model, seed)
    model.save_pretrained(out)
    transformers.GenerationConfig(
        bos_token_id=0, eos_token_id=[1, 3], pad_token_id=1
    ).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(TOKENIZER / name, out / name)
    return out


if __name__ == "__main__":
    torch.set_num_threads(1)
    write(sys.argv[1] if len(sys.argv) > 1 else HERE.parent / "tiny", text_config())
