"""resin/models/starcoder2 (BigCode StarCoder2-3B / 7B / 15B, brought up with `resin new-model`)
passes the parity harness on its committed tiny checkpoint and on variants of it, and the
harness would catch it if it did not.

- The tiny checkpoint cannot hide StarCoder 2's differences (resin/models/starcoder2/NOTES.md):
  a sliding window (32) on every layer, narrower than the longest parity prompt; randomised
  LayerNorm weights and biases (they init to ones / zeros) and randomised q/k/v/o and
  c_fc / c_proj biases (zeros at init); ``rope_theta`` 1e6 (not the default 1e4); GQA; tied
  embeddings; ``gelu_pytorch_tanh``.
- fp32: every stage, on the parity backend and on both paths of the servers' ``torch``
  backend; bf16: the layers and logits bit-exact.
- Planted bugs each fail where they should: attention biases dropped, MLP biases dropped,
  the erf GELU for the tanh one, LayerNorm without its bias, the window ignored (full
  attention), and (on a variant with a distinct ``norm_epsilon``) the norm reading the
  ``layer_norm_epsilon`` hub configs also carry.
- Variants (the tiny's weights, another config.json / tensors): untied ``lm_head`` (and the
  tied head on it departing at ``logits``); no window (``sliding_window`` null: full
  attention); ``use_bias`` false (no projection biases); the hub spelling (top-level
  ``rope_theta``); ``norm_epsilon`` not the default.
- Every layer's type follows transformers (one mask from ``sliding_window`` for the whole
  stack), whatever stray ``layer_types`` / ``use_sliding_window`` a config.json carries; an
  activation or rope these blocks do not compute is refused at load.

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
MODEL_DIR = REPO / "resin" / "models" / "starcoder2"
TINY = MODEL_DIR / "tiny"
variant = partial(tiny_variant, TINY)
parity = partial(model_parity, MODEL_DIR)
EVERY_STAGE = {
    "layers",
    "logits",
    "greedy/page_size=1",
    "greedy/page_size=16",
    "greedy/page_size=64",
    "greedy/chunked_prefill",
    "greedy/prefix_cache",
    "greedy/preemption",
}
PROJECTION_BIASES = ("q_proj", "k_proj", "v_proj", "o_proj", "c_fc", "c_proj")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def blocks() -> Any:
    return import_model_module(MODEL_DIR, "blocks", "starcoder2")


def untied_head(tensors: dict[str, Any]) -> None:
    generator = torch.Generator().manual_seed(0)
    embed = tensors["model.embed_tokens.weight"]
    tensors["lm_head.weight"] = torch.randn(embed.shape, generator=generator)


def no_projection_biases(tensors: dict[str, Any]) -> None:
    for name in [n for n in tensors if n.endswith(".bias")]:
        if name.split(".")[-2] in PROJECTION_BIASES:
            del tensors[name]


def hub_spelling(config: dict[str, Any]) -> None:
    """As bigcode/starcoder2-7b's config.json spells rope: a top-level ``rope_theta``."""
    config["rope_theta"] = config.pop("rope_parameters")["rope_theta"]


def test_tiny_checkpoint_is_small_and_cannot_hide_starcoder2_bugs() -> None:
    assert sum(f.stat().st_size for f in TINY.iterdir()) < 2_000_000
    config = json.loads((TINY / "config.json").read_text())
    assert config["architectures"] == ["Starcoder2ForCausalLM"]
    assert config["sliding_window"] < 70  # the longest parity prompt
    assert config["hidden_act"] == "gelu_pytorch_tanh"
    assert config["use_bias"] is True
    assert config["rope_parameters"]["rope_theta"] != 10000.0
    assert config["num_key_value_heads"] < config["num_attention_heads"]
    assert config["tie_word_embeddings"]
    from safetensors.torch import load_file

    tensors = load_file(str(TINY / "model.safetensors"))
    assert "lm_head.weight" not in tensors
    biases = [t for name, t in tensors.items() if name.endswith(".bias")]
    assert len(biases) == 4 * (len(PROJECTION_BIASES) + 2) + 1  # + two LayerNorms, final norm
    assert all(float(t.abs().max()) > 0.1 for t in biases)
    norms = [t for name, t in tensors.items() if "norm.weight" in name]
    assert len(norms) == 9 and all(float((t - 1).abs().max()) > 0.1 for t in norms)


def test_parity_fp32_every_stage() -> None:
    report = parity()
    assert report.passed, report.summary()
    assert EVERY_STAGE <= {s.name for s in report.stages}
    assert report.stage("layers").metrics["max_scaled_diff"] < 1e-5
    assert not report.stage("layers").metrics["missing"]


def test_parity_bf16_layers_bit_exact() -> None:
    report = parity(dtype="bfloat16", layers_only=True)
    assert report.passed, report.summary()
    assert report.stage("layers").metrics["max_scaled_diff"] == 0.0
    assert report.stage("logits").metrics["scaled_diff"] == 0.0


@pytest.mark.parametrize("cpu_kernel", [False, True], ids=["sdpa", "cpu-kernel"])
def test_parity_fp32_on_the_torch_backend(
    cpu_kernel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The servers' default backend, both paths (tests/test_torch_backend.py's check)."""
    monkeypatch.setenv("RESIN_TORCH_CPU_KERNEL", "1" if cpu_kernel else "0")
    report = parity(attention_backend="torch", layers_only=True)
    assert report.passed, report.summary()


def _without(block: str, names: tuple[str, ...]) -> Callable[[Any, pytest.MonkeyPatch], None]:
    def plant(blocks: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        fn = blocks.BLOCKS[block]

        def dropped(x: Any, w: Any, ctx: Any) -> Any:
            return fn(x, {k: v for k, v in w.items() if k not in names}, ctx)

        monkeypatch.setitem(blocks.BLOCKS, block, dropped)

    return plant


def _erf_gelu(blocks: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``F.gelu`` (erf) for ``gelu_pytorch_tanh``: at most 4.7e-4 apart, at |x| ~ 2.7."""
    monkeypatch.setattr(blocks, "config_activation", lambda config: torch.nn.functional.gelu)


def _layer_norm_without_bias(blocks: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_bias(x: Any, w: Any, ctx: Any) -> Any:
        eps = float(ctx.config.norm_epsilon)
        return torch.nn.functional.layer_norm(x, x.shape[-1:], w["weight"], None, eps)

    monkeypatch.setitem(blocks.BLOCKS, "LayerNorm", no_bias)


def _window_ignored(blocks: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every layer full attention (as if the config had no ``sliding_window``)."""
    normalise = blocks.normalise_config

    def full(config: dict[str, Any]) -> dict[str, Any]:
        out = normalise(config)
        return {**out, "layer_types": ["full_attention"] * len(out["layer_types"])}

    monkeypatch.setattr(blocks, "normalise_config", full)


@pytest.mark.parametrize(
    ("plant", "departure"),
    [
        (
            _without("Starcoder2Attention", tuple(f"{p}_proj.bias" for p in "qkvo")),
            "layers.0.self_attn",
        ),
        (_without("Starcoder2MLP", ("c_fc.bias", "c_proj.bias")), "layers.0.mlp"),
        (_erf_gelu, "layers.0.mlp"),
        (_layer_norm_without_bias, "layers.0.input_layernorm"),
        (_window_ignored, "layers.0.self_attn"),
    ],
    ids=["attention_biases", "mlp_biases", "erf_gelu", "layer_norm_bias", "window_ignored"],
)
def test_planted_bug_fails_where_it_is(
    blocks: Any,
    monkeypatch: pytest.MonkeyPatch,
    plant: Callable[[Any, pytest.MonkeyPatch], None],
    departure: str,
) -> None:
    plant(blocks, monkeypatch)
    report = parity(layers_only=True)
    assert not report.passed
    first = report.first_departure
    assert first is not None and first["name"] == departure, report.summary()


def test_untied_lm_head_and_the_tied_head_departing_on_it(
    blocks: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """starcoder2-7b / 15b-style untied head: the checkpoint's ``lm_head.weight`` is used; the
    tied head on the same checkpoint matches every layer and departs at ``logits``."""
    checkpoint = variant(tmp_path, lambda c: c.update(tie_word_embeddings=False), untied_head)
    report = parity(checkpoint, layers_only=True)
    assert report.passed, report.summary()

    def tied(hidden: Any, w: Any, ctx: Any) -> Any:
        return torch.nn.functional.linear(hidden, w["embed_tokens.weight"])

    monkeypatch.setattr(blocks, "logits", tied, raising=False)
    report = parity(checkpoint, layers_only=True)
    assert not report.passed
    assert report.stage("layers").passed and not report.stage("logits").passed


@pytest.mark.parametrize(
    ("edit", "tensors"),
    [
        (lambda c: c.update(sliding_window=None), None),
        (lambda c: c.update(use_bias=False), no_projection_biases),
        (hub_spelling, None),
    ],
    ids=["no_window", "use_bias_false", "hub_spelling"],
)
def test_parity_on_variants(
    tmp_path: Path,
    edit: Callable[[dict[str, Any]], None],
    tensors: Callable[[dict[str, Any]], None] | None,
) -> None:
    report = parity(variant(tmp_path, edit, tensors), layers_only=True)
    assert report.passed, report.summary()


def test_norm_epsilon_is_the_key_read(
    blocks: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``norm_epsilon`` 0.25 (the tiny's 1e-5 is the default, and the hub configs' unread
    ``layer_norm_epsilon`` equals it): parity passes; a norm reading ``layer_norm_epsilon``
    departs at the first norm."""
    checkpoint = variant(tmp_path, lambda c: c.update(norm_epsilon=0.25))
    report = parity(checkpoint, layers_only=True)
    assert report.passed, report.summary()

    def wrong_key(x: Any, w: Any, ctx: Any) -> Any:
        eps = float(ctx.config.layer_norm_epsilon)
        return torch.nn.functional.layer_norm(x, x.shape[-1:], w["weight"], w["bias"], eps)

    monkeypatch.setitem(blocks.BLOCKS, "LayerNorm", wrong_key)
    report = parity(checkpoint, layers_only=True)
    assert not report.passed
    first = report.first_departure
    assert first is not None and first["name"] == "layers.0.input_layernorm", report.summary()


@pytest.mark.parametrize(
    "stray",
    [
        {},
        {"use_sliding_window": False},
        {"layer_types": ["full_attention", "sliding_attention"] * 3},
        {"sliding_window_pattern": 2},
    ],
    ids=["plain", "use_sliding_window", "layer_types", "pattern"],
)
@pytest.mark.parametrize("window", [4096, None], ids=["window", "no_window"])
def test_layer_types_follow_transformers(
    blocks: Any, tmp_path: Path, stray: dict[str, Any], window: int | None
) -> None:
    """transformers builds one mask from ``config.sliding_window`` for every layer (keys it does
    not read change nothing); the runner's layers get the same windows."""
    import transformers

    from resin.runners.torch.model_dir import ModelArgs, ModelRecord, layer_kinds, load_model_args

    config = json.loads((TINY / "config.json").read_text())
    config.update(num_hidden_layers=6, sliding_window=window, **stray)
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf = transformers.Starcoder2Config.from_dict(config)
    record = ModelRecord.load(MODEL_DIR)
    args = ModelArgs(**blocks.normalise_config(load_model_args(tmp_path, record).to_dict()))
    kinds = layer_kinds(args, record)
    assert [w for _, w, _ in kinds] == [hf.sliding_window] * 6
    expected = "sliding_attention" if window else "full_attention"
    assert [t for t, _, _ in kinds] == [expected] * 6


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"hidden_act": "gelu_10"}, "gelu_10"),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e6}}, "longrope"),
    ],
    ids=["hidden_act", "rope_type"],
)
def test_unsupported_config_is_refused_at_load(
    tmp_path: Path, edit: dict[str, Any], message: str
) -> None:
    from resin.registry import ModelRegistry

    checkpoint = variant(tmp_path, lambda config: config.update(edit))
    entry = ModelRegistry(use_cwd=False, use_env=False).for_checkpoint(checkpoint)
    with pytest.raises(ValueError, match=f"starcoder2: .*{message}"):
        entry.load_runner(checkpoint)
