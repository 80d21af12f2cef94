"""Checkpoints the GPU check makes on the machine it runs on (benchmarks/gpu_check.sh).

``python make_checkpoint.py KIND OUT_DIR [--device cpu|cuda] [--set key=value ...]``

- ``tiny-llama``: a random-weight ``LlamaForCausalLM`` saved with transformers
  (``save_pretrained``: HF's own tensor names, so the parity harness's HF reference loads it):
  2 layers, hidden 256, 4 query heads / 2 KV heads of head_dim 128 (a head dim FlashInfer has
  kernels for; the CPU fixtures' 16 has none), vocab 384;
- ``tiny-mistral``: the same shape as a ``MistralForCausalLM`` with a 24-token sliding window
  (the parity prompts reach 70 tokens, so the window cuts);
- ``llama-8b``: Llama-3-8B's shape (hidden 4096, 32 layers, 32 / 8 heads of 128, MLP 14336,
  vocab 128256, bf16) with random weights, for ``resin bench``: no transformers, no model
  object — each tensor Resin's loader expects (:func:`resin.loading.weights.expected_tensor_shapes`)
  is drawn on ``--device`` (cuda: seconds for 16 GB) and written as safetensors shards of about
  4 GB with their ``model.safetensors.index.json``. ``--set`` overrides config keys
  (``--set num_hidden_layers=2 --set hidden_size=256 ...``: the same maker at a scale a CPU
  test can run).

Weights: projections ``N(0, 1 / fan_in)`` (activations stay O(1) through the stack, so bf16
sums neither overflow nor vanish), norms 1, embeddings ``N(0, 1)``. Seeded.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "torch_dtype": "bfloat16",
}
TINY = {
    "vocab_size": 384,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "max_position_embeddings": 512,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 1,
}
SHARD_BYTES = 4 << 30
KINDS = ("tiny-llama", "tiny-mistral", "llama-8b")


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def make_tiny(kind: str, out: Path, overrides: dict[str, Any]) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    if kind == "tiny-llama":
        config = transformers.LlamaConfig(**{**TINY, **overrides})
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.MistralConfig(**{**TINY, "sliding_window": 24, **overrides})
        model = transformers.MistralForCausalLM(config)
    with torch.no_grad():  # logits spread over a few units: greedy tokens are not near ties
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.uniform_(0.5, 1.5)
            elif "embed_tokens" in name:
                param.normal_(0.0, 1.0)
            else:
                param.normal_(0.0, (1.0 if "lm_head" not in name else 16.0) / param.shape[1] ** 0.5)
    model.save_pretrained(out)


def make_llama_8b(out: Path, device: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """Write config.json and random bf16 shards; return a summary (tensors, bytes, seconds)."""
    import torch
    from safetensors.torch import save_file

    from resin.loading import load_model_config
    from resin.loading.weights import expected_tensor_shapes

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(
            "make_checkpoint llama-8b --device cuda: no CUDA device (torch.cuda.is_available() "
            "is False); pass --device cpu to draw the weights on the CPU (slow at full size)"
        )
    started = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    raw = {**LLAMA_8B, **overrides}
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    shapes = expected_tensor_shapes(load_model_config(out))
    generator = torch.Generator(device=device).manual_seed(0)
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    shard_bytes, total_bytes, names = 0, 0, list(shapes)

    def flush() -> None:
        nonlocal shard, shard_bytes
        if shard:
            path = out / f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
            save_file({k: v.cpu() for k, v in shard.items()}, str(path), metadata={"format": "pt"})
            for name in shard:
                weight_map[name] = path.name
            shard, shard_bytes = {}, 0

    for name in names:
        shape = shapes[name]
        if len(shape) == 1:
            tensor = torch.ones(shape, dtype=torch.bfloat16, device=device)
        else:
            std = 1.0 if "embed_tokens" in name else shape[1] ** -0.5
            tensor = torch.empty(shape, dtype=torch.bfloat16, device=device)
            tensor.normal_(0.0, std, generator=generator)
        size = tensor.numel() * tensor.element_size()
        if shard and shard_bytes + size > SHARD_BYTES:
            flush()
        shard[name] = tensor
        shard_bytes += size
        total_bytes += size
    flush()
    index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return {
        "tensors": len(names),
        "bytes": total_bytes,
        "shards": len(set(weight_map.values())),
        "seconds": round(time.perf_counter() - started, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=KINDS)
    parser.add_argument("out", type=Path)
    parser.add_argument("--device", default="cuda", help="llama-8b: where weights are drawn")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="config override"
    )
    args = parser.parse_args(argv)
    overrides = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--set {item!r}: expected KEY=VALUE")
        overrides[key] = _value(value)
    if args.kind == "llama-8b":
        summary = make_llama_8b(args.out, args.device, overrides)
        print(f"{args.kind}: {summary} -> {args.out}")
    else:
        make_tiny(args.kind, args.out, overrides)
        print(f"{args.kind}: -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
