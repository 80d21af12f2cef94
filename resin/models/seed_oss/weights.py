"""Which tensors a seed_oss (SeedOssForCausalLM) checkpoint has by its config.

Checkpoint names are HF's: no renames. transformers builds each projection with
``bias=<flag>`` (modeling_seed_oss.py:75-77, :170-181), so the biases a layer has follow three
config flags, read by ``resin.runners.torch.model_dir.layer_tensors`` through
``CONFIG_SUBMODULES``:

- ``attention_bias`` (default and Seed-OSS-36B: true): ``self_attn.{q,k,v}_proj.bias``;
- ``attention_out_bias`` (default and Seed-OSS-36B: false): ``self_attn.o_proj.bias``;
- ``mlp_bias`` (default and Seed-OSS-36B: false): ``mlp.{gate,up,down}_proj.bias``.

architecture.json was made from Seed-OSS-36B-Instruct's config, so it records the q/k/v biases
and neither the o nor the MLP biases. ``WEIGHT_MAP`` lists those four under their own runner
names (kept as is), which makes the names known to the loader, as deepseek_v3's ``q_proj``.
The record's layer kinds lack them, so ``layer_tensors`` cannot require them when a flag is
true (it adds a configured sub-module only from a recorded kind): a checkpoint with the flag
set but the tensor missing fails at its first forward instead (``KeyError`` in
``blocks._bias``), as HF's load would report the tensor missing.
"""

from collections.abc import Callable
from typing import Any

from resin.models.seed_oss.blocks import attention_bias, attention_out_bias, mlp_bias

QKV_BIASES = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")
O_BIAS = ("self_attn.o_proj.bias",)
MLP_BIASES = ("mlp.gate_proj.bias", "mlp.up_proj.bias", "mlp.down_proj.bias")

WEIGHT_MAP: dict[str, str] = {
    f"model.layers.{{layer}}.{name}": f"layers.{{layer}}.{name}" for name in O_BIAS + MLP_BIASES
}


def _by_flag(flag: Callable[[Any], bool]) -> Callable[[Any, int], bool]:
    return lambda config, index: flag(config)


CONFIG_SUBMODULES: dict[str, Callable[[Any, int], bool]] = {
    **{name: _by_flag(attention_bias) for name in QKV_BIASES},
    **{name: _by_flag(attention_out_bias) for name in O_BIAS},
    **{name: _by_flag(mlp_bias) for name in MLP_BIASES},
}
