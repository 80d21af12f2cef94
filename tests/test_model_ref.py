"""``resin.evals.model_ref.resolve_model``: checkpoint paths resolve through the model registry
(a built-in family: the torch reference runner), model directories and registered names to
their own blocks on the ``parity.toml`` reference checkpoint, with parity/perf specs parsed;
bad specs raise ``ModelRefError`` naming what was searched."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from resin.evals.model_ref import ModelRefError, import_model_module, resolve_model

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def _model_dir(root: Path, name: str = "foo") -> Path:
    """A model directory for Llama made by ``resin new-model``, whose blocks.py imports a
    sibling module (``from .helper import MARK``)."""
    pytest.importorskip("transformers")
    from resin.scaffold.cli import new_model

    model = root / name
    new_model(FIXTURES / "llama", name, out=model)
    shutil.copytree(FIXTURES / "llama", model / "tiny")
    (model / "helper.py").write_text("MARK = 3\n")
    blocks = model / "blocks.py"
    blocks.write_text(blocks.read_text() + "\nfrom .helper import MARK  # noqa: E402\n")
    (model / "parity.toml").write_text(
        '[reference]\ncheckpoint = "tiny"\n\n[tolerances]\nhidden = 1e-3\n'
    )
    (model / "perf.toml").write_text("[decode]\nbatch_sizes = [1, 2]\n")
    return model


def test_checkpoint_path_is_the_torch_runner() -> None:
    ref = resolve_model(FIXTURES / "llama")
    assert (ref.name, ref.model_dir, ref.runner_name) == ("llama", None, "torch")
    assert ref.parity_spec == {} and ref.perf_spec == {}
    assert resolve_model(FIXTURES / "llama" / "config.json").checkpoint_dir == FIXTURES / "llama"


def test_model_name_loads_its_runner_with_specs(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    model = _model_dir(tmp_path / "models")
    ref = resolve_model("foo", models_root=tmp_path / "models")
    assert ref.model_dir == model and ref.checkpoint_dir == model / "tiny"
    assert ref.parity_spec["tolerances"] == {"hidden": 1e-3}
    assert ref.perf_spec == {"decode": {"batch_sizes": [1, 2]}}
    runner = ref.load_runner(dtype="bfloat16")
    assert type(runner).__name__ == "ModelDirRunner" and runner.model_dir == model
    assert str(runner.dtype) == "torch.bfloat16"
    assert import_model_module(model, "blocks", "foo").MARK == 3
    # the same directory given as a path resolves the same way
    assert resolve_model(model).checkpoint_dir == model / "tiny"


def test_bad_specs_raise(tmp_path: Path) -> None:
    with pytest.raises(ModelRefError, match="unknown model 'nope'"):
        resolve_model("nope", models_root=tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelRefError, match="neither a checkpoint"):
        resolve_model(tmp_path / "empty")
    model = _model_dir(tmp_path / "m")
    (model / "parity.toml").write_text('[reference]\ncheckpoint = "missing"\n')
    with pytest.raises(ModelRefError, match="has no config.json"):
        resolve_model(model)
    (model / "parity.toml").write_text("[reference\n")
    with pytest.raises(ModelRefError, match="cannot read"):
        resolve_model(model)
