"""Write the tiny DeepSeek-V4 checkpoint in the format the real one ships in
(``resin/models/deepseek_v4_flash/tiny_fp8/``), from the fp32 tiny one (``../tiny``).

Dev-only (torch + safetensors; no transformers); the output is committed, so tests never run
this. Deterministic: running it twice writes identical files.

What is quantised follows DeepSeek-V4-Flash as transformers loads it
(``FineGrainedFP8Config``; ``DeepseekV4PreTrainedModel._keep_in_fp32_modules`` lists the
compressor / indexer projections that ship in BF16 without a scale):

- FP8 e4m3, one ue8m0 scale per ``weight_block_size`` block (named ``<module>.scale`` as
  V4-Flash names them; V3 uses ``<module>.weight_scale_inv``): the attention projections
  ``attn.wq_a``, ``attn.wq_b``, ``attn.wkv``, ``attn.wo_a``, ``attn.wo_b``, the indexer's
  ``attn.indexer.wq_b`` and the shared expert ``ffn.shared_experts.w1 / w2 / w3``;
- FP4 e2m1 packed two per byte (``int8``, element 2k in the low nibble), one ue8m0 scale per
  1 x 32 block: the routed experts ``ffn.experts.{e}.w1 / w2 / w3`` (``expert_dtype`` fp4);
- everything else as in ``tiny/`` (fp32): embeddings, ``head``, norms, router ``gate`` (and
  its ``bias`` / ``tid2eid``), the compressors' ``wkv`` / ``wgate``, ``indexer.weights_proj``,
  hyper-connection tensors, ``attn_sink``, ``ape``.

``weight_block_size`` is [32, 32] instead of the real [128, 128]: at 128 every tiny matrix
would be one (partial) block; at 32 the 64-wide ones have several blocks and ``attn.wkv``
(16 rows) a partial one. Scales are powers of two (ue8m0: the smallest 2^k with
``amax / 2^k <= 448`` for FP8, ``<= 6`` for FP4), stored as ``float8_e8m0fnu``. The tiny
weights are i.i.d., so every block of a matrix would get the same power of two and a loader
applying the wrong block's scale would go unnoticed: before quantising, each FP8 block
(bi, bj) is multiplied by ``2 ** ((bi + bj) % 2)`` (exact: it only moves the scale), so
neighbouring blocks' scales differ by 2. The FP4 groups' scales differ already.

Usage: ``python scripts/make_tiny_fp8.py [--src DIR] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "resin" / "models" / "deepseek_v4_flash"
BLOCK = (32, 32)
FP4_GROUP = 32
FP8_MAX = 448.0
FP4_MAX = 6.0
FP4_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
FP8_LINEAR = re.compile(
    r"\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)\.weight$|\.ffn\.shared_experts\.w[123]\.weight$"
)
FP4_EXPERT = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")
QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": list(BLOCK),
    "scale_fmt": "ue8m0",
    "expert_dtype": "fp4",
}
COPIED = ("generation_config.json", "tokenizer.json", "tokenizer_config.json")


def power_of_two_scale(amax: torch.Tensor, limit: float) -> torch.Tensor:
    """The smallest 2^k with amax / 2^k <= limit (1 for an all-zero block)."""
    safe = torch.where(amax > 0, amax / limit, torch.ones_like(amax))
    return torch.exp2(torch.ceil(torch.log2(safe)))


def block_amax(weight: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Max |w| per (block rows x block cols) tile, edge tiles partial."""
    rows, cols = weight.shape
    nr, nc = -(-rows // block[0]), -(-cols // block[1])
    padded = torch.zeros(nr * block[0], nc * block[1])
    padded[:rows, :cols] = weight.abs()
    return padded.reshape(nr, block[0], nc, block[1]).amax(dim=(1, 3))


def expand(scale: torch.Tensor, block: tuple[int, int], shape: torch.Size) -> torch.Tensor:
    out = scale.repeat_interleave(block[0], 0)[: shape[0]]
    return out.repeat_interleave(block[1], 1)[:, : shape[1]]


def block_spread(shape: torch.Size) -> torch.Tensor:
    """``2 ** ((bi + bj) % 2)`` for the element's BLOCK tile (bi, bj)."""
    rows = torch.arange(shape[0]) // BLOCK[0]
    cols = torch.arange(shape[1]) // BLOCK[1]
    return torch.exp2(((rows[:, None] + cols[None, :]) % 2).float())


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float8_e8m0fnu scale per BLOCK tile)."""
    scale = power_of_two_scale(block_amax(weight, BLOCK), FP8_MAX)
    q = (weight / expand(scale, BLOCK, weight.shape)).clamp(-FP8_MAX, FP8_MAX)
    return q.to(torch.float8_e4m3fn), scale.to(torch.float8_e8m0fnu)


def quantize_fp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight, two e2m1 codes per byte, element 2k low nibble; float8_e8m0fnu scale per
    1 x 32 group)."""
    scale = power_of_two_scale(block_amax(weight, (1, FP4_GROUP)), FP4_MAX)
    q = weight / expand(scale, (1, FP4_GROUP), weight.shape)
    magnitude = (q.abs().unsqueeze(-1) - FP4_MAGNITUDES).abs().argmin(dim=-1)
    codes = magnitude | torch.where((q < 0) & (magnitude > 0), 8, 0)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    return packed.view(torch.int8), scale.to(torch.float8_e8m0fnu)


def convert(src: Path, out: Path) -> dict[str, float]:
    """Write ``out`` from ``src``; per-kind max |dequantised - original| / max |original|
    (FP8: against the spread original)."""
    tensors = load_file(str(src / "model.safetensors"))
    written: dict[str, torch.Tensor] = {}
    errors = {"fp8": 0.0, "fp4": 0.0}
    for name in sorted(tensors):
        weight = tensors[name]
        if FP8_LINEAR.search(name):
            weight = weight * block_spread(weight.shape)
            kind, (q, scale) = "fp8", quantize_fp8(weight)
            back = q.float() * expand(scale.float(), BLOCK, weight.shape)
        elif FP4_EXPERT.search(name):
            kind, (q, scale) = "fp4", quantize_fp4(weight)
            raw = q.view(torch.uint8).long()
            table = torch.cat([FP4_MAGNITUDES, -FP4_MAGNITUDES])
            values = torch.stack([table[raw & 15], table[raw >> 4]], -1).reshape(weight.shape)
            back = values * expand(scale.float(), (1, FP4_GROUP), weight.shape)
        else:
            written[name] = weight
            continue
        written[name] = q
        written[name.removesuffix(".weight") + ".scale"] = scale
        rel = float((back - weight).abs().max() / weight.abs().max())
        errors[kind] = max(errors[kind], rel)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    save_file(written, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text(encoding="utf-8"))
    config["quantization_config"] = QUANTIZATION_CONFIG
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    for name in COPIED:
        shutil.copy(src / name, out / name)
    return errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--src", type=Path, default=MODEL / "tiny")
    parser.add_argument("--out", type=Path, default=MODEL / "tiny_fp8")
    args = parser.parse_args()
    errors = convert(args.src, args.out)
    size = sum(f.stat().st_size for f in args.out.iterdir())
    print(f"wrote {args.out} ({size:,} bytes); max relative error {errors}")


if __name__ == "__main__":
    main()
