"""Loading Hugging Face checkpoints: ``config.json`` today.

Owns turning a checkpoint directory into what a runner and the engine need to know before
any weight is read: a frozen :class:`ModelConfig` (:mod:`resin.loading.config`), the RoPE
parameters and inverse frequencies (:mod:`resin.loading.rope`), one :class:`resin.LayerCacheSpec`
per layer, and :class:`ConfigError` for everything it rejects (:mod:`resin.loading.fields`).
Pure Python + numpy: importing this package loads neither ``transformers`` nor torch, and
``import resin`` does not import it.
"""

from resin.loading.config import (
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
    MoeConfig,
    layer_cache_specs,
    load_model_config,
)
from resin.loading.fields import ConfigError
from resin.loading.rope import SUPPORTED_ROPE_TYPES, RopeConfig, rope_inv_freq

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_ROPE_TYPES",
    "ConfigError",
    "ModelConfig",
    "MoeConfig",
    "RopeConfig",
    "layer_cache_specs",
    "load_model_config",
    "rope_inv_freq",
]
