"""Rewrite a DeepSeek-V4 checkpoint saved by transformers into the layout DeepSeek ships on the
hub, and add an MTP layer: ``python make_upstream.py SRC OUT`` (or :func:`write_upstream`).

What changes (what the hub checkpoint has and ``save_pretrained`` does not write):

- tensor names in DeepSeek's ``inference/model.py`` spelling, no ``model.`` prefix
  (``layers.0.attn.wq_a.weight``, ``embed.weight``, ``norm.weight``, ``hc_head_fn``,
  ``head.weight``; FP8 ``.scale`` tensors follow their weights) — transformers renames them on
  load (``conversion_mapping.py`` "deepseek_v4");
- config.json in DeepSeek's legacy keys: ``compress_ratios`` (one per layer, then the MTP
  layer's 0), ``compress_rate_hca`` when the HCA ratio is not 128, ``num_hash_layers``,
  ``qk_rope_head_dim``, flat ``rope_scaling`` + ``compress_rope_theta`` — which
  ``DeepseekV4Config.__post_init__`` folds into ``layer_types`` / ``mlp_layer_types`` /
  ``rope_parameters``;
- ``mtp.0.*``: one next-n layer (``num_nextn_predict_layers: 1``) shaped like DeepSeek's
  ``MTPBlock`` — a sliding-window attention block and a top-k MoE (tensors shaped as the
  source's sliding and top-k MoE layers), ``e_proj`` / ``h_proj`` / ``enorm`` / ``hnorm`` /
  ``norm`` and its own ``hc_head_*`` — random (seeded) values, which transformers ignores.

The tests check it against transformers: the legacy config parses to the source's config and
``from_pretrained`` reads the rewritten tensors back to the source's weights.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

_RATIO = {"sliding_attention": 0, "compressed_sparse_attention": 4}
_HCA = "heavily_compressed_attention"
_GLOBALS = {
    "model.embed_tokens.weight": "embed.weight",
    "model.norm.weight": "norm.weight",
    "model.hc_head.hc_fn": "hc_head_fn",
    "model.hc_head.hc_base": "hc_head_base",
    "model.hc_head.hc_scale": "hc_head_scale",
}


def upstream_name(name: str) -> str:
    """A ``save_pretrained`` tensor name in DeepSeek's spelling."""
    if name in _GLOBALS:
        return _GLOBALS[name]
    return name.removeprefix("model.")


def legacy_config(config: dict) -> dict:
    """The config.json DeepSeek ships for the same model (see the module doc)."""
    out = {
        k: v
        for k, v in config.items()
        if k not in ("layer_types", "mlp_layer_types", "rope_parameters", "partial_rotary_factor")
    }
    rates = out.pop("compress_rates")
    ratios = [_RATIO[t] if t != _HCA else 128 for t in config["layer_types"]] + [
        0
    ]  # the MTP layer's entry (sliding)
    if rates["compressed_sparse_attention"] != 4:
        raise ValueError("DeepSeek's compress_ratios only spell a CSA ratio of 4")
    out["compress_ratios"] = ratios
    if rates[_HCA] != 128:
        out["compress_rate_hca"] = rates[_HCA]
    out["num_hash_layers"] = sum(t == "hash_moe" for t in config["mlp_layer_types"])
    out["qk_rope_head_dim"] = int(config["head_dim"] * config["partial_rotary_factor"])
    rope = config["rope_parameters"]
    compress = dict(rope["compress"])
    out["rope_theta"] = rope["main"]["rope_theta"]
    out["compress_rope_theta"] = compress.pop("rope_theta")
    compress.pop("partial_rotary_factor", None)
    compress.pop("attention_factor", None)  # HF sets 1.0 for YaRN itself
    if compress.get("rope_type", "default") != "default":
        compress["type"] = compress.pop("rope_type")
        out["rope_scaling"] = compress
    out["num_nextn_predict_layers"] = 1
    return out


def mtp_tensors(tensors: dict[str, torch.Tensor], config: dict, seed: int = 7) -> dict:
    """``mtp.0.*`` (upstream names): a sliding attention block (shapes of the first sliding
    layer), a top-k MoE (shapes of the first ``moe`` layer), the hyper-connection sites and
    norms, and the MTP layer's own tensors; seeded random values around the source's."""
    layer_types, mlp_types = config["layer_types"], config["mlp_layer_types"]
    attn_layer = layer_types.index("sliding_attention")
    moe_layer = mlp_types.index("moe")
    g = torch.Generator().manual_seed(seed)

    def like(t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point():
            return t.clone()
        return (t.float() + torch.randn(t.shape, generator=g) * 0.05).to(t.dtype)

    out = {}
    for name, t in tensors.items():
        for layer, parts in (
            (attn_layer, (".attn.", ".attn_norm.", ".hc_")),
            (moe_layer, (".ffn.", ".ffn_norm.")),
        ):
            prefix = f"model.layers.{layer}."
            if name.startswith(prefix) and any(p in "." + name[len(prefix) :] for p in parts):
                out["mtp.0." + name[len(prefix) :]] = like(t)
    hidden = int(config["hidden_size"])
    dtype = tensors["model.norm.weight"].dtype
    eye = torch.eye(hidden)
    out["mtp.0.e_proj.weight"] = (torch.randn(hidden, hidden, generator=g) * 0.08).to(dtype)
    out["mtp.0.h_proj.weight"] = (eye + torch.randn(hidden, hidden, generator=g) * 0.05).to(dtype)
    for norm in ("enorm", "hnorm", "norm"):
        out[f"mtp.0.{norm}.weight"] = (1 + torch.randn(hidden, generator=g) * 0.2).to(dtype)
    out["mtp.0.hc_head_fn"] = like(tensors["model.hc_head.hc_fn"])
    out["mtp.0.hc_head_base"] = like(tensors["model.hc_head.hc_base"])
    out["mtp.0.hc_head_scale"] = like(tensors["model.hc_head.hc_scale"])
    assert not any("compressor" in n or "tid2eid" in n for n in out), "MTP: sliding, top-k"
    return out


def write_upstream(src: str | Path, out: str | Path, *, seed: int = 7) -> Path:
    """Write ``src`` (a ``save_pretrained`` DeepSeek-V4 directory) to ``out`` in the hub
    layout, with an MTP layer. Other files (tokenizer, generation config) are copied."""
    src, out = Path(src), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    renamed = {upstream_name(n): t.contiguous() for n, t in tensors.items()}
    renamed.update(mtp_tensors(tensors, config, seed))
    save_file(renamed, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(legacy_config(config), indent=2) + "\n")
    for path in src.iterdir():
        if path.suffix != ".safetensors" and path.name not in ("config.json",) and path.is_file():
            if not path.name.endswith(".index.json"):
                shutil.copy(path, out / path.name)
    return out


if __name__ == "__main__":
    write_upstream(sys.argv[1], sys.argv[2])
