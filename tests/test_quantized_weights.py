"""Checkpoints as shipped: block-scaled FP8 linears and packed FP4 experts
(resin/loading/quantized_weights.py), through the one loader (model_weights.py).

- Dequantisation arithmetic on known values: FP8 blocks with partial edge blocks, the FP4
  e2m1 table and nibble order (element 2k = low nibble), ue8m0 = 2 ** (byte - 127).
- ``quantization_config`` parsing: V3 / V4 / V4.1 spellings accepted; unknown method, key or
  value refused.
- Loader errors name the tensor: a quantised tensor without its scale, a scale without its
  tensor, a scale of the wrong shape, storage the config does not announce.
- Parity: the runner on ``tiny_fp8/`` (scripts/make_tiny_fp8.py) against HF transformers
  running the same weights dequantised by an independent reference (the element formula for
  FP8, transformers' own ``Fp8Dequantize`` for FP4) in fp32: the harness's layers stage.

torch runs one thread here (shared 2-core machines).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from resin.loading.quantized_weights import (  # noqa: E402
    QuantScheme,
    dequantize_fp4,
    dequantize_fp8_blocks,
    plan_dequantisation,
    read_quant_scheme,
    ue8m0_to_float,
    unpack_fp4_e2m1,
)
from resin.loading.weights import WeightsError  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO / "resin" / "models" / "deepseek_v4_flash"
TINY = MODEL_DIR / "tiny"
TINY_FP8 = MODEL_DIR / "tiny_fp8"
V4_QUANT = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
    "scale_fmt": "ue8m0",
}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# --- arithmetic -------------------------------------------------------------------------


def test_fp8_blocks_with_partial_edge_blocks() -> None:
    """A 5 x 7 tensor in 2 x 3 blocks: 3 x 3 scales, the last row and column of blocks
    partial; every element is q[i, j] * s[i // 2, j // 3]."""
    weight = (torch.randn(5, 7, generator=torch.Generator().manual_seed(0)) * 3).to(
        torch.float8_e4m3fn
    )
    q = weight.float()
    assert len(set(q.flatten().tolist())) > 20
    scale = torch.tensor([[1.0, 2.0, 4.0], [0.5, 8.0, 0.25], [16.0, 3.0, -1.0]])
    got = dequantize_fp8_blocks(weight, scale, (2, 3))
    want = torch.tensor([[q[i, j] * scale[i // 2, j // 3] for j in range(7)] for i in range(5)])
    assert got.dtype == torch.float32 and torch.equal(got, want)
    # leading dims (fused experts) broadcast per matrix
    stacked = dequantize_fp8_blocks(
        torch.stack([weight, weight]), torch.stack([scale, 2 * scale]), (2, 3)
    )
    assert torch.equal(stacked[0], want) and torch.equal(stacked[1], 2 * want)


def test_fp4_table_and_nibble_order() -> None:
    """Byte k holds element 2k in its low nibble, 2k + 1 in its high one; codes 0-7 are
    0, .5, 1, 1.5, 2, 3, 4, 6 and bit 3 is the sign."""
    packed = torch.tensor([[0x21, 0xF8, 0x7E]], dtype=torch.uint8)
    want = torch.tensor([[0.5, 1.0, -0.0, -6.0, -4.0, 6.0]])
    for stored in (packed, packed.view(torch.int8), packed.view(torch.float4_e2m1fn_x2)):
        got = unpack_fp4_e2m1(stored)
        assert torch.equal(got, want), stored.dtype
    assert torch.signbit(unpack_fp4_e2m1(packed))[0, 2]  # code 8 is -0.0
    every = unpack_fp4_e2m1(torch.arange(16, dtype=torch.uint8).reshape(1, 16))[0, 0::2]
    assert every.tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]


def test_fp4_scales_per_32_values_with_a_partial_group() -> None:
    """40 values per row: two scales, the second covering 8 values."""
    codes = torch.arange(80) % 16
    packed = (codes[0::2] | (codes[1::2] << 4)).to(torch.uint8).reshape(2, 20)
    values = unpack_fp4_e2m1(packed)
    scale = torch.tensor([[126, 130], [127, 120]], dtype=torch.uint8)  # 0.5, 8; 1, 2^-7
    got = dequantize_fp4(packed.view(torch.int8), scale)
    factors = torch.tensor([[0.5] * 32 + [8.0] * 8, [1.0] * 32 + [2.0**-7] * 8])
    assert got.shape == (2, 40) and torch.equal(got, values * factors)


def test_ue8m0_is_two_to_the_byte_minus_127() -> None:
    raw = torch.tensor([127, 128, 126, 0, 254, 255], dtype=torch.uint8)
    got = ue8m0_to_float(raw)
    assert got[:5].tolist() == [1.0, 2.0, 0.5, 2.0**-127, 2.0**127]
    assert torch.isnan(got[5])
    as_e8m0 = raw.view(torch.float8_e8m0fnu)
    assert torch.equal(ue8m0_to_float(as_e8m0)[:5], got[:5])
    assert torch.equal(as_e8m0.float()[:5], got[:5])  # torch's own reading agrees


# --- quantization_config --------------------------------------------------------------


def test_quantization_config_spellings() -> None:
    v3 = QuantScheme.from_config(
        {"quantization_config": {**V4_QUANT, "scale_fmt": None, "fmt": "e4m3"}}
    )
    assert (v3.block, v3.scale_fmt, v3.expert_dtype) == ((128, 128), "float", "fp8")
    v4 = QuantScheme.from_config({"quantization_config": V4_QUANT, "expert_dtype": "fp4"})
    v41 = QuantScheme.from_config({"quantization_config": {**V4_QUANT, "expert_dtype": "fp4"}})
    assert v4 == v41 and v4.expert_dtype == "fp4" and v4.scale_fmt == "ue8m0"
    minimax = QuantScheme.from_config(
        {"quantization_config": {**V4_QUANT, "ignored_layers": ["lm_head"]}}
    )
    assert minimax.modules_to_not_convert == ("lm_head",)
    assert read_quant_scheme(TINY) is None
    assert read_quant_scheme(TINY_FP8) == v41.__class__("fp8", "e4m3", (32, 32), "ue8m0", "fp4", ())


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"quant_method": "awq"}, "quant_method 'awq'"),
        ({"group_size": 128}, "group_size"),
        ({"fmt": "e5m2"}, "fmt 'e5m2'"),
        ({"activation_scheme": "static"}, "activation_scheme 'static'"),
        ({"weight_block_size": [128]}, "weight_block_size"),
        ({"weight_block_size": None}, "weight_block_size"),
        ({"scale_fmt": "e4m3"}, "scale_fmt 'e4m3'"),
        ({"expert_dtype": "int4"}, "expert_dtype 'int4'"),
    ],
)
def test_unknown_quantization_metadata_is_refused(change: dict[str, Any], named: str) -> None:
    with pytest.raises(WeightsError, match=named):
        QuantScheme.from_config({"quantization_config": {**V4_QUANT, **change}})


def test_expert_dtype_disagreement_is_refused() -> None:
    with pytest.raises(WeightsError, match="disagree"):
        QuantScheme.from_config(
            {"quantization_config": {**V4_QUANT, "expert_dtype": "fp8"}, "expert_dtype": "fp4"}
        )


def test_pairing_by_headers() -> None:
    """V3 ``weight_scale_inv`` and V4 ``.scale`` both pair; a lone ``.scale`` the model knows
    is an ordinary tensor; an unscaled int8 table stays an integer tensor."""
    scheme = QuantScheme.from_config({"quantization_config": {**V4_QUANT, "expert_dtype": "fp4"}})
    headers = {
        "a.weight": ("F8_E4M3", (200, 300)),
        "a.weight_scale_inv": ("F32", (2, 3)),
        "b.weight": ("F8_E4M3", (128, 128)),
        "b.scale": ("F8_E8M0", (1, 1)),
        "x.experts.0.w1.weight": ("I8", (8, 20)),
        "x.experts.0.w1.scale": ("U8", (8, 2)),
        "hc.scale": ("F32", (3,)),
        "gate.tid2eid": ("I8", (16, 2)),
    }
    plan = plan_dequantisation(
        headers,
        scheme,
        is_routed_expert=lambda n: ".experts." in n,
        is_known=lambda n: n == "hc.scale",
    )
    assert set(plan.tensors) == {"a.weight", "b.weight", "x.experts.0.w1.weight"}
    assert plan.scales == {"a.weight_scale_inv", "b.scale", "x.experts.0.w1.scale"}
    expert = plan.tensors["x.experts.0.w1.weight"]
    assert (expert.kind, expert.block, expert.shape) == ("fp4", (1, 32), (8, 40))


# --- the loader on tiny_fp8 ----------------------------------------------------------------


def _runner_factory() -> Callable[[str], Any]:
    from resin.evals.model_ref import resolve_model

    return resolve_model(MODEL_DIR).runner_factory("cpu", "float32")


def _variant(
    tmp_path: Path,
    edit_tensors: Callable[[dict[str, Any]], None] | None = None,
    edit_config: Callable[[dict[str, Any]], None] | None = None,
) -> Path:
    from safetensors.torch import load_file, save_file

    out = tmp_path / "ckpt"
    shutil.copytree(TINY_FP8, out)
    if edit_tensors is not None:
        tensors = load_file(str(out / "model.safetensors"))
        edit_tensors(tensors)
        save_file(tensors, str(out / "model.safetensors"))
    if edit_config is not None:
        config = json.loads((out / "config.json").read_text())
        edit_config(config)
        (out / "config.json").write_text(json.dumps(config))
    return out


WQ_A = "model.layers.1.attn.wq_a"
EXPERT = "model.layers.2.ffn.experts.3.w2"


def _refused(path: Path, *named: str) -> str:
    with pytest.raises(WeightsError) as info:
        _runner_factory()(str(path))
    text = str(info.value)
    for name in named:
        assert name in text, text
    return text


def test_quantised_tensor_without_its_scale(tmp_path: Path) -> None:
    _refused(_variant(tmp_path, lambda t: t.pop(f"{WQ_A}.scale")), f"{WQ_A}.weight", "no scale")


def test_packed_fp4_expert_without_its_scale(tmp_path: Path) -> None:
    _refused(_variant(tmp_path, lambda t: t.pop(f"{EXPERT}.scale")), f"{EXPERT}.weight")


def test_scale_without_its_tensor(tmp_path: Path) -> None:
    _refused(_variant(tmp_path, lambda t: t.pop(f"{WQ_A}.weight")), f"{WQ_A}.scale")

    def add_second(t: dict[str, Any]) -> None:  # wq_b has its .scale already
        t["model.layers.0.attn.wq_b.weight_scale_inv"] = torch.ones(2, 1)

    _refused(_variant(tmp_path / "a", add_second), "model.layers.0.attn.wq_b.weight", "two scales")

    def add_lone(t: dict[str, Any]) -> None:
        t["model.layers.0.attn.wq_x.weight_scale_inv"] = torch.ones(2, 1)

    _refused(_variant(tmp_path / "b", add_lone), "model.layers.0.attn.wq_x.weight_scale_inv")


def test_scale_shape_must_cover_the_blocks(tmp_path: Path) -> None:
    def wrong(t: dict[str, Any]) -> None:  # wq_a is 32 x 64: 1 x 2 blocks of 32
        t[f"{WQ_A}.scale"] = torch.ones(2, 2).to(torch.float8_e8m0fnu)

    text = _refused(_variant(tmp_path, wrong), f"{WQ_A}.scale", f"{WQ_A}.weight")
    assert "(2, 2)" in text and "(1, 2)" in text

    def wrong_fp4(t: dict[str, Any]) -> None:  # w2 is 64 x 32: 64 x 1 groups of 32
        t[f"{EXPERT}.scale"] = torch.ones(64, 2).to(torch.float8_e8m0fnu)

    _refused(_variant(tmp_path / "b", wrong_fp4), f"{EXPERT}.scale", "(64, 1)")


def test_storage_the_config_does_not_announce(tmp_path: Path) -> None:
    def no_fp4(c: dict[str, Any]) -> None:
        c["quantization_config"]["expert_dtype"] = "fp8"

    _refused(_variant(tmp_path, edit_config=no_fp4), ".ffn.experts.", "expert_dtype 'fp4'")

    def float_scales(c: dict[str, Any]) -> None:
        c["quantization_config"]["scale_fmt"] = "float"

    _refused(_variant(tmp_path / "b", edit_config=float_scales), ".scale", "ue8m0")

    def fp8_expert(t: dict[str, Any]) -> None:
        t[f"{EXPERT}.weight"] = torch.zeros(64, 32).to(torch.float8_e4m3fn)
        t[f"{EXPERT}.scale"] = torch.ones(2, 1).to(torch.float8_e8m0fnu)

    _refused(_variant(tmp_path / "c", fp8_expert), f"{EXPERT}.weight", "is FP8")

    def unknown_method(c: dict[str, Any]) -> None:
        c["quantization_config"]["quant_method"] = "gptq"

    _refused(_variant(tmp_path / "d", edit_config=unknown_method), "quant_method 'gptq'")

    def unscaled_bf16(t: dict[str, Any]) -> None:  # a scale for a weight that is not quantised
        t["model.layers.0.attn.wq_b.weight"] = torch.zeros(64, 32, dtype=torch.bfloat16)

    _refused(_variant(tmp_path / "e", unscaled_bf16), "model.layers.0.attn.wq_b.weight")


def test_tiny_fp8_is_small_and_in_the_shipped_format() -> None:
    """FP8 attention / shared-expert linears, FP4 routed experts, e8m0 scales; embeddings,
    head, norms, router, compressor / indexer-scorer projections unquantised; each
    dequantised tensor within its format's error of tiny/'s fp32 tensor."""
    from safetensors.torch import load_file

    assert sum(f.stat().st_size for f in TINY_FP8.iterdir()) < 2_000_000
    fp8, src = (
        load_file(str(TINY_FP8 / "model.safetensors")),
        load_file(str(TINY / "model.safetensors")),
    )
    layer = "model.layers.1"
    for name in ("attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_a", "attn.wo_b"):
        assert fp8[f"{layer}.{name}.weight"].dtype == torch.float8_e4m3fn, name
    for name in ("attn.indexer.wq_b", "ffn.shared_experts.w1", "ffn.shared_experts.w2"):
        assert fp8[f"{layer}.{name}.weight"].dtype == torch.float8_e4m3fn, name
    assert fp8[f"{layer}.ffn.experts.0.w1.weight"].shape == (32, 32)  # 64 packed in 32 bytes
    assert fp8[f"{layer}.ffn.experts.0.w1.weight"].dtype == torch.int8
    assert fp8[f"{layer}.ffn.experts.0.w1.scale"].dtype == torch.float8_e8m0fnu
    for name in (
        "model.embed_tokens.weight",
        "head.weight",
        "model.norm.weight",
        f"{layer}.ffn.gate.weight",
        f"{layer}.attn.compressor.wkv.weight",
        f"{layer}.attn.indexer.compressor.wgate.weight",
        f"{layer}.attn.indexer.weights_proj.weight",
        f"{layer}.hc_attn_fn",
    ):
        assert torch.equal(fp8[name], src[name]), name
    assert fp8[f"{layer}.ffn.gate.tid2eid"].dtype == torch.int64
    # neighbouring FP8 blocks' scales differ (the script spreads block magnitudes by 2)
    assert fp8[f"{layer}.attn.wq_a.scale"].float().tolist() == [[2.0**-10, 2.0**-9]]
    weights = _runner_factory()(str(TINY_FP8)).weights
    spread = src[f"{layer}.attn.wq_a.weight"].clone()
    spread[:, 32:] *= 2  # block (0, 1) of 32 x 32
    for got, want, bound in (
        (weights.layers[1]["self_attn.q_a_proj.weight"], spread, 0.07),
        (
            weights.layers[1]["mlp.experts.0.w1.weight"],
            src[f"{layer}.ffn.experts.0.w1.weight"],
            0.25,
        ),
    ):
        assert got.dtype == torch.float32 and got.shape == want.shape
        error = float((got - want).abs().max() / want.abs().max())
        assert 0 < error < bound, error


def test_checkpoint_without_quantization_config_loads_as_before() -> None:
    from safetensors.torch import load_file

    weights = _runner_factory()(str(TINY)).weights
    src = load_file(str(TINY / "model.safetensors"))
    assert torch.equal(
        weights.layers[1]["self_attn.q_a_proj.weight"], src["model.layers.1.attn.wq_a.weight"]
    )
    assert torch.equal(
        weights.layers[0]["mlp.gate.tid2eid"], src["model.layers.0.ffn.gate.tid2eid"]
    )


# --- parity against HF on the same dequantised weights --------------------------------------


def _reference_dequantised(out: Path) -> Path:
    """tiny_fp8 dequantised independently of resin.loading: FP8 by the element formula (scales
    read by torch's own e8m0 conversion), FP4 by transformers' Fp8Dequantize; written as a
    plain fp32 checkpoint HF loads."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    hf_dequant = Fp8Dequantize(None)
    tensors = load_file(str(TINY_FP8 / "model.safetensors"))
    block = json.loads((TINY_FP8 / "config.json").read_text())["quantization_config"][
        "weight_block_size"
    ]
    plain: dict[str, Any] = {}
    for name, tensor in tensors.items():
        scale_name = name.removesuffix(".weight") + ".scale"
        if name.endswith(".scale") and name.removesuffix(".scale") + ".weight" in tensors:
            continue
        if scale_name not in tensors or not name.endswith(".weight"):
            plain[name] = tensor
            continue
        scale = tensors[scale_name].float()
        if tensor.dtype == torch.int8:
            plain[name] = hf_dequant._dequantize_one(tensor, scale, output_dtype=torch.float32)
        else:
            rows = torch.arange(tensor.shape[0]) // block[0]
            cols = torch.arange(tensor.shape[1]) // block[1]
            plain[name] = tensor.float() * scale[rows][:, cols]
    out.mkdir()
    save_file(plain, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((TINY_FP8 / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config))
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY_FP8 / name, out / name)
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_runner_on_tiny_fp8_matches_hf_on_the_dequantised_weights(
    tmp_path: Path, dtype: str
) -> None:
    """Every parity stage (layers, logits, page sizes, chunked prefill, prefix cache,
    preemption; parity.toml's prompts and full-forward reference) with the runner loading the
    quantised checkpoint and HF running the same weights dequantised independently."""
    pytest.importorskip("transformers")
    from resin.evals.model_ref import parity_settings, resolve_model
    from resin.evals.parity import Tolerances, run_parity

    reference = _reference_dequantised(tmp_path / "dequantised")
    ref = resolve_model(MODEL_DIR)
    settings = parity_settings(ref)
    factory = ref.runner_factory("cpu", dtype)
    report = run_parity(
        reference,
        runner_factory=lambda _path: factory(str(TINY_FP8)),
        runner_name=ref.runner_name,
        dtype=dtype,
        tolerances=Tolerances.for_dtype(dtype),
        prompts=settings["prompts"],
        max_new_tokens=settings["max_new_tokens"],
        greedy_reference=settings["greedy_reference"],
    )
    assert report.passed, report.summary()
    assert len(report.layers) == 22 and report.first_departure is None
    assert report.stage("greedy/prefix_cache").metrics["num_cached_tokens"] > 0
    if dtype == "float32":
        assert report.stage("layers").metrics["max_scaled_diff"] < 1e-5
        assert report.stage("logits").metrics["top1_agreement"] == 1.0


def test_dequantised_tensors_take_the_runner_dtype() -> None:
    """Dequantised in fp32, then cast like any floating tensor (bf16 here)."""
    fp32 = _runner_factory()(str(TINY_FP8)).weights.layers[2]
    from resin.evals.model_ref import resolve_model

    bf16 = resolve_model(MODEL_DIR).runner_factory("cpu", torch.bfloat16)(str(TINY_FP8)).weights
    for name in ("self_attn.o_b_proj.weight", "mlp.experts.5.w2.weight"):
        assert bf16.layers[2][name].dtype == torch.bfloat16
        assert torch.equal(bf16.layers[2][name], fp32[name].to(torch.bfloat16))
    assert bf16.layers[0]["mlp.gate.tid2eid"].dtype == torch.int64
