"""Make the tiny Qwen3-Next checkpoint (python make_tiny.py [OUT_DIR]; default /tmp/qwen3_next_src,
the committed one is ../tiny): rules in ../NOTES.md."""

import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, Qwen3NextConfig

torch.set_num_threads(1)

out = sys.argv[1] if len(sys.argv) > 1 else "/tmp/qwen3_next_src"
cfg = Qwen3NextConfig(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=24,  # 4 * 24 = 96 != hidden 64; rotary dim 24 * 0.25 = 6
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10_000_000.0,
        "partial_rotary_factor": 0.25,
    },
    linear_conv_kernel_dim=4,
    linear_key_head_dim=8,
    linear_value_head_dim=12,  # != key head dim: a k/v transposition shows
    linear_num_key_heads=2,
    linear_num_value_heads=4,  # 2 value heads per key head, as the real 16/32
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    hidden_act="silu",
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    initializer_range=0.1,
    tie_word_embeddings=False,
    attention_bias=False,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=1,
)
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
with torch.no_grad():
    for name, p in model.named_parameters():
        if name.endswith("linear_attn.A_log"):
            # HF draws A ~ U(0.01, 16): with softplus(dt) ~ 1 the state decays by up to
            # exp(-16) per token, so a state-carry bug would hide. Keep decays in ~(0.4, 0.99).
            p.copy_(torch.empty_like(p).uniform_(0.02, 0.6).log())
        elif name.endswith("linear_attn.dt_bias"):
            p.normal_(0.0, 0.5)  # init: ones
        elif name.endswith("linear_attn.norm.weight"):
            p.normal_(1.0, 0.3)  # gated RMSNorm: plain w, init ones
        elif "norm" in name:
            p.normal_(0.0, 0.3)  # Qwen3NextRMSNorm: (1 + w), init zeros
        elif name.endswith("mlp.gate.weight"):
            p.normal_(0.0, 0.5)  # router: spread the expert choice
model.save_pretrained(out)
GenerationConfig(bos_token_id=0, eos_token_id=[1, 3], pad_token_id=1).save_pretrained(out)
here = Path(__file__).resolve()
repo = here.parents[4] if len(here.parents) > 4 else Path("/work/main")
fixtures = repo / "tests" / "fixtures" / "llama"
for f in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(str(fixtures / f), f"{out}/{f}")

model.eval()
ids = torch.randint(0, 384, (1, 70), generator=torch.Generator().manual_seed(1))
with torch.no_grad():
    out_ = model(ids, output_hidden_states=True)
print("hidden max per layer", [round(float(h.abs().max()), 2) for h in out_.hidden_states])
print("logits max", float(out_.logits.abs().max()))
for i in range(3):
    la = model.model.layers[i].linear_attn
    g = -la.A_log.exp()
    print(f"layer {i} A", g.neg().tolist())
