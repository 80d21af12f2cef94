"""Make the tiny Gemma 3 checkpoint (python make_tiny.py OUT_DIR [SOFTCAP]; the committed one
is ../tiny): rules in ../NOTES.md."""

import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig, GenerationConfig

torch.set_num_threads(1)

out = sys.argv[1] if len(sys.argv) > 1 else "/tmp/gemma3_src"
CAP = float(sys.argv[2]) if len(sys.argv) > 2 else 3.0
cfg = Gemma3TextConfig(
    vocab_size=384,
    hidden_size=80,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,  # 4*16=64 != hidden 80
    hidden_activation="gelu_pytorch_tanh",
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=1,
    tie_word_embeddings=True,
    initializer_range=0.1,
    query_pre_attn_scalar=24,  # != head_dim 16
    sliding_window=8,  # < 70-token prompt
    layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
    },
    final_logit_softcapping=CAP,
    attn_logit_softcapping=None,
    attention_bias=False,
)
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
with torch.no_grad():
    for name, p in model.named_parameters():
        if "norm" in name:
            p.normal_(0.0, 0.3)
model.save_pretrained(out)
GenerationConfig(bos_token_id=0, eos_token_id=[1, 3], pad_token_id=1).save_pretrained(out)
for f in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(
        str(Path(__file__).resolve().parents[4] / "tests" / "fixtures" / "llama" / f), f"{out}/{f}"
    )

# how far do the logits reach before the cap?
model.eval()
ids = torch.randint(0, 384, (1, 70), generator=torch.Generator().manual_seed(1))
acts = {}
model.lm_head.register_forward_hook(lambda m, i, o: acts.__setitem__("pre", o))
with torch.no_grad():
    logits = model(ids).logits
pre = acts["pre"]
print(
    f"pre-cap |logit| max {pre.abs().max():.3f}, p99 {pre.abs().flatten().quantile(0.99):.3f}; "
    f"capped max {logits.abs().max():.3f} (cap {CAP:.1f})"
)
print("embed_scale", model.model.embed_tokens.embed_scale)
