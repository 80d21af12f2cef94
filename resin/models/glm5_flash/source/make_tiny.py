"""Make the tiny GLM-5.3-Flash checkpoint (python make_tiny.py [OUT_DIR]; default /tmp/glm5_tiny,
the committed one is ../tiny): ``config.json`` beside this file (the source config, tiny dims,
every layer / MLP / indexer type), HF's own text model (``hf_text_lm``), degenerate inits
randomised (rules in ../NOTES.md). The written config.json is the *flat* form of the real
checkpoint (``model_type`` glm5_next, ``architectures`` Glm5NextForConditionalGeneration)."""

import json
import shutil
import sys
from pathlib import Path

import torch

here = Path(__file__).resolve().parent
sys.path.insert(0, str(here))
import hf_text_lm  # noqa: E402
from transformers import GenerationConfig  # noqa: E402
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextConfig  # noqa: E402

torch.set_num_threads(1)
out = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/glm5_tiny")
raw = json.loads((here / "config.json").read_text())
raw.pop("model_type")
raw.pop("architectures")
raw.update(initializer_range=0.1, swiglu_limit=1.0, hc_sinkhorn_iters=5)
cfg = Glm5NextConfig(**raw)  # flat: folded into text_config
cfg._attn_implementation = "eager"
torch.manual_seed(0)
model = hf_text_lm.Glm5FlashTextForCausalLM(cfg).eval()
with torch.no_grad():
    for name, p in model.named_parameters():
        if name.endswith("forget_gate.A_log"):
            p.normal_(0.0, 0.5)  # init zeros (with the lower bound): decay rate exp(0) = 1
        elif name.endswith("forget_gate.dt_bias"):
            p.normal_(0.0, 0.5)
        elif name.endswith(("hc.base",)):
            p.normal_(0.0, 0.5)  # init zeros
        elif name.endswith(("hc.scale",)):
            p.normal_(1.0, 0.2)  # init ones
        elif name.endswith("hc.fn"):
            p.normal_(0.0, 0.1)
        elif name.endswith("index_kpool_compress_ape"):
            p.normal_(0.0, 0.5)  # init zeros
        elif name.endswith("index_kpool_compress_gate"):
            p.normal_(0.0, 0.3)  # init ones: every channel the same gate
        elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            p.normal_(1.0, 0.2)  # init ones (plain w)
        elif name.endswith("k_norm.bias"):
            p.normal_(0.0, 0.2)  # indexer LayerNorm bias, init zeros
        elif name.endswith("mlp.gate.weight"):
            p.normal_(0.0, 0.5)  # router: spread the expert choice
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.normal_(0.0, 0.2)
model.save_pretrained(out)
conf = json.loads((out / "config.json").read_text())
text = conf.pop("text_config", None)
flat = {**(text or {}), **{k: v for k, v in conf.items() if k not in ("vision_config",)}}
flat.pop("text_config", None)
flat["model_type"] = "glm5_next"
flat["architectures"] = ["Glm5NextForConditionalGeneration"]
(out / "config.json").write_text(json.dumps(flat, indent=2, sort_keys=True) + "\n")
GenerationConfig(bos_token_id=0, eos_token_id=[1, 3], pad_token_id=1).save_pretrained(out)
repo = here.parents[3]
for f in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(str(repo / "tests" / "fixtures" / "llama" / f), str(out / f))

ids = torch.randint(0, 384, (1, 70), generator=torch.Generator().manual_seed(1))
with torch.no_grad():
    o = model.model(ids, output_hidden_states=True)
    logits = model(ids).logits
print("hidden max per layer", [round(float(h.abs().max()), 2) for h in o.hidden_states])
print("logits max", float(logits.abs().max()))
