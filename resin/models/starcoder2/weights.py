"""Which tensors a starcoder2 (Starcoder2ForCausalLM) checkpoint has by its config.

Checkpoint names are HF's, so there is no ``WEIGHT_MAP``. ``CONFIG_SUBMODULES`` (read by
``resin.runners.torch.model_dir.layer_tensors``): the q / k / v / o and ``c_fc`` / ``c_proj``
biases exist only with ``use_bias`` (default true, every release; transformers builds the
projections with ``bias=config.use_bias``, modeling_starcoder2.py:56-57 and :152-155).
architecture.json records them from a source config that has them. The LayerNorm biases are
always there (``nn.LayerNorm``'s default), whatever ``use_bias`` says.
"""

from collections.abc import Callable
from typing import Any

PROJECTION_BIASES = (
    "self_attn.q_proj.bias",
    "self_attn.k_proj.bias",
    "self_attn.v_proj.bias",
    "self_attn.o_proj.bias",
    "mlp.c_fc.bias",
    "mlp.c_proj.bias",
)


def uses_bias(config: Any, index: int) -> bool:
    """``config.use_bias`` (Starcoder2Config's default: true)."""
    value = (
        config.get("use_bias") if isinstance(config, dict) else getattr(config, "use_bias", None)
    )
    return True if value is None else bool(value)


CONFIG_SUBMODULES: dict[str, Callable[[Any, int], bool]] = {
    prefix: uses_bias for prefix in PROJECTION_BIASES
}
