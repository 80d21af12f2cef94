"""Give a GLM-5.3-Flash checkpoint an MTP layer as the real one ships it (NOTES.md "MTP"):
``python make_mtp.py SRC OUT`` copies SRC (default ../tiny) to OUT with ``num_nextn_predict_layers``
1 in its config.json and the tensors of layer ``num_hidden_layers`` — an indexed-attention layer
with its own k-pool indexer and a routed MoE, no hyper-connections (``hc_*``), plus ``eh_proj``
[D, 2D], ``enorm``, ``hnorm`` and ``shared_head.norm`` — seeded random values, each shaped as the
stack's indexed / sparse layer's tensor of the same name (the tiny's first such layer). HF's
``Glm5Next*`` builds no MTP layer and ignores these tensors, so OUT's target model is SRC's
(parity unchanged); Resin loads them as the drafter (``--speculative-method mtp``)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

HERE = Path(__file__).resolve().parent
SEED = 5301
HC = ("hc_attn_", "hc_ffn_")


def _template_layer(config: dict, tensors: dict[str, torch.Tensor]) -> int:
    """The first stack layer that is indexed, runs its own indexer and has a routed MoE."""
    for i, (kind, mlp) in enumerate(zip(config["layer_types"], config["mlp_layer_types"])):
        full = config.get("indexer_types", ["full"] * (i + 1))[i] == "full"
        if kind == "indexed_attention" and mlp == "sparse" and full:
            return i
    raise ValueError("no indexed / full-indexer / sparse layer to shape the MTP layer on")


def _random(like: torch.Tensor, name: str, gen: torch.Generator) -> torch.Tensor:
    """Seeded values of ``like``'s shape: norm weights near 1, biases and the rest ~N(0, 0.1)
    (the tiny's init scale), the router's correction bias small."""
    noise = torch.randn(like.shape, generator=gen, dtype=torch.float32)
    if name.endswith("norm.weight"):
        return (1.0 + 0.1 * noise).to(like.dtype)
    return (0.1 * noise).to(like.dtype)


def write_mtp(src: Path, out: Path) -> Path:
    """OUT = SRC with one MTP layer (module doc); returns OUT."""
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy(f, out / f.name)
    config = json.loads((src / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tensors = load_file(str(src / "model.safetensors"))
    n, hidden = int(config["num_hidden_layers"]), int(config["hidden_size"])
    template = f"model.layers.{_template_layer(config, tensors)}."
    gen = torch.Generator().manual_seed(SEED)
    mtp = f"model.layers.{n}."
    dtype = tensors["model.norm.weight"].dtype
    for name in sorted(tensors):
        rest = name[len(template) :]
        if name.startswith(template) and not rest.startswith(HC):
            tensors[mtp + rest] = _random(tensors[name], rest, gen)
    for rest, shape in (
        ("eh_proj.weight", (hidden, 2 * hidden)),
        ("enorm.weight", (hidden,)),
        ("hnorm.weight", (hidden,)),
        ("shared_head.norm.weight", (hidden,)),
    ):
        tensors[mtp + rest] = _random(torch.empty(shape, dtype=dtype), rest, gen)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


if __name__ == "__main__":
    src = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE.parent / "tiny"
    write_mtp(src, Path(sys.argv[2]) if len(sys.argv) > 2 else Path("/tmp/glm5_tiny_mtp"))
