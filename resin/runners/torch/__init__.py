"""Torch runners: the shared paged runner and what models build on it.

- :class:`PagedRunner` (:mod:`.paged_runner`): plan plumbing, paged caches, weights, parity
  capture and sampling for any :class:`ModelDefinition`;
- :class:`TorchRunner` (:mod:`.runner`): the built-in families (Llama, Mistral, Qwen2, Qwen3,
  Qwen3-MoE, Mixtral) on it; :class:`ModelDirRunner` (:mod:`.model_dir`): model directories made
  by ``resin new-model``;
- what a model's ``blocks.py`` uses: :class:`LayerContext` (:mod:`.context`), :class:`LayerCache`
  (:mod:`.model_definition`), the attention backends (:mod:`.attention`), the shared blocks
  (:mod:`.blocks`) and the plain-torch layers (:mod:`.layers`).

Imports torch; ``import resin`` does not import this package.
"""

from resin.runners.torch.attention import AttentionBackend, ReferenceBackend, RowHistory
from resin.runners.torch.context import LayerContext
from resin.runners.torch.model_definition import (
    LayerCache,
    LayerDefinition,
    ModelDefinition,
    attention_cache,
)
from resin.runners.torch.model_dir import ModelDirRunner
from resin.runners.torch.paged_runner import PagedRunner
from resin.runners.torch.runner import TorchRunner

__all__ = [
    "AttentionBackend",
    "LayerCache",
    "LayerContext",
    "LayerDefinition",
    "ModelDefinition",
    "ModelDirRunner",
    "PagedRunner",
    "ReferenceBackend",
    "RowHistory",
    "TorchRunner",
    "attention_cache",
]
