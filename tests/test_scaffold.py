"""``resin new-model``: generated runners for supported architectures pass parity unedited;
for an architecture Resin lacks blocks for (gpt-oss), the skeleton is generated with its stubs
marked, and each stub raises NotImplementedError naming the HF class, its file:line and shapes.

Generation runs once per module into a temporary ``models/`` directory. Parity runs the real
harness (``run_parity``) with the generated ``Runner``: through ``resin eval parity NAME`` for
llama, through the generated ``test_parity.py`` for qwen3, directly for qwen3_moe and mistral,
and on a ``--tiny`` checkpoint for qwen3_moe. A planted bug in a generated block must make
parity fail at the right layer, so the passing cases are not vacuous. The gpt-oss worked example
of ``skills/add-model/SKILL.md``, pasted into the generated stubs, must pass parity.
"""

from __future__ import annotations

import inspect
import json
import re
import textwrap
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from resin.evals.model_ref import import_model_module, resolve_model, run_model_parity  # noqa: E402
from resin.evals.parity import run_parity  # noqa: E402
from resin.scaffold.cli import new_model  # noqa: E402

FIXTURES = Path(__file__).resolve().parent / "fixtures"
SUPPORTED = ("llama", "qwen3", "qwen3_moe", "mistral")
# No runner.py (the shared paged runner runs every model) and no weights.py unless some
# checkpoint name needs renaming (none of these architectures does).
GENERATED = (
    "architecture.json",
    "blocks.py",
    "parity.toml",
    "perf.toml",
    "NOTES.md",
    "test_parity.py",
)
# gpt-oss-20b's shapes (config only: the meta device needs no weights).
GPT_OSS = dict(
    architectures=["GptOssForCausalLM"],
    model_type="gpt_oss",
    hidden_size=2880,
    intermediate_size=2880,
    num_hidden_layers=24,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=64,
    num_local_experts=32,
    num_experts_per_tok=4,
    vocab_size=201088,
    sliding_window=128,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    attention_bias=True,
    swiglu_limit=7.0,
    rope_scaling=dict(
        rope_type="yarn",
        factor=32.0,
        beta_fast=32.0,
        beta_slow=1.0,
        truncate=False,
        original_max_position_embeddings=4096,
    ),
    rope_theta=150000.0,
    layer_types=["sliding_attention", "full_attention"] * 12,
)


@pytest.fixture(scope="module")
def models_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("scaffold") / "models"
    for arch in SUPPORTED:
        summary = new_model(FIXTURES / arch, f"{arch}_s", out=root / f"{arch}_s")
        assert summary["stubs"] == [] and summary["assumed"] == []
    return root


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("gpt_oss_src")
    (src / "config.json").write_text(json.dumps(GPT_OSS))
    out = src.parent / "models_oss" / "gpt_oss"
    new_model(src / "config.json", "gpt_oss", out=out, tiny=True)
    return out


def test_generates_every_file_and_cache_specs_match_resin(models_root: Path) -> None:
    from resin.loading import layer_cache_specs, load_model_config

    for arch in SUPPORTED:
        model_dir = models_root / f"{arch}_s"
        assert sorted(p.name for p in model_dir.iterdir() if p.is_file()) == sorted(GENERATED)
        blocks = import_model_module(model_dir, "blocks", f"{arch}_s")
        assert blocks.STUBS == () and blocks.ASSUMED == ()
        assert "| meta forward (shapes) | ran" in (model_dir / "NOTES.md").read_text()
        runner = resolve_model(model_dir).load_runner()
        expected = layer_cache_specs(load_model_config(FIXTURES / arch), 4)
        got = runner.cache_spec()
        assert [(s.kind, s.bytes_per_token, s.window) for s in got] == [
            (s.kind, s.bytes_per_token, s.window) for s in expected
        ]
    assert "sliding_window" in {
        s.kind for s in resolve_model(models_root / "mistral_s").load_runner().cache_spec()
    }
    # perf.toml is in the layout `resin bench` reads; 9 batch sizes x the context lengths
    from resin.evals.perf_shapes import load_perf_spec

    spec = load_perf_spec(models_root / "llama_s")
    # a real checkpoint's spec leaves the device to the machine (cuda when it has one)
    assert spec.checkpoint == (FIXTURES / "llama").resolve() and spec.device is None
    assert len([s for s in spec.shapes if s.kind == "decode"]) == 9


def test_llama_passes_through_the_cli_by_name(
    models_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from typer.testing import CliRunner

    from resin.evals.cli import eval_app

    monkeypatch.chdir(models_root.parent)  # `llama_s` resolves as ./models/llama_s
    out = tmp_path / "parity.json"
    result = CliRunner().invoke(
        eval_app, ["parity", "llama_s", "--json", str(out), "--max-new-tokens", "4"]
    )
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["passed"] and report["runner"] == "model:llama_s"
    assert len(report["stages"]) == 8 and report["layers"]


def test_qwen3_passes_through_its_generated_test(models_root: Path) -> None:
    module = import_model_module(models_root / "qwen3_s", "test_parity", "qwen3_s")
    module.test_parity()  # asserts report.passed with parity.toml's settings


@pytest.mark.parametrize("arch", ["qwen3_moe", "mistral"])
def test_passes_parity_unedited(models_root: Path, arch: str) -> None:
    ref = resolve_model(f"{arch}_s", models_root=models_root)
    assert ref.checkpoint_dir.resolve() == (FIXTURES / arch).resolve()
    report = run_parity(
        ref.checkpoint_dir,
        runner_factory=ref.runner_factory(),
        runner_name=ref.runner_name,
        max_new_tokens=4,
    )
    assert report.passed, report.summary()
    assert report.stage("layers").metrics["missing"] == []


def test_a_planted_bug_in_a_generated_block_fails_at_its_layer(tmp_path: Path) -> None:
    out = tmp_path / "llama_bug"
    new_model(FIXTURES / "llama", "llama_bug", out=out)
    blocks = out / "blocks.py"
    text = blocks.read_text()
    # SwiGLU -> "GeGLU" in every MLP: the first departure must be layer 0's mlp
    blocks.write_text(
        text.replace(
            "return swiglu_mlp_block(x, w, ctx)", "return 2 * swiglu_mlp_block(x, w, ctx)", 1
        )
    )
    assert blocks.read_text() != text
    report = run_model_parity(resolve_model(out))
    assert not report.passed
    assert report.first_departure is not None
    assert (report.first_departure["layer"], report.first_departure["module"]) == (0, "mlp")


def test_tiny_checkpoint_of_a_supported_architecture_passes(tmp_path: Path) -> None:
    out = tmp_path / "moe_tiny"
    new_model(FIXTURES / "qwen3_moe", "moe_tiny", out=out, tiny=True)
    tiny = out / "tiny"
    config = json.loads((tiny / "config.json").read_text())
    source = json.loads((FIXTURES / "qwen3_moe" / "config.json").read_text())
    for key in ("architectures", "mlp_only_layers", "norm_topk_prob"):
        assert config[key] == source[key], key
    # head_dim equalled hidden / heads: perturbed (tiny_checkpoint's trap), and parity holds
    assert source["head_dim"] == 16 and config["head_dim"] == 20
    assert config.get("num_experts", config.get("num_local_experts")) == 4
    assert config["vocab_size"] == 384
    assert {"model.safetensors", "tokenizer.json", "generation_config.json"} <= {
        p.name for p in tiny.iterdir()
    }
    ref = resolve_model(out)
    assert ref.checkpoint_dir == out / "tiny"
    report = run_parity(
        ref.checkpoint_dir,
        runner_factory=ref.runner_factory(),
        runner_name=ref.runner_name,
        checks=("layers",),
    )
    assert report.passed, report.summary()


def test_a_gelu_gated_llama_is_generated_whole_and_passes(tmp_path: Path) -> None:
    """A ``hidden_act`` the shared gated MLP computes is wired, not stubbed."""
    source = tmp_path / "src"
    source.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (source / name).write_bytes((FIXTURES / "llama" / name).read_bytes())
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu_pytorch_tanh"}))
    out = tmp_path / "gelu_llama"
    summary = new_model(source, "gelu_llama", out=out, tiny=True)
    assert summary["stubs"] == [] and summary["assumed"] == []
    assert "gated MLP (gelu_pytorch_tanh)" in (out / "blocks.py").read_text()
    ref = resolve_model(out)
    report = run_parity(
        ref.checkpoint_dir,
        runner_factory=ref.runner_factory(),
        runner_name=ref.runner_name,
        checks=("layers",),
    )
    assert report.passed, report.summary()


def test_unknown_architecture_gets_marked_stubs(gpt_oss_dir: Path) -> None:
    # weights.py for CONFIG_SUBMODULES: the source's attention_bias makes the q/k/v/o biases
    files = sorted(p.name for p in gpt_oss_dir.iterdir() if p.is_file())
    assert files == sorted([*GENERATED, "weights.py"])
    blocks = import_model_module(gpt_oss_dir, "blocks", "gpt_oss")
    assert set(blocks.STUBS) == {
        "gpt_oss_attention",
        "gpt_oss_mlp",
        "gpt_oss_rms_norm",
        "gpt_oss_rotary_embedding",
    }
    assert blocks.ASSUMED == ("gpt_oss_decoder_layer",)
    notes = (gpt_oss_dir / "NOTES.md").read_text()
    for fn in blocks.STUBS:
        assert f"`{fn}` | " in notes and f"- [ ] `blocks.{fn}`" in notes
    assert "0-22 step 2 | sliding_attention | 128 | sliding_window(128)" in notes
    source = (gpt_oss_dir / "blocks.py").read_text()
    assert source.count("# STUB: port") == 4


def _stub_error(call: Any) -> str:
    with pytest.raises(NotImplementedError) as info:
        call()
    return str(info.value)


def test_calling_a_stub_names_class_file_line_and_shapes(gpt_oss_dir: Path) -> None:
    from transformers.models.gpt_oss import modeling_gpt_oss as hf

    from resin.runners.torch.context import LayerContext

    blocks = import_model_module(gpt_oss_dir, "blocks", "gpt_oss")
    tokens = torch.zeros(3, dtype=torch.long)
    ctx = LayerContext(
        index=0, config=None, head_dim=64, dtype=torch.float32, input_ids=tokens, positions=tokens
    )
    for fn, cls, shape in (
        ("gpt_oss_attention", hf.GptOssAttention, "x [T, 2880] -> [T, 2880]"),
        ("gpt_oss_mlp", hf.GptOssMLP, "x [T, 2880] -> [T, 2880]"),
        ("gpt_oss_rms_norm", hf.GptOssRMSNorm, "x [T, 2880] -> [T, 2880]"),
    ):
        message = _stub_error(lambda fn=fn: getattr(blocks, fn)(torch.zeros(3, 2880), {}, ctx))
        line = inspect.getsourcelines(cls)[1]
        assert cls.__name__ in message and f"blocks.{fn}" in message
        assert f"{inspect.getsourcefile(cls)}:{line}" in message
        assert shape in message
    message = _stub_error(lambda: blocks.gpt_oss_attention(torch.zeros(3, 2880), {}, ctx))
    assert "sinks (64,)" in message  # the weights it must use, with the source shapes
    assert re.search(r"HF meta forward.*Tensor\[1,5,2880\]", message)
    # the runner itself stops at the first stub it needs, naming it
    message = _stub_error(lambda: resolve_model(gpt_oss_dir).load_runner())
    assert "GptOssRotaryEmbedding" in message and "modeling_gpt_oss.py:" in message


def test_unknown_architecture_tiny_checkpoint_and_weight_map(gpt_oss_dir: Path) -> None:
    tiny = gpt_oss_dir / "tiny"
    size = sum(p.stat().st_size for p in tiny.iterdir())
    assert size < 2_000_000
    config = json.loads((tiny / "config.json").read_text())
    assert config["architectures"] == ["GptOssForCausalLM"]
    assert config["layer_types"] == ["sliding_attention", "full_attention"] * 2
    assert config["sliding_window"] == 32 and config["attention_bias"] is True
    # the clamp is lowered so the tiny activations reach it (listed in NOTES.md)
    assert config["swiglu_limit"] < 7.0 and config["rope_parameters"]["rope_type"] == "yarn"
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tiny))
    with torch.no_grad():
        assert hf(torch.tensor([[0, 5, 9]])).logits.shape == (1, 3, 384)
    # every tiny tensor is a pattern of the record, loaded without transformers
    from resin.runners.torch.model_dir import ModelRecord, check_source_shapes
    from resin.runners.torch.model_weights import load_model_weights

    record = ModelRecord.load(gpt_oss_dir)
    loaded = load_model_weights(tiny, 4, known_patterns=record.checkpoint_patterns)
    assert loaded.unused == []
    assert loaded.layers[0]["self_attn.sinks"].shape == (4,)
    assert loaded.module(1, "mlp")["experts.gate_up_proj"].shape == (4, 64, 64)
    problems = check_source_shapes(record, tiny)  # tiny shapes differ from gpt-oss-20b's
    assert problems and any("self_attn.sinks" in p and "(64,)" in p for p in problems)


def test_cli_new_model(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from resin.cli import app

    out = tmp_path / "m"
    result = CliRunner().invoke(
        app,
        [
            "new-model",
            str(FIXTURES / "llama" / "config.json"),
            "--name",
            "llama_cli",
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "LlamaForCausalLM" in result.output and (out / "architecture.json").is_file()
    assert not (out / "runner.py").exists()
    again = CliRunner().invoke(
        app, ["new-model", str(FIXTURES / "llama"), "--name", "llama_cli", "--out", str(out)]
    )
    assert again.exit_code == 2 and "--force" in again.output
    bad = CliRunner().invoke(app, ["new-model", str(tmp_path / "nope"), "--name", "x"])
    assert bad.exit_code == 2


def test_layer_map_names() -> None:
    from resin.scaffold.layer_map import function_name, name_pattern, runner_name
    from resin.scaffold.render import compact_indices

    assert function_name("GptOssRMSNorm") == "gpt_oss_rms_norm"
    assert function_name("Qwen3MoeSparseMoeBlock") == "qwen3_moe_sparse_moe_block"
    assert name_pattern("model.layers.3.mlp.experts.7.w1.weight") == (
        "model.layers.{layer}.mlp.experts.{expert}.w1.weight",
        3,
        7,
    )
    assert (
        runner_name(
            "model.layers.0.mlp.experts.gate_up_proj",
            "model.layers.0.block_sparse_moe.experts.2.w1.weight",
            8,
        )
        == "layers.0.mlp.experts.2.w1.weight"
    )
    assert (
        runner_name(
            "model.layers.0.mlp.gate.weight", "model.layers.0.block_sparse_moe.gate.weight", 1
        )
        == "layers.0.mlp.gate.weight"
    )
    assert [compact_indices(x) for x in ([4], [0, 1, 2], [1, 3, 5], [0, 1, 5])] == [
        "4",
        "0-2",
        "1-5 step 2",
        "0, 1, 5",
    ]


def _fill_stub(source: str, fn: str, body: str) -> str:
    """Replace the stub body of ``fn`` (from its ``# STUB:`` comment to the function's end)."""
    start = source.index(f"def {fn}(")
    stub = source.index("    # STUB:", start)
    end = source.index("\n\n\n", stub)
    return (
        source[:stub] + textwrap.indent(body.strip("\n") + "\n", "    ").rstrip("\n") + source[end:]
    )


def test_skill_worked_example_passes_parity(gpt_oss_dir: Path, tmp_path: Path) -> None:
    """The gpt-oss code in skills/add-model/SKILL.md, pasted into the stubs, passes parity."""
    import shutil

    skill = (Path(__file__).resolve().parents[1] / "skills" / "add-model" / "SKILL.md").read_text()
    attention, mlp = [textwrap.dedent(b) for b in re.findall(r"```python\n(.*?)```", skill, re.S)]
    rotary = re.search(r"`(return rope_from_config\(.*?\))`", skill).group(1)  # type: ignore[union-attr]
    norm = re.search(r"`(return rms_norm\(.*?\)\))`", skill).group(1)  # type: ignore[union-attr]
    model = tmp_path / "gpt_oss"
    shutil.copytree(gpt_oss_dir, model)
    source = (model / "blocks.py").read_text()
    for fn, body in (
        ("gpt_oss_rotary_embedding", rotary),
        ("gpt_oss_rms_norm", norm),
        ("gpt_oss_attention", attention),
        ("gpt_oss_mlp", mlp),
    ):
        source = _fill_stub(source, fn, body)
    assert "raise NotImplementedError(\n        'GptOss" not in source
    (model / "blocks.py").write_text(source)
    report = run_model_parity(resolve_model(model), max_new_tokens=4)
    assert report.passed, report.summary()


def test_generation_is_deterministic_and_rejects_other_layouts(tmp_path: Path) -> None:
    first, second = tmp_path / "a" / "m", tmp_path / "b" / "m"
    for out in (first, second):
        new_model(FIXTURES / "mistral", "m", out=out)
    assert {p.name: p.read_bytes() for p in first.iterdir()} == {
        p.name: p.read_bytes() for p in second.iterdir()
    }
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2).to_json_file(gpt2 / "config.json")
    with pytest.raises(ValueError, match="Llama-style layout"):
        new_model(gpt2, "gpt2", out=tmp_path / "gpt2_out")


def test_eval_parity_on_an_unfinished_runner_exits_one_with_json(
    gpt_oss_dir: Path, tmp_path: Path
) -> None:
    from typer.testing import CliRunner

    from resin.evals.cli import eval_app

    out = tmp_path / "parity.json"
    result = CliRunner().invoke(eval_app, ["parity", str(gpt_oss_dir), "--json", str(out)])
    assert result.exit_code == 1, result.output
    report = json.loads(out.read_text())
    assert report["passed"] is False and report["error"] == "runner not finished"
    assert "GptOssRotaryEmbedding" in report["detail"] and report["runner"] == "model:gpt_oss"


def test_an_mha_source_records_kv_widths_from_the_kv_heads(tmp_path: Path) -> None:
    """A source giving each query head its own KV head (OLMo 2 7B, Qwen1.5-MoE): its k / v
    widths equal ``hidden_size``, so the shape probe shares KV heads to tell the two apart —
    the record then takes a grouped-query checkpoint of the same architecture (OLMo 2 32B)."""
    from resin.scaffold.cli import _probe_architecture
    from resin.scaffold.inspect import inspect_architecture
    from resin.scaffold.shape_rules import evaluate, shape_rules

    config = json.loads((FIXTURES / "llama" / "config.json").read_text())
    config.update(num_attention_heads=8, num_key_value_heads=8, head_dim=32, hidden_size=256)
    source = tmp_path / "config.json"
    source.write_text(json.dumps(config))
    probe, warning = _probe_architecture(source)
    assert warning is None and probe is not None
    arch = inspect_architecture(source)
    rules = shape_rules(arch, probe)["kinds"]["full_attention/dense"]
    assert rules["self_attn.k_proj.weight"] == ["head_dim*num_key_value_heads", "hidden_size"]
    assert rules["self_attn.v_proj.weight"][0] == "head_dim*num_key_value_heads"
    # The tiny's own widths (4 query heads, 4 KV heads) cannot tell them apart: its head_dim
    # trap (20, not hidden / heads) keeps k from binding to hidden_size, but with as many KV
    # heads as query heads the two products tie, so the rule is left unchecked (None).
    from resin.scaffold.tiny_checkpoint import tiny_config

    plain = shape_rules(arch, inspect_architecture(tiny_config(source), probe_shapes=False))
    assert plain["kinds"]["full_attention/dense"]["self_attn.k_proj.weight"][0] is None
    grouped = {**config, "num_key_value_heads": 2}
    assert evaluate(rules["self_attn.k_proj.weight"], grouped) == [64, 256]


def test_a_sliding_window_switch_records_both_layer_kinds() -> None:
    """A config class deriving its layer types from ``use_sliding_window`` (Qwen2-MoE, SmolLM3)
    made from a source with the switch off still records the sliding kind, with the same
    modules; a config whose layer types are its own (a pattern, Gemma 2) mirrors nothing."""
    from types import SimpleNamespace

    from resin.scaffold.record import window_toggled_kinds

    full = {"full_attention/dense": "entry", "full_attention/moe": "entry2"}
    switched = SimpleNamespace(use_sliding_window=False, layer_types=["full_attention"] * 4)
    assert window_toggled_kinds(switched, full) == {
        "sliding_attention/dense": "full_attention/dense",
        "sliding_attention/moe": "full_attention/moe",
    }
    patterned = SimpleNamespace(layer_types=["full_attention"] * 4, sliding_window_pattern=2)
    assert window_toggled_kinds(patterned, full) == {}
    mixed = {"full_attention/dense": "a", "sliding_attention/dense": "b"}
    assert window_toggled_kinds(switched, mixed) == {}


def test_a_checkpoint_with_a_source_flag_off_loads(tmp_path: Path) -> None:
    """A Llama source with ``attention_bias`` true records q/k/v/o biases; a checkpoint made
    with the flag false has none. The scaffold finds which layer tensors each true flag
    creates (the model built with it false) and writes them to ``weights.CONFIG_SUBMODULES``,
    so that checkpoint loads and passes; it was refused as missing the biases."""
    from tests.model_variants import built_checkpoint

    source = tmp_path / "src"
    source.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (source / name).write_bytes((FIXTURES / "llama" / name).read_bytes())
    config = {**json.loads((source / "config.json").read_text()), "attention_bias": True}
    (source / "config.json").write_text(json.dumps(config))
    out = tmp_path / "biased"
    new_model(source, "biased", out=out, tiny=True)
    assert '"self_attn.q_proj.bias": _flag("attention_bias")' in (out / "weights.py").read_text()
    plain = {**json.loads((out / "tiny" / "config.json").read_text()), "attention_bias": False}
    checkpoint = built_checkpoint(out / "tiny", tmp_path / "no_bias", plain)
    ref = resolve_model(out)
    for path in (ref.checkpoint_dir, checkpoint):
        report = run_parity(
            path,
            runner_factory=ref.runner_factory(),
            runner_name=ref.runner_name,
            checks=("layers",),
        )
        assert report.passed, (path, report.summary())
