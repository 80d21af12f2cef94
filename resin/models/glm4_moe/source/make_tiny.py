"""Make the tiny GLM-4.5 checkpoint (``python make_tiny.py [OUT_DIR]``; default ../tiny).

``resin new-model --tiny``'s checkpoint of ``config.json`` beside this file
(:func:`resin.scaffold.tiny_checkpoint.make_tiny_checkpoint`), then rebuilt with the settings
below, which the scaffold's shrink flattens and a runner could get wrong unseen:

- ``head_dim`` 32: the shrink gives 16 = ``hidden_size / num_attention_heads``, so a runner
  that derives the head size instead of reading ``head_dim`` would pass (GLM-4.5: 128 against
  5120 / 96); with 32 the projections are wider than the hidden size and 16 channels rotate;
- grouped routing: the scaffold keeps 4 experts in one group, so the group stage of
  ``noaux_tc`` routing would select everything. Here 8 experts in 4 groups of 2, the best 2
  groups kept, 3 experts per token from them (GLM-4.5 ships one group: a variant in
  tests/test_glm4_moe.py); experts 16 wide (the scaffold's 32) to keep the checkpoint, with
  twice the experts and the MTP layer, under the scaffold's 2 MB;
- the MTP layer the real checkpoints ship (``num_nextn_predict_layers`` 1:
  ``model.layers.{N}.*``: a MoE decoder layer with per-expert tensor names, as GLM-4.5's
  safetensors have them, plus ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` and
  GLM-4.5's copies of the target's embedding and head, ``embed_tokens`` / ``shared_head.head``;
  :func:`mtp_layer_tensors`), which HF's ``Glm4MoeForCausalLM`` never builds (it leaves the
  layer unused); Resin drafts with it (``--speculative-method mtp``, blocks.py "MTP").

Weights and routing buffers of the stack are deepseek_v3's ``source/make_tiny.py``'s (imported;
same seed); the MTP layer is this file's (seeded values at the scaffold's scales, shaped as the
stack's last MoE layer); every change is a line of ``CHANGES.md``.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from resin.models.deepseek_v3.source.make_tiny import write_checkpoint
from resin.scaffold.tiny_checkpoint import CHANGES_FILE, make_tiny_checkpoint, write_changes

HERE = Path(__file__).resolve().parent
SEED = 1234
MTP_SEED = 4507
OVERRIDES = {
    "head_dim": 32,
    "n_routed_experts": 8,
    "n_group": 4,
    "topk_group": 2,
    "num_experts_per_tok": 3,
    "moe_intermediate_size": 16,
}


def _seeded(like: torch.Tensor, name: str, gen: torch.Generator) -> torch.Tensor:
    """Seeded values of ``like``'s shape at the scaffold's scales (``reinit_weights``): norm
    weights 0.5 + U(0, 1), biases N(0, 0.1), the router's correction bias N(0, 0.2) (as the
    stack's ``reinit_routing_buffers``), matrices N(0, 1 / fan_in)."""
    noise = torch.randn(like.shape, generator=gen)
    if name.endswith("norm.weight"):
        values = 0.5 + torch.rand(like.shape, generator=gen)
    elif name.endswith("e_score_correction_bias"):
        values = 0.2 * noise
    elif name.endswith("bias"):
        values = 0.1 * noise
    else:
        values = noise / math.sqrt(int(like.shape[-1]))
    return values.to(like.dtype)


def mtp_layer_tensors(config: dict, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``model.layers.{N}.*``, N = ``num_hidden_layers``: the next-n layer as GLM-4.5 ships it —
    a decoder layer named and shaped as the stack's last layer (a MoE, per-expert tensors) with
    its own seeded values, ``eh_proj`` [D, 2D], ``enorm``, ``hnorm``, ``shared_head.norm``, and
    copies of the target's ``model.embed_tokens.weight`` / ``lm_head.weight`` as
    ``embed_tokens`` / ``shared_head.head`` (GLM-4.5 ships them, GLM-4.6 does not)."""
    n, hidden = int(config["num_hidden_layers"]), int(config["hidden_size"])
    template, prefix = f"model.layers.{n - 1}.", f"model.layers.{n}."
    if f"{template}mlp.gate.weight" not in tensors:
        raise ValueError(f"layer {n - 1} is dense: no MoE layer to shape the MTP layer on")
    gen = torch.Generator().manual_seed(MTP_SEED)
    dtype = tensors["model.norm.weight"].dtype
    out = {
        prefix + name[len(template) :]: _seeded(tensors[name], name, gen)
        for name in sorted(tensors)
        if name.startswith(template)
    }
    for name, shape in (
        ("eh_proj.weight", (hidden, 2 * hidden)),
        ("enorm.weight", (hidden,)),
        ("hnorm.weight", (hidden,)),
        ("shared_head.norm.weight", (hidden,)),
    ):
        out[prefix + name] = _seeded(torch.empty(shape, dtype=dtype), name, gen)
    out[prefix + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    out[prefix + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    return out


def write_glm_checkpoint(config: dict, out: Path, mtp: bool = True) -> list[str]:
    """``config`` (a tiny config.json dict) as a checkpoint in ``out`` (deepseek_v3's
    ``write_checkpoint`` without its MTP layer: seeded weights and routing buffers, tokenizer),
    with ``mtp`` plus :func:`mtp_layer_tensors`. Returns its CHANGES.md lines (also for
    variants: tests/test_glm4_moe.py)."""
    lines = write_checkpoint(config, out, SEED, mtp=False)
    if mtp:
        tensors = load_file(str(out / "model.safetensors"))
        extra = mtp_layer_tensors(config, tensors)
        save_file({**tensors, **extra}, str(out / "model.safetensors"), metadata={"format": "pt"})
        lines.append(
            f"make_tiny.py: MTP layer model.layers.{config['num_hidden_layers']}.* added "
            f"({len(extra)} tensors, as GLM-4.5 ships it: per-expert names, embed_tokens and "
            "shared_head.head copies of the target's; HF's class leaves it unused, Resin drafts "
            "with it)"
        )
    return lines


def main(out: Path) -> None:
    lines = make_tiny_checkpoint(HERE / "config.json", out, seed=SEED).changes
    config = json.loads((out / "config.json").read_text())
    lines += [f"make_tiny.py: {key} {config.get(key)} -> {v}" for key, v in OVERRIDES.items()]
    # the routing-buffer lines are write_glm_checkpoint's (the buffers are re-seeded there)
    lines = [line for line in lines if not line.startswith("buffer:")]
    lines += write_glm_checkpoint({**config, **OVERRIDES}, out)
    write_changes(out / CHANGES_FILE, lines)
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"{out}: {size / 1e6:.2f} MB", *lines, sep="\n  ")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE.parent / "tiny")
