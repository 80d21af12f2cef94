"""Pool bytes of one 4,096-token GLM-5.3-Flash request on its real cache layout (full-size config,
bf16), against the formula: a length-independent KDA state per linear layer; per indexed layer
the latent per token, and on layers that run their own indexer the key / gate window and one
pooled key per ``index_kpool`` tokens. A ``shared``-indexer layer (it reuses the previous
layer's selection) holds the latent only: its declaration knows its layer index.

Drives ``benchmarks/model_cache_memory.py``'s engine run (a real :class:`resin.Engine`, one
request, prefill then one decode step) with each layer's cache declared through
``model_dir.declare_layer_cache``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from resin.runners.torch.model_dir import (  # noqa: E402
    _split_layer_cache,
    declare_layer_cache,
    default_layer_cache,
    num_kv_heads_of,
)
from resin.scaffold.layer_map import layer_types_from_config  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO / "resin" / "models" / "glm5_flash"
TOKENS = 4096


def _bench() -> Any:
    spec = importlib.util.spec_from_file_location(
        "model_cache_memory", REPO / "benchmarks" / "model_cache_memory.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _caches(config: Any, dtype: Any, with_index: bool) -> list[dict[str, Any]]:
    out = []
    for index, (layer_type, window) in enumerate(layer_types_from_config(config)):
        if with_index:
            declared = declare_layer_cache(
                default_layer_cache, index, layer_type, window, config, 0, num_kv_heads_of(config)
            )
        else:  # a caller that does not pass the index: every indexed layer declares the indexer
            declared = default_layer_cache(layer_type, window, config, 0, num_kv_heads_of(config))
        main, extra = _split_layer_cache(declared)
        for name, cache in [("main", main), *extra.items()]:
            out.append(
                {
                    "layer": index,
                    "layer_type": layer_type,
                    "cache": name,
                    "kind": cache.kind,
                    "window": cache.window,
                    "ratio": cache.ratio,
                    "buffers": {k: list(v) for k, v in cache.buffers.items()},
                    "spec": cache.spec(dtype),
                    "head_dim": 0,
                }
            )
    return out


def _measure(monkeypatch: pytest.MonkeyPatch, config: Any, with_index: bool) -> dict[str, Any]:
    bench = _bench()
    monkeypatch.setattr(bench, "layer_caches", lambda _d, c, dt: _caches(c, dt, with_index))
    return bench.measure(MODEL_DIR, config, TOKENS, 16, torch.bfloat16)


def _formula(config: Any, shared: set[int]) -> int:
    """Bytes by hand (bf16 = 2; fp32 KDA state)."""
    heads, dim, kernel = (
        config.linear_num_heads,
        config.linear_head_dim,
        config.linear_conv_kernel_dim,
    )
    state = (3 * heads * dim * (kernel - 1) + heads * dim * dim) * 4
    kpool, di = config.index_kpool, config.index_head_dim
    latent = (TOKENS + 1) * config.kv_lora_rank * 2
    indexer = min(TOKENS + 1, kpool) * 2 * di * 2 + (TOKENS // kpool) * di * 2
    total = 0
    for i, layer_type in enumerate(config.layer_types):
        if layer_type == "linear_attention":
            total += state
        else:
            total += latent + (0 if i in shared else indexer)
    return total


def test_default_config_every_indexed_layer_runs_its_indexer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = transformers.AutoConfig.for_model("glm5_next_text")
    assert set(config.indexer_types) == {"full"}  # the class default: no shared layer
    result = _measure(monkeypatch, config, with_index=True)
    assert result["owned_pages"] == result["listed_pages"]
    assert result["formula_bytes"] == _formula(config, set())
    assert result["total_bytes"] == _measure(monkeypatch, config, with_index=False)["total_bytes"]


def test_shared_indexer_layers_hold_the_latent_only(monkeypatch: pytest.MonkeyPatch) -> None:
    config = transformers.AutoConfig.for_model("glm5_next_text")
    indexed = [i for i, t in enumerate(config.layer_types) if t == "indexed_attention"]
    shared = set(indexed[1::2])  # every second indexed layer reuses the previous selection
    config.indexer_types = ["shared" if i in shared else "full" for i in range(45)]
    aware = _measure(monkeypatch, config, with_index=True)
    unaware = _measure(monkeypatch, config, with_index=False)
    assert aware["owned_pages"] == aware["listed_pages"]
    assert aware["formula_bytes"] == _formula(config, shared)
    assert unaware["formula_bytes"] == _formula(config, set())
    saved = unaware["formula_bytes"] - aware["formula_bytes"]
    assert saved == len(shared) * (16 * 2 * 128 * 2 + (TOKENS // 16) * 128 * 2) > 0
    windows = [g for g in aware["groups"] if g["cache"] in ("window", "pools")]
    assert {g["layers"] for g in windows} == {len(indexed) - len(shared)}
    assert aware["total_bytes"] < unaware["total_bytes"]
