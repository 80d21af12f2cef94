"""``resin new-model --tiny`` on a multimodal wrapper config (``text_config`` + a vision tower),
with no flat copy: the scaffold builds the wrapper's image-text-to-text class on the meta device
(``resin.scaffold.hf_model``, the fallback the parity harness uses), walks the text model at its
decoder stack, records the tensors under the names the wrapper's own ``save_pretrained``
writes, maps them to the runner's names and lists the towers as ``IGNORED_PREFIXES``; the
tiny maker writes a text-serving wrapper checkpoint (the tower one block deep and narrow).

Three families, each with its own checkpoint naming, all tiny configs made with transformers:

- GLM-5.3-Flash (``Glm5NextConfig``; ``model.language_model.*``, tower ``model.visual.*``):
  the scaffold leaves its blocks as stubs, so the runner check reuses the hand-written
  ``resin/models/glm5_flash/blocks.py`` with the *generated* ``architecture.json`` and
  ``weights.py`` on the scaffold's own tiny wrapper checkpoint — the record and the weight map
  are what is under test, the blocks were checked on the flat checkpoint already. The record
  must equal the one committed for glm5_flash (generated from the same text config in flat
  form) up to the checkpoint prefix.
- Mistral-3 (``Mistral3Config``; legacy ``language_model.model.*``, towers ``vision_tower.*`` and
  ``multi_modal_projector.*``; lm_head tied by the *outer* config while the text config says
  untied, so the tiny stores no lm_head): every block is one Resin has, so the generated
  directory runs as generated and every parity stage passes against HF's
  ``Mistral3ForConditionalGeneration``.
- Qwen2-VL (``Qwen2VLConfig``; text tensors saved as ``model.*``, tower ``visual.*``): the
  record and weight map only (its M-RoPE is a stub).

torch runs one thread here (shared 2-core machines).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from resin.evals.model_ref import resolve_model, run_model_parity  # noqa: E402
from resin.loading.weights import WeightsError  # noqa: E402
from resin.scaffold.cli import new_model  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
GLM_DIR = REPO / "resin" / "models" / "glm5_flash"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _module(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(f"wrapper_test_{path.parent.name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tensor_names(checkpoint: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(checkpoint / "model.safetensors"), "np") as f:
        return list(f.keys())


def _save_source(config: Any, path: Path) -> Path:
    path.mkdir(parents=True)
    config.save_pretrained(path)
    assert "text_config" in json.loads((path / "config.json").read_text())
    return path


@pytest.fixture(scope="module")
def glm(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``resin new-model --tiny`` on GLM-5.3-Flash's wrapper config: the committed source text
    config (5 layers, both mixers, both MLP types) + a two-block vision tower."""
    root = tmp_path_factory.mktemp("glm_wrapper")
    text = json.loads((GLM_DIR / "source" / "config.json").read_text())
    vision = {
        "model_type": "glm5_next_vision",
        "depth": 2,
        "hidden_size": 64,
        "num_heads": 2,
        "intermediate_size": 64,
        "out_hidden_size": text["hidden_size"],
    }
    config = transformers.Glm5NextConfig(
        text_config=text,
        vision_config=vision,
        architectures=["Glm5NextForConditionalGeneration"],
    )
    assert type(config) not in transformers.AutoModelForCausalLM._model_mapping
    source = _save_source(config, root / "source")
    summary = new_model(source, "glm_wrapper", root / "out", tiny=True)
    return {"root": root, "out": root / "out", "summary": summary}


def test_glm_wrapper_record_is_the_flat_record_under_the_wrapper_names(glm: dict[str, Any]) -> None:
    out = glm["out"]
    assert glm["summary"]["architecture"] == "Glm5NextForConditionalGeneration"
    record = json.loads((out / "architecture.json").read_text())
    flat = json.loads((GLM_DIR / "architecture.json").read_text())
    assert record["architectures"] == ["Glm5NextForConditionalGeneration"]
    assert record["model_types"] == ["glm5_next"]
    # the text layers, their classes and tensors: what the flat text config gave
    assert record["layer_kinds"] == flat["layer_kinds"]
    assert sorted(record["layer_kinds"]) == [
        "indexed_attention/dense",
        "indexed_attention/sparse",
        "linear_attention/dense",
        "linear_attention/sparse",
    ]
    assert record["config_defaults"] == flat["config_defaults"]  # the text config class's
    patterns = record["checkpoint_patterns"]
    assert "model.language_model.layers.{layer}.self_attn.q_proj.weight" in patterns
    assert not any(p.startswith(("model.visual.", "model.layers.")) for p in patterns)
    as_flat = {p.replace("model.language_model.", "model.", 1) for p in patterns}
    assert as_flat == set(flat["checkpoint_patterns"])
    assert not any("visual" in p for p in record["source_shapes"])
    # the tower is not a module the scaffold failed to place: hc_head is the only warning
    assert [w.split(" (")[0] for w in glm["summary"]["warnings"]] == ["module model.hc_head"]


def test_glm_wrapper_weights_map_to_runner_names_and_ignore_the_tower(glm: dict[str, Any]) -> None:
    weights = _module(glm["out"] / "weights.py")
    assert weights.IGNORED_PREFIXES == ("model.visual.",)
    wmap = weights.WEIGHT_MAP
    assert wmap["model.language_model.embed_tokens.weight"] == "embed_tokens.weight"
    assert wmap["model.language_model.norm.weight"] == "norm.weight"
    # HF renames on load (forget_gate, attn_hc) and splits on save (q/k/v conv): runner names
    assert (
        wmap["model.language_model.layers.{layer}.self_attn.A_log"]
        == "layers.{layer}.self_attn.forget_gate.A_log"
    )
    assert (
        wmap["model.language_model.layers.{layer}.self_attn.q_conv1d.weight"]
        == "layers.{layer}.self_attn.q_conv1d.weight"
    )
    record = json.loads((glm["out"] / "architecture.json").read_text())
    for pattern in record["checkpoint_patterns"]:
        target = wmap.get(pattern, pattern)
        assert not target.startswith(("model.", "language_model.")), (pattern, target)
    blocks = (glm["out"] / "blocks.py").read_text()
    assert "def normalise_config" in blocks and '"text_config"' in blocks


def test_glm_wrapper_tiny_is_a_text_serving_wrapper_checkpoint(glm: dict[str, Any]) -> None:
    tiny = glm["out"] / "tiny"
    config = json.loads((tiny / "config.json").read_text())
    assert config["architectures"] == ["Glm5NextForConditionalGeneration"]
    assert config["text_config"]["vocab_size"] == 384
    assert config["vision_config"]["depth"] == 1
    names = _tensor_names(tiny)
    assert any(n.startswith("model.language_model.layers.") for n in names)
    assert any(n.startswith("model.visual.") for n in names), "saved as the wrapper saves"
    assert sum(f.stat().st_size for f in tiny.iterdir()) < 2_000_000
    changes = [
        line[2:] for line in (tiny / "CHANGES.md").read_text().splitlines() if line[:2] == "- "
    ]
    shrunk = [line for line in changes if line.startswith("shrunk: ")]
    # the text config is what was shrunk (q_lora_rank 48 -> 32 among others), the tower apart
    assert "shrunk: text_config.q_lora_rank 48 -> 32" in shrunk
    assert all(line.startswith("shrunk: text_config.") for line in shrunk), shrunk
    assert any(line.startswith("threshold: text_config.swiglu_limit") for line in changes)
    assert any(
        line.startswith("tower: vision_config (glm5_next_vision) depth 2 -> 1") for line in changes
    )


def _glm_run_dir(glm: dict[str, Any], name: str) -> Path:
    """The generated record and weight map with glm5_flash's hand-written blocks (and the
    reference adjustment that goes with them: the indexer's tie-break), on the scaffold's tiny
    wrapper checkpoint (layers stage only)."""
    run = glm["root"] / name
    run.mkdir()
    for file in ("architecture.json", "weights.py", "parity.toml"):
        shutil.copy(glm["out"] / file, run / file)
    for file in ("blocks.py", "reference.py"):
        shutil.copy(GLM_DIR / file, run / file)
    (run / "tiny").symlink_to(glm["out"] / "tiny")
    return run


def _layers_only(run: Path) -> Any:
    ref = resolve_model(run)
    ref.parity_spec = {
        **ref.parity_spec,
        "stress": {**ref.parity_spec.get("stress", {}), "checks": ["layers"]},
    }
    return ref


def test_glm_wrapper_checkpoint_runs_and_passes_layers_parity(glm: dict[str, Any]) -> None:
    ref = _layers_only(_glm_run_dir(glm, "run"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = run_model_parity(ref, dtype="float32")
    assert report.passed, report.summary()
    stage = report.stage("layers")
    assert stage.metrics["num_checkpoints"] > 20  # every layer's sub-modules, not a few
    unused = [str(w.message) for w in caught if "does not use" in str(w.message)]
    assert len(unused) == 1 and "model.visual." in unused[0], unused


def test_glm_wrapper_checkpoint_without_ignored_prefixes_is_refused(glm: dict[str, Any]) -> None:
    """The tower loads as unused because of IGNORED_PREFIXES, not by accident."""
    run = _glm_run_dir(glm, "run_no_ignore")
    text = (
        (run / "weights.py")
        .read_text()
        .replace('IGNORED_PREFIXES = ("model.visual.",)', "IGNORED_PREFIXES = ()")
    )
    (run / "weights.py").write_text(text)
    from resin.runners.torch.model_dir import ModelDirRunner

    with pytest.raises(WeightsError, match="model.visual"):
        ModelDirRunner.from_model_dir(run, run / "tiny")


@pytest.fixture(scope="module")
def mistral3(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("mistral3_wrapper")
    config = transformers.Mistral3Config(
        text_config=dict(
            model_type="mistral",
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            vocab_size=1000,
        ),
        vision_config=dict(
            model_type="pixtral",
            hidden_size=64,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            head_dim=32,
        ),
        architectures=["Mistral3ForConditionalGeneration"],
    )
    source = _save_source(config, root / "source")
    summary = new_model(source, "mistral3_wrapper", root / "out", tiny=True)
    return {"out": root / "out", "summary": summary}


def test_mistral3_wrapper_scaffold_names_and_towers(mistral3: dict[str, Any]) -> None:
    out = mistral3["out"]
    summary = mistral3["summary"]
    assert summary["architecture"] == "Mistral3ForConditionalGeneration"
    assert summary["stubs"] == [] and summary["warnings"] == []
    weights = _module(out / "weights.py")
    assert weights.IGNORED_PREFIXES == ("vision_tower.", "multi_modal_projector.")
    assert weights.WEIGHT_MAP["language_model.model.embed_tokens.weight"] == "embed_tokens.weight"
    record = json.loads((out / "architecture.json").read_text())
    assert record["config_defaults"]["tie_word_embeddings"] is True  # Mistral3Config's
    assert "language_model.model.layers.{layer}.mlp.up_proj.weight" in record["checkpoint_patterns"]
    tiny = json.loads((out / "tiny" / "config.json").read_text())
    # HF ties by the outer config; the text config says otherwise
    assert (
        tiny["tie_word_embeddings"] is True and tiny["text_config"]["tie_word_embeddings"] is False
    )
    names = _tensor_names(out / "tiny")
    assert not any("lm_head" in n for n in names)
    assert any(n.startswith("vision_tower.") for n in names)
    assert any(n.startswith("multi_modal_projector.") for n in names)


def test_mistral3_wrapper_passes_every_parity_stage_as_generated(mistral3: dict[str, Any]) -> None:
    report = run_model_parity(resolve_model(mistral3["out"]), dtype="float32")
    assert report.passed, report.summary()
    assert report.stage("layers").metrics["num_checkpoints"] > 10
    assert any(s.name.startswith("greedy/") for s in report.stages)


def test_qwen2_vl_wrapper_records_model_names_and_the_visual_tower(tmp_path: Path) -> None:
    config = transformers.Qwen2VLConfig(
        text_config=dict(
            model_type="qwen2_vl_text",
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=512,
            rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3]},
        ),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2),
        architectures=["Qwen2VLForConditionalGeneration"],
    )
    source = _save_source(config, tmp_path / "source")
    new_model(source, "qwen2_vl_wrapper", tmp_path / "out")
    record = json.loads((tmp_path / "out" / "architecture.json").read_text())
    assert record["model_types"] == ["qwen2_vl"]
    assert "model.layers.{layer}.self_attn.q_proj.bias" in record["checkpoint_patterns"]
    assert not any(p.startswith("visual.") for p in record["checkpoint_patterns"])
    weights = _module(tmp_path / "out" / "weights.py")
    assert weights.IGNORED_PREFIXES == ("visual.",)
