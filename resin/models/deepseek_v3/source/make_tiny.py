"""Make the tiny DeepSeek-V3 checkpoint (``python make_tiny.py [OUT_DIR]``; default ../tiny).

``resin new-model --tiny``'s checkpoint of ``config.json`` beside this file
(:func:`resin.scaffold.tiny_checkpoint.make_tiny_checkpoint`), then rebuilt with the settings
below, which the scaffold's shrink flattens and a runner could get wrong unseen:

- grouped routing: the scaffold caps ``n_group`` / ``topk_group`` at 1 and keeps 4 experts, so
  the group stage of ``noaux_tc`` routing would select everything. Here 8 experts in 4 groups
  of 2, the best 2 groups kept, 3 experts per token from them;
- YaRN ``mscale_all_dim`` 0.8 against ``mscale`` 1.0: DeepSeek-V3 ships both at 1.0, which makes
  YaRN's cos/sin factor exactly 1 (a runner that drops it would pass); with 0.8 both the cos /
  sin factor (1.057) and the softmax scale's ``mscale(factor, mscale_all_dim) ** 2`` (1.677)
  differ from 1;
- the MTP layer the real checkpoints ship (``num_nextn_predict_layers`` 1: ``model.layers.{N}.*``
  with ``embed_tokens``, ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.{norm,head}`` and a MoE
  decoder layer), which HF's ``DeepseekV3ForCausalLM`` never builds (it loads the checkpoint and
  leaves the layer unused); Resin drafts with it (``--speculative-method mtp``). Its
  ``embed_tokens`` and ``shared_head.head`` are copies of the target's ``embed_tokens`` /
  ``lm_head``, as in DeepSeek's checkpoints ("shared with the main model"); its norms, ``eh_proj``
  and decoder layer are seeded random values.

Weights and routing buffers are the scaffold's (``reinit_weights`` / ``reinit_routing_buffers``,
same seed); every change is a line of ``CHANGES.md``.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file

from resin.scaffold.tiny_checkpoint import (
    BOS_ID,
    CHANGES_FILE,
    EOS_ID,
    IM_END_ID,
    TINY_TOKENIZER,
    make_tiny_checkpoint,
    reinit_routing_buffers,
    reinit_weights,
    write_changes,
)

HERE = Path(__file__).resolve().parent
SEED = 1234
OVERRIDES = {
    "n_routed_experts": 8,
    "n_group": 4,
    "topk_group": 2,
    "num_experts_per_tok": 3,
}
ROPE_OVERRIDES = {"mscale": 1.0, "mscale_all_dim": 0.8}


def build(config: dict, num_layers: int, seed: int) -> torch.nn.Module:
    cfg = transformers.AutoConfig.for_model(**{**config, "num_hidden_layers": num_layers})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    reinit_weights(model, seed)
    return model


def mtp_tensors(
    config: dict, seed: int, target: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``model.layers.{N}.*``: a decoder layer of an (N + 1)-layer model, in the checkpoint's
    names (``save_pretrained``'s: one tensor per expert, not HF's in-memory fused
    ``experts.gate_up_proj``), plus the next-n head; ``embed_tokens`` / ``shared_head.head``
    copy the ``target`` checkpoint's embedding and ``lm_head``."""
    n = int(config["num_hidden_layers"])
    model = build(config, n + 1, seed)
    reinit_routing_buffers(model, seed)
    prefix = f"model.layers.{n}."
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        saved = load_file(str(Path(tmp) / "model.safetensors"))
    out = {k: v.clone() for k, v in saved.items() if k.startswith(prefix)}
    gen = torch.Generator().manual_seed(seed)
    hidden = int(config["hidden_size"])
    out[prefix + "embed_tokens.weight"] = target["model.embed_tokens.weight"].clone()
    out[prefix + "enorm.weight"] = 0.5 + torch.rand(hidden, generator=gen)
    out[prefix + "hnorm.weight"] = 0.5 + torch.rand(hidden, generator=gen)
    out[prefix + "eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=gen) / 11.3
    out[prefix + "shared_head.norm.weight"] = 0.5 + torch.rand(hidden, generator=gen)
    out[prefix + "shared_head.head.weight"] = target["lm_head.weight"].clone()
    return out


def write_checkpoint(config: dict, out: Path, seed: int = SEED, mtp: bool = True) -> list[str]:
    """``config`` (a tiny config.json dict) as a checkpoint in ``out``: the scaffold's seeded
    weights and routing buffers, its generation config and tokenizer, and with ``mtp`` the next-n
    layer's tensors. Returns the routing-buffer lines (also for variants: tests/test_deepseek_v3.py)."""
    out.mkdir(parents=True, exist_ok=True)
    model = build(config, int(config["num_hidden_layers"]), seed)
    lines = reinit_routing_buffers(model, seed)
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=[EOS_ID, IM_END_ID], pad_token_id=EOS_ID
    )
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(TINY_TOKENIZER / name, out / name)
    if mtp:
        tensors = load_file(str(out / "model.safetensors"))
        extra = mtp_tensors(config, seed + 7, tensors)
        tensors.update(extra)
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        lines.append(
            f"make_tiny.py: MTP layer model.layers.{config['num_hidden_layers']}.* added "
            f"({len(extra)} tensors, named as DeepSeek-V3 ships them: one per expert, embed_tokens "
            "and shared_head.head copies of the target's; HF's class leaves the layer unused, "
            "Resin drafts with it)"
        )
    return lines


def main(out: Path) -> None:
    lines = make_tiny_checkpoint(HERE / "config.json", out, seed=SEED).changes
    config = json.loads((out / "config.json").read_text())
    for key, value in OVERRIDES.items():
        lines.append(f"make_tiny.py: {key} {config.get(key)} -> {value}")
        config[key] = value
    rope = dict(config["rope_parameters"])
    for key, value in ROPE_OVERRIDES.items():
        if rope.get(key) != value:
            lines.append(f"make_tiny.py: rope_parameters.{key} {rope.get(key)} -> {value}")
        rope[key] = value
    config["rope_parameters"] = rope
    lines = [line for line in lines if not line.startswith("buffer:")]
    lines += write_checkpoint(config, out)
    write_changes(out / CHANGES_FILE, lines)
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"{out}: {size / 1e6:.2f} MB")
    for line in lines:
        print(" ", line)


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE.parent / "tiny")
