"""Make the tiny DeepSeek-V4 checkpoint (python make_tiny.py OUT_DIR; the committed one is ../tiny):
the research guide's verified config, degenerate initial parameters perturbed."""

import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DeepseekV4Config, GenerationConfig

CFG = dict(
    architectures=["DeepseekV4ForCausalLM"],
    vocab_size=384,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=16,
    partial_rotary_factor=0.5,
    q_lora_rank=32,
    o_groups=2,
    o_lora_rank=16,
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    scoring_func="sqrtsoftplus",
    routed_scaling_factor=1.5,
    swiglu_limit=1.0,
    layer_types=[
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
    ],
    mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    sliding_window=8,
    index_n_heads=8,
    index_head_dim=16,
    index_topk=3,
    hc_mult=4,
    hc_sinkhorn_iters=3,
    hc_eps=1e-6,
    rope_theta=10000.0,
    compress_rope_theta=160000.0,
    rope_parameters={
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    num_nextn_predict_layers=0,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=1,
)
cfg = DeepseekV4Config(**CFG)
torch.manual_seed(0)
m = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager").eval()
g = torch.Generator().manual_seed(1)
with torch.no_grad():
    for n, p in list(m.named_parameters()) + list(m.named_buffers()):
        if n.endswith("tid2eid"):
            V, k = p.shape
            p.copy_(
                torch.stack(
                    [torch.randperm(cfg.n_routed_experts, generator=g)[:k] for _ in range(V)]
                )
            )
        elif any(
            s in n
            for s in ["position_bias", "sinks", "e_score_correction_bias", ".base", "hc_base"]
        ):
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        elif any(s in n for s in [".scale", "hc_scale"]) or ("norm" in n and "weight" in n):
            p.copy_(1 + torch.randn(p.shape, generator=g) * 0.2)
        elif "inv_freq" in n:
            pass
        elif p.dtype.is_floating_point and p.ndim >= 2:
            p.copy_(torch.randn(p.shape, generator=g) * 0.08)
out = sys.argv[1] if len(sys.argv) > 1 else "/tmp/dsv4_src"
shutil.rmtree(out, ignore_errors=True)
m.save_pretrained(out)
GenerationConfig(bos_token_id=0, eos_token_id=[1, 3], pad_token_id=1).save_pretrained(out)
for f in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(str(Path(__file__).resolve().parents[4] / "tests" / "fixtures" / "llama" / f), out)
# round trip + self checks
m2 = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
ids = torch.randint(2, 384, (1, 70), generator=torch.Generator().manual_seed(3))
with torch.no_grad():
    print("reload diff", float((m2(ids).logits - m(ids).logits).abs().max()))
    print("tid2eid sample", m2.model.layers[0].mlp.gate.tid2eid[:4].tolist())
    print("sinks", m2.model.layers[1].self_attn.sinks.tolist())
