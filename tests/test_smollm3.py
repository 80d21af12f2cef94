"""resin/models/smollm3 (SmolLM3-3B, brought up with `resin new-model`) passes the parity harness
on its committed tiny checkpoint and on variants of it, refuses what it does not compute as
transformers does, and the harness would catch it if it rotated a NoPE layer.

- The tiny checkpoint (resin/models/smollm3/NOTES.md) has RoPE layers 0-2 and a NoPE layer 3
  (``no_rope_layers`` [1, 1, 1, 0]: every 4th layer, as SmolLM3-3B), GQA (4 heads / 2 KV
  heads), tied embeddings, randomised norm weights and rope_theta 5e6 (not the class default).
- fp32: every stage; bf16: the layers bit-exact.
- A planted bug — RoPE on every layer, the NoPE flags ignored — fails at layer 3's self_attn.
- Variants (the tiny's weights, another config.json): other NoPE patterns (given, and derived
  from ``no_rope_layer_interval`` with no lists, as SmolLM3Config derives them), the hub
  spelling (top-level ``rope_theta``, ``rope_scaling`` null) and YaRN.
- Refused at load: sliding-window layers (architecture.json records none), a NoPE list shorter
  than the layers, rope types Resin does not compute; ``dynamic`` rope caps max_model_len.

torch runs one thread here (shared 2-core machines).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from resin.evals.model_ref import import_model_module  # noqa: E402
from tests.model_variants import model_parity, tiny_variant  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO / "resin" / "models" / "smollm3"
TINY = MODEL_DIR / "tiny"
variant = partial(tiny_variant, TINY)
parity = partial(model_parity, MODEL_DIR)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def blocks() -> Any:
    return import_model_module(MODEL_DIR, "blocks", "smollm3")


def nope_first_and_third(config: dict[str, Any]) -> None:
    config["no_rope_layers"] = [0, 1, 0, 1]


def lists_from_interval(config: dict[str, Any]) -> None:
    """No lists: SmolLM3Config derives [1, 0, 1, 0] from interval 2, then all full layers."""
    del config["no_rope_layers"], config["layer_types"]
    config["no_rope_layer_interval"] = 2


def hub_spelling(config: dict[str, Any]) -> None:
    """SmolLM3-3B's config.json spelling: top-level rope_theta, rope_scaling null."""
    del config["rope_parameters"]
    config.update(rope_theta=5_000_000.0, rope_scaling=None)


def yarn(config: dict[str, Any]) -> None:
    config["rope_parameters"] = {
        "rope_type": "yarn",
        "rope_theta": 5_000_000.0,
        "factor": 2.0,
        "original_max_position_embeddings": 32,
    }
    config["max_position_embeddings"] = 64


def test_tiny_checkpoint_has_rope_and_nope_layers() -> None:
    assert sum(f.stat().st_size for f in TINY.iterdir()) < 2_000_000
    config = json.loads((TINY / "config.json").read_text())
    assert config["architectures"] == ["SmolLM3ForCausalLM"]
    assert config["no_rope_layers"] == [1, 1, 1, 0]
    assert config["layer_types"] == ["full_attention"] * 4
    assert config["num_key_value_heads"] < config["num_attention_heads"]
    assert config["tie_word_embeddings"]
    assert config["rope_parameters"]["rope_theta"] != 2_000_000.0  # SmolLM3Config.default_theta
    from safetensors.torch import load_file

    tensors = load_file(str(TINY / "model.safetensors"))
    assert "lm_head.weight" not in tensors
    norms = [t for name, t in tensors.items() if "norm" in name]
    assert norms and all(float((t - 1).abs().max()) > 0.1 for t in norms)  # not HF's ones


def test_parity_fp32_every_stage() -> None:
    report = parity()
    assert report.passed, report.summary()
    assert {
        "layers",
        "logits",
        "greedy/page_size=1",
        "greedy/page_size=16",
        "greedy/page_size=64",
        "greedy/chunked_prefill",
        "greedy/prefix_cache",
        "greedy/preemption",
    } <= {s.name for s in report.stages}
    assert report.stage("layers").metrics["max_scaled_diff"] < 1e-5
    assert not report.stage("layers").metrics["missing"]


def test_parity_bf16_layers_bit_exact() -> None:
    report = parity(dtype="bfloat16", layers_only=True)
    assert report.passed, report.summary()
    assert report.stage("layers").metrics["max_scaled_diff"] == 0.0
    assert report.stage("logits").metrics["scaled_diff"] == 0.0


def test_rotary_on_the_nope_layer_fails_there(blocks: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(blocks, "uses_rope", lambda config, layer: True)
    report = parity(layers_only=True)
    assert not report.passed
    first = report.first_departure
    assert first is not None and first["name"] == "layers.3.self_attn", report.summary()
    assert first["scaled_diff"] > 0.01


@pytest.mark.parametrize(
    "edit",
    [nope_first_and_third, lists_from_interval, hub_spelling, yarn],
    ids=lambda f: f.__name__,
)
def test_parity_on_config_variants(tmp_path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    report = parity(variant(tmp_path, edit), layers_only=True)
    assert report.passed, report.summary()


@pytest.mark.parametrize(
    ("num_layers", "interval", "sliding"),
    [(4, 2, False), (10, 3, True), (36, 4, False), (36, 3, False)],
)
def test_derived_lists_follow_transformers(
    blocks: Any, tmp_path: Path, num_layers: int, interval: int, sliding: bool
) -> None:
    """A config.json without ``no_rope_layers`` / ``layer_types``: the lists normalise_config
    derives over the record's defaults are SmolLM3Config's."""
    import transformers

    from resin.runners.torch.model_dir import ModelRecord, load_model_args

    config = json.loads((TINY / "config.json").read_text())
    del config["no_rope_layers"], config["layer_types"]
    config.update(
        num_hidden_layers=num_layers,
        no_rope_layer_interval=interval,
        use_sliding_window=sliding,
        sliding_window=16 if sliding else None,
    )
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf = transformers.SmolLM3Config.from_dict(config)
    args = blocks.normalise_config(load_model_args(tmp_path, ModelRecord.load(MODEL_DIR)).to_dict())
    assert hf.no_rope_layers is not None and hf.layer_types is not None
    assert args["no_rope_layers"] == list(hf.no_rope_layers)
    assert args["layer_types"] == list(hf.layer_types)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            {"use_sliding_window": True, "sliding_window": 16, "layer_types": None},
            "sliding-window layers are not supported",
        ),
        ({"layer_types": ["full_attention", "sliding_attention"] * 2}, "sliding-window layers"),
        ({"no_rope_layers": [1, 1, 0]}, "no_rope_layers must list one flag per layer"),
        ({"no_rope_layers": [1, 2, 1, 0]}, "no_rope_layers entries must be 0 .NoPE. or 1"),
        (
            {"rope_parameters": {"rope_type": "longrope", "rope_theta": 5e6}},
            "rope type 'longrope' is not supported",
        ),
    ],
    ids=[
        "use_sliding_window",
        "sliding_layer_types",
        "short_nope_list",
        "bad_flag",
        "longrope",
    ],
)
def test_unsupported_configs_are_refused_at_load(
    tmp_path: Path, edit: dict[str, Any], message: str
) -> None:
    from resin.registry import ModelRegistry

    def apply(config: dict[str, Any]) -> None:
        config.update(edit)
        for key in [k for k, v in edit.items() if v is None]:
            del config[key]

    checkpoint = variant(tmp_path, apply)
    entry = ModelRegistry(use_cwd=False, use_env=False).for_checkpoint(checkpoint)
    with pytest.raises(ValueError, match=f"smollm3: {message}"):
        entry.load_runner(checkpoint)


def test_dynamic_rope_caps_max_model_len(tmp_path: Path) -> None:
    import resin
    from resin.loading.fields import ConfigError

    def dynamic(config: dict[str, Any]) -> None:
        config["rope_parameters"] = {"rope_type": "dynamic", "rope_theta": 5e6, "factor": 2.0}
        config["max_position_embeddings"] = 96

    checkpoint = variant(tmp_path, dynamic)
    report = parity(checkpoint, layers_only=True)  # inside the length: HF's default frequencies
    assert report.passed, report.summary()
    assert resin.LLM(checkpoint).engine.config.max_model_len == 96
    with pytest.raises(ConfigError, match="max_model_len 97 is past 96: rope type 'dynamic'"):
        resin.LLM(checkpoint, max_model_len=97)
