"""A tiny random-weight checkpoint of an architecture: parity on a CPU in seconds.

Owns :func:`tiny_config` (the source config shrunk — hidden 64, 4 heads of 16, 4 experts,
vocab 384, few layers — keeping what makes the architecture itself: the layer-type pattern
(enough layers that every type and the dense/MoE split appear), MoE and MTP settings, rope
type, tied embeddings, biases, special flags) and :func:`write_tiny_checkpoint`: the HF model
built from it with seeded, rescaled random weights (as ``scripts/make_fixtures.py``: logits
spread over several units so greedy tokens are not near ties), saved with ``save_pretrained``
(so tensor names are exactly what HF writes), plus ``generation_config.json`` and the byte-level
BPE tokenizer of ``tests/fixtures`` (vocab 384; ids 0-3 are ``<|bos|>``, ``<|eos|>``,
``<|im_start|>``, ``<|im_end|>``). Everything is seeded: the same config gives the same files.
Imports torch and transformers.
"""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
from pathlib import Path
from typing import Any

import torch
import transformers

from resin.scaffold.inspect import build_meta_model, load_config

VOCAB_SIZE = 384
BOS_ID, EOS_ID, IM_END_ID = 0, 1, 3
MAX_TINY_LAYERS = 8
TINY_WINDOW = 32
SIZE_BUDGET_BYTES = 2_000_000
REPO_ROOT = Path(__file__).resolve().parents[2]
FIXTURE_TOKENIZER = REPO_ROOT / "tests" / "fixtures" / "llama"
# Width fields shrunk when present (value for the tiny model).
TINY_WIDTHS = {"hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
               "shared_expert_intermediate_size": 32, "head_dim": 16, "q_lora_rank": 32,
               "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
               "v_head_dim": 16, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
               "linear_conv_kernel_dim": 4}
EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")


def tiny_config(source: str | Path | Any, seed_layers: int = 4) -> Any:
    """The source config shrunk to a CPU-sized model of the same architecture."""
    config = load_config(source)
    raw = config.to_dict()
    num_layers = int(raw["num_hidden_layers"])
    n = _tiny_num_layers(raw, num_layers, seed_layers)
    tiny = dict(raw)
    for key, value in TINY_WIDTHS.items():
        if isinstance(raw.get(key), int):
            tiny[key] = value
    heads = int(raw["num_attention_heads"])
    kv_heads = int(raw.get("num_key_value_heads") or heads)
    tiny["num_attention_heads"] = 4   # with hidden 64: head_dim 16 when it is derived
    if "num_key_value_heads" in raw:
        tiny["num_key_value_heads"] = 4 if kv_heads == heads else (1 if kv_heads == 1 else 2)
    has_experts = False
    for key in EXPERT_COUNT_FIELDS:
        if isinstance(raw.get(key), int) and raw[key] > 0:
            tiny[key], has_experts = 4, True
    if has_experts:
        tiny["num_experts_per_tok"] = min(int(raw.get("num_experts_per_tok") or 2), 2)
        if "moe_intermediate_size" not in raw:
            tiny["intermediate_size"] = 32    # experts use intermediate_size (Mixtral, GptOss)
    for key in ("n_shared_experts", "num_shared_experts"):
        if isinstance(raw.get(key), int) and raw[key] > 1:
            tiny[key] = 1
    if isinstance(raw.get("first_k_dense_replace"), int):
        tiny["first_k_dense_replace"] = min(raw["first_k_dense_replace"], 1)
    if isinstance(raw.get("mlp_only_layers"), list):
        tiny["mlp_only_layers"] = [i for i in raw["mlp_only_layers"] if i < n]
    for key, value in raw.items():   # per-layer lists (layer_types, ...) keep their first n
        if isinstance(value, list) and len(value) == num_layers and key != "architectures":
            tiny[key] = value[:n]
    if isinstance(raw.get("sliding_window"), int) and raw["sliding_window"] > TINY_WINDOW:
        tiny["sliding_window"] = TINY_WINDOW
    tiny.update(num_hidden_layers=n, vocab_size=VOCAB_SIZE, bos_token_id=BOS_ID,
                eos_token_id=EOS_ID, pad_token_id=EOS_ID, dtype="float32")
    tiny.pop("torch_dtype", None)
    tiny.pop("transformers_version", None)
    tiny.pop("_name_or_path", None)
    model_type = tiny.pop("model_type")
    return transformers.AutoConfig.for_model(model_type, **tiny)


def write_tiny_checkpoint(source: str | Path | Any, out_dir: Path, seed: int = 1234) -> Path:
    """Save the tiny model, its generation config and tokenizer into ``out_dir``."""
    config = tiny_config(source)
    build_meta_model(config)   # fails here, naming the config, if the shrink broke it
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    reinit_weights(model, seed)
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=[EOS_ID, IM_END_ID], pad_token_id=EOS_ID)
    model.save_pretrained(out_dir, safe_serialization=True)
    _write_tokenizer(out_dir)
    size = sum(f.stat().st_size for f in out_dir.iterdir())
    if size > SIZE_BUDGET_BYTES:
        raise ValueError(f"tiny checkpoint is {size / 1e6:.2f} MB (> {SIZE_BUDGET_BYTES / 1e6} "
                         f"MB): shrink more fields in resin.scaffold.tiny_checkpoint.TINY_WIDTHS")
    return out_dir


@torch.no_grad()
def reinit_weights(model: torch.nn.Module, seed: int) -> None:
    """Seeded values at scales that keep logits apart (as scripts/make_fixtures.py)."""
    gen = torch.Generator().manual_seed(seed)
    hidden = int(model.config.hidden_size)  # type: ignore[union-attr,arg-type]
    for name, param in sorted(model.named_parameters()):
        if "norm" in name and name.endswith("weight"):
            values = 0.5 + torch.rand(param.shape, generator=gen)
        elif "embed_tokens" in name:
            values = torch.randn(param.shape, generator=gen)
        elif name.startswith("lm_head"):
            values = torch.randn(param.shape, generator=gen) * (16.0 / math.sqrt(hidden))
        elif name.endswith("bias") or param.dim() == 1:
            values = torch.randn(param.shape, generator=gen) * (0.1 if name.endswith("bias") else 0.5)
        elif param.dim() == 2:   # nn.Linear [out, in]
            values = torch.randn(param.shape, generator=gen) / math.sqrt(int(param.shape[-1]))
        else:   # fused experts: which of the last two dims is fan-in varies by model
            values = torch.randn(param.shape, generator=gen) / \
                (int(param.shape[-1]) * int(param.shape[-2])) ** 0.25
        param.copy_(values.to(param.dtype))


def _tiny_num_layers(raw: dict[str, Any], num_layers: int, seed_layers: int) -> int:
    """At least ``seed_layers``; enough that each layer type and a MoE layer appear once."""
    n = min(num_layers, seed_layers)
    types = raw.get("layer_types") or []
    for kind in dict.fromkeys(types):
        n = max(n, types.index(kind) + 1)
    if isinstance(raw.get("first_k_dense_replace"), int):
        n = max(n, min(raw["first_k_dense_replace"], 1) + 1)
    return min(n, max(MAX_TINY_LAYERS, seed_layers), num_layers)


def _write_tokenizer(out_dir: Path) -> None:
    if (FIXTURE_TOKENIZER / "tokenizer.json").is_file():
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(FIXTURE_TOKENIZER / name, out_dir / name)
        return
    # No fixtures (installed package): train the same tokenizer as scripts/make_fixtures.py.
    script = REPO_ROOT / "scripts" / "make_fixtures.py"
    spec = importlib.util.spec_from_file_location("resin_make_fixtures", script)
    if spec is None or spec.loader is None:
        raise FileNotFoundError(f"neither {FIXTURE_TOKENIZER} nor {script} exists: no tokenizer")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.train_tokenizer().save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(module.tokenizer_config(), indent=2)
                                                   + "\n")
