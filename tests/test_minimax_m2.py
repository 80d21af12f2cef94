"""resin/models/minimax_m2 (MiniMax-M2 / M2.1 / M2.5: MiniMaxM2ForCausalLM, brought up with
`resin new-model`) passes the parity harness on its committed tiny checkpoint and on variants of
it, refuses what it does not compute, and serves with MiniMax's tool-call format.

- The tiny checkpoint (resin/models/minimax_m2/NOTES.md) has GQA (4 query heads, 2 KV heads)
  with q / k RMSNorms over the whole projection (weights ``heads * head_dim`` wide), ``head_dim``
  32 (not ``hidden_size / heads``), partial rotary from config.json's ``rotary_dim`` 8 (a
  quarter of the head, the released checkpoints' spelling: no ``rope_parameters``), sigmoid
  routing over 8 experts, top 3, with a seeded ``e_score_correction_bias``, renormalised.
- fp32: every stage; bf16 and fp16: the layers and logits bit-exact (the router's logits are
  computed in the model dtype, as HF's ``MiniMaxM2TopKRouter``).
- Variants: transformers' own spelling (``rope_parameters`` with the factor), the precedence of a
  factor over ``rotary_dim`` (rope dict, top level), no ``rotary_dim`` (the whole head), the
  M2 layout (6 query heads per KV head, half the head rotating, 16 experts, top 8; every stage),
  and MTP layers past the stack (left unused).
- Planted bugs (the tiny must not hide them) fail at the module they break.
- Serving: the ``minimax_m2`` tool parser and ``qwen3`` reasoning by default; chat through the
  template answers as ``LLM.chat``.

torch runs one thread here (shared 2-core machines).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from resin.evals.model_ref import import_model_module, resolve_model, run_model_parity  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO / "resin" / "models" / "minimax_m2"
TINY = MODEL_DIR / "tiny"

pytestmark = pytest.mark.usefixtures("one_torch_thread")

REF = resolve_model(MODEL_DIR)
LAYERS = ("layers",)  # the layers and logits stages only


@pytest.fixture
def blocks() -> Any:
    return import_model_module(MODEL_DIR, "blocks", "minimax_m2")


def tiny_config() -> dict[str, Any]:
    return json.loads((TINY / "config.json").read_text())


def edited_config(changes: dict[str, Any], drop: tuple[str, ...] = ()) -> dict[str, Any]:
    """The tiny's config.json with ``changes`` and without ``drop`` (a fresh copy)."""
    config = {k: v for k, v in {**tiny_config(), **changes}.items() if k not in drop}
    return json.loads(json.dumps(config))


def edited(tmp_path: Path, changes: dict[str, Any], drop: tuple[str, ...] = ()) -> Path:
    """The tiny checkpoint's weights under :func:`edited_config`."""
    path = tmp_path / "minimax_m2"
    shutil.copytree(TINY, path)
    (path / "config.json").write_text(json.dumps(edited_config(changes, drop)))
    return path


def test_tiny_checkpoint_exercises_whole_projection_norms_partial_rope_and_routing() -> None:
    from safetensors import safe_open

    assert sum(f.stat().st_size for f in TINY.iterdir()) < 2_000_000
    config = tiny_config()
    assert config["architectures"] == ["MiniMaxM2ForCausalLM"]
    heads, head_dim = config["num_attention_heads"], config["head_dim"]
    assert heads * head_dim != config["hidden_size"]
    assert config["num_key_value_heads"] < heads
    # the released spelling: rotary_dim, a quarter of the head (not the source's half)
    assert "rope_parameters" not in config and config["rotary_dim"] * 4 == head_dim
    assert config["num_experts_per_tok"] * 2 < config["num_local_experts"] + 2
    with safe_open(str(TINY / "model.safetensors"), "pt") as f:
        q_norm = f.get_tensor("model.layers.0.self_attn.q_norm.weight")
        k_norm = f.get_tensor("model.layers.0.self_attn.k_norm.weight")
        bias = f.get_tensor("model.layers.0.block_sparse_moe.e_score_correction_bias")
    assert q_norm.shape == (heads * head_dim,)
    assert k_norm.shape == (config["num_key_value_heads"] * head_dim,)
    assert float((q_norm - 1).abs().max()) > 0.1  # HF initialises it to ones
    assert float(bias.abs().min()) > 0  # seeded: HF initialises it to zeros


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_parity_on_tiny(dtype: str) -> None:
    """fp32: every stage; bf16 / fp16: the layers and logits, bit-exact."""
    half = dtype != "float32"
    report = run_model_parity(REF, dtype=dtype, checks=LAYERS if half else None)
    assert report.passed, report.summary()
    layers = report.stage("layers").metrics["max_scaled_diff"]
    if half:
        assert layers == 0.0 and report.stage("logits").metrics["scaled_diff"] == 0.0
    else:
        assert layers < 1e-5
        assert len(report.stages) == 8 and "greedy/preemption" in {s.name for s in report.stages}


ROPE = {"rope_type": "default", "rope_theta": 5e6}
# config.json variants over the tiny's weights: (changes, keys dropped)
VARIANTS: dict[str, tuple[dict[str, Any], tuple[str, ...]]] = {
    # what transformers writes on saving: the factor in rope_parameters, no rotary_dim
    "transformers_spelling": (
        {"rope_parameters": {**ROPE, "partial_rotary_factor": 0.25}},
        ("rotary_dim", "rope_theta"),
    ),
    # a factor in rope_parameters wins over rotary_dim (half the head rotates, not a quarter)
    "rope_dict_factor_over_rotary_dim": (
        {"rope_parameters": {**ROPE, "partial_rotary_factor": 0.5}},
        ("rope_theta",),
    ),
    # so does a top-level one (MiniMaxM2Config only sets a default from rotary_dim)
    "top_level_factor_over_rotary_dim": ({"partial_rotary_factor": 0.5}, ()),
    # no rotary_dim and no factor: the whole head rotates
    "no_rotary_dim": ({}, ("rotary_dim",)),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_parity_config_variants(tmp_path: Path, name: str) -> None:
    changes, drop = VARIANTS[name]
    report = run_model_parity(REF, checkpoint=edited(tmp_path, changes, drop), checks=LAYERS)
    assert report.passed, report.summary()


# MiniMax-M2's proportions, shrunk: 6 query heads per KV head (48 / 8), half the head rotating
# (64 of 128), top 8 experts of 16 (of 256)
M2_LAYOUT = {
    "num_attention_heads": 6,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "rotary_dim": 8,
    "num_local_experts": 16,
    "num_experts_per_tok": 8,
    "intermediate_size": 8,
}


def test_parity_m2_layout_every_stage(tmp_path: Path) -> None:
    """New weights (source/make_tiny.py's settings, deepseek_v3's writer), every stage."""
    make_tiny = import_model_module(MODEL_DIR / "source", "make_tiny", "minimax_m2_source")
    config = {**tiny_config(), **M2_LAYOUT}
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": config.pop("rope_theta")}
    checkpoint = tmp_path / "m2"
    make_tiny.write_checkpoint(config, checkpoint, make_tiny.SEED, mtp=False)
    report = run_model_parity(REF, checkpoint=checkpoint)
    assert report.passed, report.summary()


def test_mtp_layers_past_the_stack_are_left_unused(tmp_path: Path) -> None:
    """MTP modules a checkpoint ships (``num_mtp_modules``, ``model.layers.{N + i}.*`` as vLLM /
    SGLang skip them) load as unused tensors; HF's class builds none either."""
    from safetensors.torch import load_file, save_file

    from resin import SamplingParams
    from resin.llm import LLM

    path = tmp_path / "with_mtp"
    shutil.copytree(TINY, path)
    tensors = load_file(str(path / "model.safetensors"))
    n = tiny_config()["num_hidden_layers"]
    for name, tensor in list(tensors.items()):
        if name.startswith(f"model.layers.{n - 1}."):
            tensors[name.replace(f".{n - 1}.", f".{n}.", 1)] = tensor + 1
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    prompts = [[5, 17, 42, 99, 7], [11, 12, 13]]
    params = SamplingParams(max_tokens=5, temperature=0.0)
    want = [o.token_ids for o in LLM(TINY, max_model_len=64).generate(prompts, params)]
    with pytest.warns(UserWarning, match="does not use"):
        llm = LLM(path, max_model_len=64)
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    with pytest.warns(UserWarning, match="does not use"):
        report = run_model_parity(REF, checkpoint=path, checks=LAYERS)
    assert report.passed, report.summary()


def test_fp8_checkpoint_in_the_hub_format(tmp_path: Path) -> None:
    """MiniMax ships block-scaled FP8: every linear but the router (and its bias, and lm_head) as
    ``float8_e4m3fn`` with a ``weight_scale_inv`` per block, ``fmt`` written
    ``"float8_e4m3fn"``. The runner loading that agrees with HF running the same weights
    dequantised (every stage; the tiny quantised in 16 x 16 blocks)."""
    from safetensors.torch import load_file, save_file

    from resin.evals.parity import Tolerances, run_parity

    block = 16
    quantised, plain = {}, {}
    for name, weight in load_file(str(TINY / "model.safetensors")).items():
        if not name.endswith(("proj.weight", ".w1.weight", ".w2.weight", ".w3.weight")):
            quantised[name] = plain[name] = weight
            continue
        rows, cols = weight.shape
        blocks = weight.view(rows // block, block, cols // block, block)
        scale = blocks.abs().amax(dim=(1, 3)) / 448.0
        expand = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)
        codes = (weight / expand).to(torch.float8_e4m3fn)
        quantised[name], plain[name] = codes, codes.float() * expand
        quantised[name.removesuffix(".weight") + ".weight_scale_inv"] = scale
    fp8, reference = tmp_path / "fp8", tmp_path / "dequantised"
    for path, tensors in ((fp8, quantised), (reference, plain)):
        shutil.copytree(TINY, path)
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = tiny_config()
    config["quantization_config"] = {
        "activation_scheme": "dynamic",
        "fmt": "float8_e4m3fn",
        "quant_method": "fp8",
        "weight_block_size": [block, block],
        "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"],
    }
    (fp8 / "config.json").write_text(json.dumps(config))
    factory = REF.runner_factory("cpu", "float32")
    report = run_parity(
        reference,
        runner_factory=lambda _path: factory(str(fp8)),
        runner_name=REF.runner_name,
        tolerances=Tolerances.for_dtype("float32"),
    )
    assert report.passed, report.summary()
    assert report.stage("layers").metrics["max_scaled_diff"] < 1e-5


@pytest.mark.parametrize(
    "changes, drop",
    [
        ({}, ()),
        VARIANTS["transformers_spelling"],
        VARIANTS["top_level_factor_over_rotary_dim"],
        VARIANTS["no_rotary_dim"],
        ({"rotary_dim": 16}, ("rope_theta",)),  # MiniMaxM2Config's default theta, 5e6
    ],
)
def test_rotary_table_is_hf_partial_width(blocks: Any, changes: dict, drop: tuple) -> None:
    import transformers

    from resin.runners.torch.model_dir import ModelArgs

    hf = transformers.MiniMaxM2Config(**edited_config(changes, drop))
    rotary = transformers.models.minimax_m2.modeling_minimax_m2.MiniMaxM2RotaryEmbedding(hf)
    positions = torch.arange(0, 4000, 37)
    hf_cos, hf_sin = rotary(torch.zeros(1, 1, 1), positions[None])
    args = ModelArgs(**blocks.normalise_config(edited_config(changes, drop)))
    table = blocks.minimax_m2_rotary_embedding(args, 32, torch.device("cpu"))["*"]
    cos, sin = table.cos_sin(positions, torch.float32)
    assert cos.shape == hf_cos[0].shape
    torch.testing.assert_close(cos, hf_cos[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(sin, hf_sin[0], rtol=0, atol=1e-5)


def _per_head_norms(x: Any, w: dict[str, Any], ctx: Any) -> Any:
    """Planted: q / k norms per head (Qwen3's), each head by its slice of the weight."""
    from resin.runners.torch import blocks as shared

    def per_head(q: Any, weight: Any, eps: float) -> Any:
        return shared.rms_norm(q, weight.view(q.shape[-2], -1), eps)

    original = shared.qk_rms_norm
    shared.qk_rms_norm = per_head
    try:
        return shared.gqa_attention_block(x, w, ctx)
    finally:
        shared.qk_rms_norm = original


def _routing(**overrides: Any) -> Any:
    """Planted: the MoE with the shared router's arguments changed."""
    from resin.runners.torch import layers

    def moe(x: Any, w: dict[str, Any], ctx: Any) -> Any:
        bias = w["e_score_correction_bias"]
        args: dict[str, Any] = {"bias": bias, "norm": True, "fp32_logits": False, **overrides}
        experts, weights = layers.grouped_topk_routing(
            x,
            w["gate.weight"],
            args["bias"],
            int(ctx.config.num_experts_per_tok),
            1,
            1,
            args["norm"],
            1.0,
            fp32_logits=args["fp32_logits"],
        )
        return layers.routed_experts(
            x, w, experts, weights, lambda g, u: torch.nn.functional.silu(g) * u, True
        )

    return moe


@pytest.mark.parametrize(
    "plant, departs",
    [
        ("per_head_qk_norms", "layers.0.self_attn"),
        ("rotary_dim_unread", "layers.0.self_attn"),
        ("no_correction_bias", "layers.0.mlp"),
        ("no_renormalisation", "layers.0.mlp"),
    ],
)
def test_planted_bugs_depart_where_they_are(
    blocks: Any, monkeypatch: pytest.MonkeyPatch, plant: str, departs: str
) -> None:
    if plant == "per_head_qk_norms":
        monkeypatch.setitem(blocks.BLOCKS, "MiniMaxM2Attention", _per_head_norms)
    elif plant == "rotary_dim_unread":  # the whole head rotates
        monkeypatch.setattr(blocks, "normalise_config", lambda values: values)
    elif plant == "no_correction_bias":
        moe = _routing(bias=torch.zeros(8))
        monkeypatch.setitem(blocks.BLOCKS, "MiniMaxM2SparseMoeBlock", moe)
    else:
        monkeypatch.setitem(blocks.BLOCKS, "MiniMaxM2SparseMoeBlock", _routing(norm=False))
    report = run_model_parity(REF, checks=LAYERS)
    assert not report.passed
    assert report.stage("layers").first_mismatch["name"] == departs


def test_fp32_router_logits_are_not_hf_in_bf16(
    blocks: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DeepSeek's router (fp32 logits) is MiniMax's in fp32 only: in bf16 layer 0's MoE departs."""
    monkeypatch.setitem(blocks.BLOCKS, "MiniMaxM2SparseMoeBlock", _routing(fp32_logits=True))
    report = run_model_parity(REF, dtype="bfloat16", checks=LAYERS)
    layers = {c["name"]: c["scaled_diff"] for c in report.layers}
    assert layers["layers.0.self_attn"] == 0.0 and layers["layers.0.mlp"] > 0.0


def test_check_config_refusals(blocks: Any) -> None:
    from resin.runners.torch.model_dir import ModelArgs

    def args(**changes: Any) -> Any:
        return ModelArgs(**blocks.normalise_config({**tiny_config(), **changes}))

    blocks.check_config(args())
    refused: list[tuple[dict[str, Any], str]] = [
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"use_routing_bias": False}, "use_routing_bias"),
        ({"qk_norm_type": "per_head"}, "qk_norm_type"),
        ({"shared_intermediate_size": 64}, "shared_intermediate_size"),
        ({"attn_type_list": [0, 1, 1, 1]}, "lightning"),
        ({"num_local_experts": 1, "num_experts_per_tok": 1}, "num_local_experts"),
    ]
    for changes, message in refused:
        with pytest.raises(ValueError, match=message):
            blocks.check_config(args(**changes))


# -- serving ----------------------------------------------------------------------------------

MINIMAX_CALL = (
    "<think>\nOslo, two days.\n</think>\n\nChecking.\n<minimax:tool_call>\n"
    '<invoke name="get_weather">\n<parameter name="city">Oslo</parameter>\n'
    '<parameter name="days">2</parameter>\n</invoke>\n</minimax:tool_call>'
)


def test_registry_and_default_parsers() -> None:
    from resin.registry import ModelRegistry
    from resin.server.parsers.registry import default_parsers

    assert ModelRegistry(use_cwd=False, use_env=False).for_checkpoint(TINY).name == "minimax_m2"
    assert default_parsers(tiny_config()["model_type"]) == ("minimax_m2", "qwen3")


def test_served_tool_call_with_the_checkpoint_defaults() -> None:
    """``resin serve`` defaults for model_type minimax_m2 parse a MiniMax call after reasoning
    (a scripted runner emits it through the tiny's tokenizer), OpenAI and Anthropic."""
    pytest.importorskip("anthropic")
    pytest.importorskip("openai")
    from tests.scripted_tool_calls import check_anthropic, check_openai, scripted_server

    with scripted_server(TINY, MINIMAX_CALL, "minimax-m2-tiny") as live:
        check_openai(live, "minimax-m2-tiny", ("minimax:", "invoke", "parameter"))
        check_anthropic(live, "minimax-m2-tiny")


def test_served_chat_renders_the_template_and_answers_as_llm_chat() -> None:
    from tests.test_qwen3_5 import check_served_chat

    check_served_chat(MODEL_DIR)
