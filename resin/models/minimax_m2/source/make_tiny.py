"""Make the tiny MiniMax-M2 checkpoint (``python make_tiny.py [OUT_DIR]``; default ../tiny).

``resin new-model --tiny``'s checkpoint of ``config.json`` beside this file
(:func:`resin.scaffold.tiny_checkpoint.make_tiny_checkpoint`), then rebuilt with the settings
below, which the scaffold's shrink flattens and a runner could get wrong unseen:

- ``head_dim`` 32: the shrink gives 16 = ``hidden_size / num_attention_heads``, so a runner
  that derives the head size instead of reading ``head_dim`` would pass (MiniMax-M2: 128 against
  3072 / 48); with 32 the q projection (and its whole-projection ``q_norm``) is twice the hidden
  size;
- ``rotary_dim`` 8 (a quarter of the head), written as the released config.json writes it:
  ``rotary_dim`` and a top-level ``rope_theta``, no ``rope_parameters``. The scaffold keeps the
  source's ``rotary_dim`` 64 beside a ``rope_parameters`` factor of 0.5 (which HF reads first),
  so the key MiniMax's checkpoints use would go unread; with 8 of 32 a runner that rotates half
  the head (the source's ratio) or the whole head departs;
- 8 experts, top 3 (the scaffold's 4, top 2: with half the experts chosen a routing slip hides
  more easily), 16 wide to stay under the scaffold's 2 MB.

Weights and routing buffers are deepseek_v3's ``source/make_tiny.py``'s ``write_checkpoint``
(the scaffold's seeded ``reinit_weights`` / ``reinit_routing_buffers``; imported, same seed);
every change is a line of ``CHANGES.md``.
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
    "rotary_dim": 8,
    "num_local_experts": 8,
    "num_experts_per_tok": 3,
    "intermediate_size": 16,
}


def hub_spelling(config: dict) -> dict:
    """``config`` as MiniMax's config.json spells its rope: top-level ``rope_theta`` and
    ``rotary_dim``, no ``rope_parameters`` (what transformers writes on saving)."""
    out = {k: v for k, v in config.items() if k != "rope_parameters"}
    out["rope_theta"] = config["rope_parameters"]["rope_theta"]
    return out


def main(out: Path) -> None:
    lines = make_tiny_checkpoint(HERE / "config.json", out, seed=SEED).changes
    config = json.loads((out / "config.json").read_text())
    lines += [f"make_tiny.py: {key} {config.get(key)} -> {v}" for key, v in OVERRIDES.items()]
    config.update(OVERRIDES)
    config["rope_parameters"].pop("partial_rotary_factor", None)  # from rotary_dim, as HF
    # the routing-buffer lines are write_checkpoint's (the buffers are re-seeded there)
    lines = [line for line in lines if not line.startswith("buffer:")]
    lines += write_checkpoint(config, out, SEED, mtp=False)
    saved = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(hub_spelling(saved), indent=2) + "\n")
    lines.append("make_tiny.py: config.json rope as MiniMax writes it (rotary_dim, rope_theta)")
    write_changes(out / CHANGES_FILE, lines)
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"{out}: {size / 1e6:.2f} MB", *lines, sep="\n  ")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE.parent / "tiny")
