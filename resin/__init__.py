"""Resin: a model bring-up toolkit on a headless Rust engine core.

``import resin`` loads numpy and the compiled engine core (``resin._core``) only —
never PyTorch or CUDA. Runners, the parity harness and the server import what they
need lazily.

>>> import resin
>>> resin.SamplingParams(max_tokens=4).max_tokens
4
"""

from resin._core import (
    BatchPlan,
    CacheGroup,
    CacheLayout,
    Engine,
    EngineConfig,
    ForwardOutput,
    LayerCacheSpec,
    RequestOutput,
    SamplingArrays,
    SamplingParams,
    __version__,
)
from resin.runner import Runner

__all__ = [
    "BatchPlan",
    "CacheGroup",
    "CacheLayout",
    "Engine",
    "EngineConfig",
    "ForwardOutput",
    "LayerCacheSpec",
    "RequestOutput",
    "Runner",
    "SamplingArrays",
    "SamplingParams",
    "__version__",
]
