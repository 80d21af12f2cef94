"""``resin eval parity`` options and reference failures: ``--checkpoint DIR`` checks another
checkpoint with a model directory's settings; an HF reference that cannot load or run is a
failed stage with its reason (report, summary, JSON, exit 1), never a traceback."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from typer.testing import CliRunner  # noqa: E402

from resin.evals import parity as parity_mod  # noqa: E402
from resin.evals.cli import eval_app  # noqa: E402
from resin.evals.parity import run_parity  # noqa: E402
from resin.evals.parity_engine import GREEDY_STAGES  # noqa: E402

FIXTURES = Path(__file__).resolve().parent / "fixtures"
REPO = Path(__file__).resolve().parents[1]


def _copy(name: str, tmp_path: Path) -> Path:
    """A private copy: the HF-model cache is keyed by path, so tests cannot share one."""
    return Path(shutil.copytree(FIXTURES / name, tmp_path / name))


def _no_runner(_path: str) -> Any:
    raise AssertionError("the runner must not be built when the reference is unusable")


def test_reference_that_fails_to_load_is_a_failed_stage(tmp_path: Path) -> None:
    ckpt = _copy("llama", tmp_path)
    (ckpt / "model.safetensors").write_bytes(b"not a safetensors file")
    report = run_parity(ckpt, runner_factory=_no_runner)
    assert not report.passed
    assert [s.name for s in report.stages] == ["reference"]
    assert report.stages[0].detail.startswith("HF reference failed to load (float32): ")
    assert report.reference_error == report.stages[0].detail
    data = json.loads(report.to_json())
    assert data["passed"] is False and data["reference_error"].startswith("HF reference failed")
    assert "[FAIL] reference: HF reference failed to load" in report.summary()


def test_reference_forward_that_raises_fails_every_stage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_load = parity_mod.load_hf_model

    def broken(model_dir: Any, dtype: str = "float32") -> Any:
        model = real_load(model_dir, dtype)

        def boom(*_args: Any) -> None:
            raise RuntimeError("boom in HF layer 0")

        model.model.layers[0].register_forward_pre_hook(boom)
        return model

    monkeypatch.setattr(parity_mod, "load_hf_model", broken)
    report = run_parity(
        _copy("llama", tmp_path), runner_factory=lambda _p: object(), max_new_tokens=2
    )
    names = [s.name for s in report.stages]
    assert names == ["layers", "logits", *GREEDY_STAGES]
    assert not any(s.passed for s in report.stages)
    assert (
        report.stage("layers").detail
        == "reference crashed: HF forward (float32) raised RuntimeError: boom in HF layer 0"
    )
    assert report.stage("greedy/preemption").detail.startswith(
        "reference crashed: HF greedy decoding raised RuntimeError: boom"
    )
    assert report.reference_error == report.stage("layers").detail
    # greedy only: the greedy loop's failure is the recorded reason
    only_greedy = run_parity(
        _copy("qwen3", tmp_path),
        runner_factory=lambda _p: object(),
        max_new_tokens=2,
        checks=("greedy",),
    )
    assert [s.name for s in only_greedy.stages] == list(GREEDY_STAGES)
    assert only_greedy.reference_error.startswith("reference crashed: HF greedy decoding")


def test_cli_reports_a_broken_reference_with_exit_1(tmp_path: Path) -> None:
    ckpt = _copy("llama", tmp_path)
    (ckpt / "model.safetensors").write_bytes(b"garbage")
    out = tmp_path / "report.json"
    result = CliRunner().invoke(eval_app, ["parity", str(ckpt), "--json", str(out)])
    assert result.exit_code == 1, result.output
    assert "[FAIL] reference: HF reference failed to load" in result.output
    assert isinstance(result.exception, SystemExit)  # typer.Exit(1), not a traceback
    data = json.loads(out.read_text())
    assert data["stages"][0]["name"] == "reference" and not data["passed"]


def _text(output: str) -> str:
    """CLI output with rich's error-box borders and line wrapping removed."""
    return " ".join(output.replace("│", " ").split())


def _model_dir(tmp_path: Path, checkpoint: Path) -> Path:
    model_dir = tmp_path / "mymodel"
    model_dir.mkdir()
    (model_dir / "architecture.json").write_text(
        json.dumps({"name": "mymodel", "architectures": ["LlamaForCausalLM"]})
    )
    (model_dir / "parity.toml").write_text(f'[reference]\ncheckpoint = "{checkpoint}"\n')
    return model_dir


def test_checkpoint_option_overrides_parity_toml(tmp_path: Path) -> None:
    model_dir = _model_dir(tmp_path, FIXTURES / "llama")
    other = _copy("qwen3", tmp_path)
    out = tmp_path / "report.json"
    result = CliRunner().invoke(
        eval_app,
        [
            "parity",
            str(model_dir),
            "--runner",
            "torch",
            "--checkpoint",
            str(other),
            "--max-new-tokens",
            "2",
            "--json",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    assert f"parity PASS: {other}" in result.output and "greedy/preemption" in result.output
    data = json.loads(out.read_text())
    assert data["model_dir"] == str(other) and data["passed"]
    assert f'checkpoint = "{FIXTURES / "llama"}"' in (model_dir / "parity.toml").read_text()


def test_checkpoint_option_usage_errors(tmp_path: Path) -> None:
    model_dir = _model_dir(tmp_path, FIXTURES / "llama")
    missing = CliRunner().invoke(
        eval_app, ["parity", str(model_dir), "--checkpoint", str(tmp_path / "nope")]
    )
    assert missing.exit_code == 2 and "no config.json" in _text(missing.output)
    plain = CliRunner().invoke(
        eval_app, ["parity", str(FIXTURES / "llama"), "--checkpoint", str(FIXTURES / "qwen3")]
    )
    assert plain.exit_code == 2 and "itself a checkpoint" in _text(plain.output)


class _TwoPathModel:
    """A stand-in HF causal LM whose cached decode departs from its full forward once the
    sequence is ``split_at`` tokens long: logits favour token ``len % 5`` in the full forward,
    and ``(len + 1) % 5`` on the cached path from ``split_at`` on."""

    def __init__(self, split_at: int) -> None:
        import transformers

        self.split_at = split_at
        self.config = transformers.LlamaConfig(
            vocab_size=5, hidden_size=8, num_hidden_layers=1, num_attention_heads=1
        )

    def forward(self, input_ids: Any, use_cache: bool = False, past_key_values: Any = None) -> Any:
        import torch

        if use_cache:
            seen = getattr(past_key_values, "_seen", 0) + input_ids.shape[1]
            past_key_values._seen = seen
        else:
            seen = input_ids.shape[1]
        favoured = (seen + (1 if use_cache and seen >= self.split_at else 0)) % 5
        logits = torch.zeros(1, input_ids.shape[1], 5)
        logits[0, -1, favoured] = 3.0
        return type("Out", (), {"logits": logits})()

    __call__ = forward


def test_greedy_reference_modes_and_the_cached_vs_full_finding() -> None:
    from resin.evals.parity_engine import GreedyReference, cached_vs_full_forward

    model = _TwoPathModel(split_at=6)
    prompts = [[1, 2, 3, 4]]
    full = GreedyReference.compute(model, prompts, 4, "full_forward")
    cached = GreedyReference.compute(model, prompts, 4, "cached")
    assert full.tokens == [[4, 0, 1, 2]]
    assert cached.tokens[0][:2] == [4, 0] and cached.tokens != full.tokens
    finding, metrics = cached_vs_full_forward(model, full, tie_margin=1e-3)
    assert finding is not None and "request 0 output position 2" in finding
    assert metrics["first"]["cached_token"] == 2 and metrics["first"]["full_forward_token"] == 1
    assert metrics["argmax_disagreements"] == 2
    agreeing = _TwoPathModel(split_at=100)
    finding, metrics = cached_vs_full_forward(
        agreeing, GreedyReference.compute(agreeing, prompts, 4, "full_forward"), 1e-3
    )
    assert finding is None and metrics["argmax_disagreements"] == 0
    with pytest.raises(ValueError, match="greedy reference"):
        GreedyReference.compute(model, prompts, 1, "sampled")


def test_parity_toml_greedy_reference_is_validated(tmp_path: Path) -> None:
    from resin.evals.model_ref import ModelRefError, parity_settings, resolve_model

    model_dir = tmp_path / "m"
    shutil.copytree(REPO / "resin" / "models" / "deepseek_v4_flash", model_dir, dirs_exist_ok=True)
    assert parity_settings(resolve_model(model_dir))["greedy_reference"] == "full_forward"
    text = (model_dir / "parity.toml").read_text().replace('"full_forward"', '"sometimes"')
    (model_dir / "parity.toml").write_text(text)
    with pytest.raises(ModelRefError, match="greedy"):
        parity_settings(resolve_model(model_dir))


def test_the_python_default_runner_is_the_one_the_cli_checks() -> None:
    """``run_parity`` without a factory runs the built-in runner on the parity attention backend,
    as ``resin eval parity`` does (not a server's faster default)."""
    from resin.evals.parity import default_runner_factory
    from resin.runners.torch.attention import PARITY_BACKEND

    assert default_runner_factory(FIXTURES / "llama").attention_backend.name == PARITY_BACKEND


def _short_dynamic_rope(tmp_path: Path) -> Path:
    """The Llama fixture with a ``dynamic`` rope and a 32-token pretrained length: past it
    transformers recomputes every position's frequencies (Resin serves no further)."""
    path = _copy("llama", tmp_path)
    config = json.loads((path / "config.json").read_text())
    config.update(max_position_embeddings=32, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_default_prompts_are_shortened_to_the_supported_length(tmp_path: Path) -> None:
    """Past its length the reference and the runner compute different things by design: the
    default prompts are cut to fit (and the report says so) instead of reporting a departure
    at layer 0."""
    report = run_parity(_short_dynamic_rope(tmp_path), checks=("layers",))
    assert report.passed, report.summary()
    assert report.prompt_notes and "supported length is 32" in report.prompt_notes[0]
    assert "[note] prompts: shortened to 24 tokens (+ 8 generated)" in report.summary()


def test_given_prompts_past_the_supported_length_run_with_a_note(tmp_path: Path) -> None:
    """Prompts the caller gives run as given (a test of the long-context rule itself may want
    them); the report says the comparison leaves what Resin serves."""
    report = run_parity(_short_dynamic_rope(tmp_path), prompts=[list(range(4, 44))])
    (note,) = report.prompt_notes
    assert "40 tokens + 8 generated run past the checkpoint's supported length 32" in note
    assert "rope type 'dynamic'" in note and "not a runner bug" in note
    assert f"[note] prompts: {note}" in report.summary()


def test_a_crash_names_the_original_error_and_the_model_code_that_raised_it() -> None:
    """A stage that crashes says what a model's author needs: the runner's own exception (not
    the engine's StepError wrapping it) with its type, and the line of the model directory's
    code it came from."""
    from resin.evals.parity_engine import crash_detail

    code = compile(
        "def final_norm(w):\n    return w['norm.weight']\n", "/m/models/x/blocks.py", "exec"
    )
    scope: dict = {}
    exec(code, scope)
    try:
        try:
            scope["final_norm"]({})
        except KeyError as cause:
            error = RuntimeError("'norm.weight'")
            error.cause = cause  # type: ignore[attr-defined]
            raise error from cause
    except RuntimeError as exc:
        detail = crash_detail(exc)
    assert detail.startswith("KeyError: 'norm.weight' at /m/models/x/blocks.py:2 in final_norm")
    assert detail.endswith("(in RuntimeError)")
