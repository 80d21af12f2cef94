"""Resin: a model bring-up toolkit on a headless Rust engine core.

``import resin`` loads numpy and the compiled engine core (``resin._core``) only —
never PyTorch or CUDA. Runners, the parity harness and the server import what they
need lazily.

>>> import resin
>>> resin.SamplingParams(max_tokens=4).max_tokens
4

``resin.LLM`` (the offline API, as ``vllm.LLM``) is imported on first use.
"""

from typing import Any

from resin._core import (
    BatchPlan,
    CacheGroup,
    CacheLayout,
    Engine,
    EngineConfig,
    ForwardOutput,
    InvalidOutputError,
    LayerCacheSpec,
    RequestOutput,
    SamplingArrays,
    SamplingParams,
    StepError,
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
    "InvalidOutputError",
    "LLM",
    "LayerCacheSpec",
    "RequestOutput",
    "Runner",
    "SamplingArrays",
    "SamplingParams",
    "StepError",
    "__version__",
]


def __getattr__(name: str) -> Any:
    """``resin.LLM`` on first use (``resin.llm`` needs jinja2 and tokenizers, never torch)."""
    if name == "LLM":
        from resin.llm import LLM

        return LLM
    raise AttributeError(f"module 'resin' has no attribute {name!r}")
