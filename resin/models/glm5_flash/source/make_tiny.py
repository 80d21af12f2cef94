"""Make the tiny GLM-5.3-Flash checkpoint (python make_tiny.py [OUT_DIR]; default /tmp/glm5_tiny,
the committed one is ../tiny): ``config.json`` beside this file (the source config, tiny dims,
every layer / MLP / indexer type), HF's own text model (``hf_text_lm``), degenerate inits
randomised (rules in ../NOTES.md). The written config.json is the *flat* form of the real
checkpoint (``model_type`` glm5_next, ``architectures`` Glm5NextForConditionalGeneration).

The tokenizer is the fixture byte-level BPE of ``tests/fixtures/llama`` (vocab 384) with GLM's
special tokens: ids 0-3 renamed (``[gMASK]``, ``<|endoftext|>`` = eos / pad, ``<|observation|>``,
``<|user|>``: GLM stops at all three), the last merges dropped to free ids for the rest
(``<sop>``, the role, think, tool-call and media tokens; the think / tool-call / argument /
tool-response markers added but not special, so decoding keeps them for the parsers), no BOS
added on encode (the template writes ``[gMASK]<sop>``), and ``chat_template.jinja`` beside this
file as its chat template."""

import json
import sys
from pathlib import Path

import torch

here = Path(__file__).resolve().parent
sys.path.insert(0, str(here))
import hf_text_lm  # noqa: E402

hf_text_lm.import_reference()  # the scaffold run builds the reference as a causal LM
from transformers import GenerationConfig  # noqa: E402
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextConfig  # noqa: E402

# GLM's special tokens; ids 0-3 take the fixture's four, the rest the ids of its last merges.
RENAMED = {0: "[gMASK]", 1: "<|endoftext|>", 2: "<|observation|>", 3: "<|user|>"}
EOS_IDS = [1, 2, 3]  # <|endoftext|>, <|observation|>, <|user|> (GLM-5.3-Flash's three)
ADDED = (
    "<sop>",
    "<|system|>",
    "<|assistant|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
    "<tool_response>",
    "</tool_response>",
    "<|begin_of_image|>",
    "<|image|>",
    "<|end_of_image|>",
    "<|begin_of_video|>",
    "<|video|>",
    "<|end_of_video|>",
    "<|begin_of_audio|>",
    "<|end_of_audio|>",
)
# Added but not special (as in GLM-4.5+ tokenizers): decoding with skip_special_tokens keeps
# them, so the reasoning and tool parsers see the model's markers in the text.
NOT_SPECIAL = {
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
    "<tool_response>",
    "</tool_response>",
}


def write_tokenizer(fixture: Path, out: Path) -> None:
    """tokenizer.json / tokenizer_config.json with GLM's special tokens (module doc)."""
    tok = json.loads((fixture / "tokenizer.json").read_text())
    model = tok["model"]
    vocab, merges = model["vocab"], model["merges"]
    size = len(vocab)
    dropped = merges[len(merges) - len(ADDED) :]
    model["merges"] = merges[: len(merges) - len(ADDED)]
    for left, right in dropped:  # the merged tokens hold the top ids: free them
        merged = left + right
        assert vocab[merged] >= size - len(ADDED), merged
        del vocab[merged]
    specials = dict(RENAMED)
    specials.update({size - len(ADDED) + i: t for i, t in enumerate(ADDED)})
    by_id = {i: t for t, i in vocab.items()}
    for i, token in specials.items():
        vocab.pop(by_id.get(i, token), None)
        vocab[token] = i
    assert sorted(vocab.values()) == list(range(size))
    tok["added_tokens"] = [
        {
            "id": i,
            "content": t,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": t not in NOT_SPECIAL,
        }
        for i, t in sorted(specials.items())
    ]
    # GLM adds no BOS: keep only the byte-level post-processor (drop the fixture's <|bos|>).
    tok["post_processor"] = next(
        p for p in tok["post_processor"]["processors"] if p["type"] == "ByteLevel"
    )
    (out / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False, indent=2) + "\n")
    config = {
        "added_tokens_decoder": {
            str(e["id"]): {k: v for k, v in e.items() if k != "id"} for e in tok["added_tokens"]
        },
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 4096,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": (here / "chat_template.jinja").read_text(),
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


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
GenerationConfig(bos_token_id=0, eos_token_id=EOS_IDS, pad_token_id=1).save_pretrained(out)
write_tokenizer(here.parents[3] / "tests" / "fixtures" / "llama", out)

ids = torch.randint(0, 384, (1, 70), generator=torch.Generator().manual_seed(1))
with torch.no_grad():
    o = model.model(ids, output_hidden_states=True)
    logits = model(ids).logits
print("hidden max per layer", [round(float(h.abs().max()), 2) for h in o.hidden_states])
print("logits max", float(logits.abs().max()))
