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
  ``model.layers.{N}.*`` with ``embed_tokens``, ``enorm``, ``hnorm``, ``eh_proj``,
  ``shared_head.{norm,head}`` and a MoE decoder layer, DeepSeek-V3's names), which HF's
  ``Glm4MoeForCausalLM`` never builds: both sides must load the checkpoint with it and leave it
  unused.

Weights, routing buffers and the MTP layer are deepseek_v3's ``source/make_tiny.py``'s
(imported; same seed); every change is a line of ``CHANGES.md``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from resin.models.deepseek_v3.source.make_tiny import write_checkpoint
from resin.scaffold.tiny_checkpoint import CHANGES_FILE, make_tiny_checkpoint, write_changes

HERE = Path(__file__).resolve().parent
SEED = 1234
OVERRIDES = {
    "head_dim": 32,
    "n_routed_experts": 8,
    "n_group": 4,
    "topk_group": 2,
    "num_experts_per_tok": 3,
    "moe_intermediate_size": 16,
}


def write_glm_checkpoint(config: dict, out: Path, mtp: bool = True) -> list[str]:
    """``config`` (a tiny config.json dict) as a checkpoint in ``out`` (deepseek_v3's
    ``write_checkpoint``: seeded weights and routing buffers, tokenizer, the MTP layer).
    Returns its CHANGES.md lines (also for variants: tests/test_glm4_moe.py)."""
    lines = write_checkpoint(config, out, SEED, mtp)
    return [line.replace("as DeepSeek-V3 ships it", "as GLM-4.5 ships it") for line in lines]


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
