"""The model registry (``resin.registry``): every entry point resolves a checkpoint through it.

- the built-in families resolve to the torch reference runner, gpt-oss to the shipped
  ``models/gpt_oss``; an unknown architecture gets one error naming what is registered and how
  to add a model;
- a model directory made by ``resin new-model`` elsewhere is usable at once through
  ``models_dirs`` / ``--models-dir`` / ``$RESIN_MODELS_PATH``, ahead of the built-ins, and an
  explicit runner overrides the lookup;
- ``resin.LLM`` is importable from ``resin`` without loading torch; ``resin.LLM``, ``resin
  generate`` and ``resin serve`` run gpt-oss through the registry (a completion over HTTP);
- a change to the shared paged runner reaches a generated model with no edit in its directory.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import resin  # noqa: E402
from resin.registry import (  # noqa: E402
    MODELS_PATH_ENV,
    ModelRegistry,
    UnknownArchitectureError,
    resolve_runner,
)

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"
GPT_OSS_TINY = REPO / "resin" / "models" / "gpt_oss" / "tiny"
BUILTIN = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral")
GREEDY = resin.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def user_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A user's model directory for Llama, generated outside the checkout."""
    from resin.scaffold.cli import new_model

    root = tmp_path_factory.mktemp("my_models")
    new_model(FIXTURES / "llama", "my_llama", out=root / "my_llama")
    return root


@pytest.mark.parametrize("name", BUILTIN)
def test_builtin_families_resolve_to_the_reference_runner(name: str) -> None:
    entry = ModelRegistry(use_cwd=False, use_env=False).for_checkpoint(FIXTURES / name)
    assert (entry.name, entry.origin, entry.model_dir) == ("torch", "built-in", None)


def test_gpt_oss_resolves_to_the_shipped_model_everywhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # not the checkout: shipped models come from the package
    entry = ModelRegistry().for_checkpoint(GPT_OSS_TINY)
    assert (entry.name, entry.origin) == ("gpt_oss", "shipped")
    llm = resin.LLM(GPT_OSS_TINY, max_model_len=64)
    assert type(llm.runner).__name__ == "ModelDirRunner"
    (out,) = llm.generate([[5, 6, 7]], GREEDY)
    assert len(out.token_ids) == 6


def test_unknown_architecture_names_what_is_registered(tmp_path: Path) -> None:
    model = tmp_path / "gpt2"
    shutil.copytree(FIXTURES / "llama", model)
    config = json.loads((model / "config.json").read_text())
    config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnknownArchitectureError) as info:
        ModelRegistry(use_cwd=False).for_checkpoint(model)
    message = str(info.value)
    for needle in (
        "GPT2LMHeadModel",
        "gpt_oss",
        "LlamaForCausalLM",
        "resin new-model",
        "--models-dir",
        MODELS_PATH_ENV,
    ):
        assert needle in message, needle
    from typer.testing import CliRunner

    from resin.cli import app

    result = CliRunner().invoke(app, ["generate", str(model), "-p", "hi", "-n", "2"])
    assert result.exit_code == 1 and "GPT2LMHeadModel" in result.output


def test_user_model_dirs_come_first_and_runner_overrides(
    user_models: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoint = FIXTURES / "llama"
    registry = ModelRegistry([user_models], use_cwd=False, use_env=False)
    assert registry.for_checkpoint(checkpoint).name == "my_llama"
    monkeypatch.setenv(MODELS_PATH_ENV, str(user_models / "my_llama"))  # one model directory
    assert ModelRegistry(use_cwd=False).for_checkpoint(checkpoint).origin == "user"
    generated = resin.LLM(checkpoint, models_dirs=[user_models])
    builtin = resin.LLM(checkpoint, runner="torch")
    assert type(generated.runner).__name__ == "ModelDirRunner"
    assert type(builtin.runner).__name__ == "TorchRunner"
    prompts = [[3, 9, 27, 81], list(range(2, 40))]
    assert [o.token_ids for o in generated.generate(prompts, GREEDY)] == [
        o.token_ids for o in builtin.generate(prompts, GREEDY)
    ]
    by_path = resolve_runner(checkpoint, str(user_models / "my_llama"))
    assert type(by_path).__name__ == "ModelDirRunner"
    with pytest.raises(ValueError, match="unknown runner 'nope'"):
        resolve_runner(checkpoint, "nope")


def test_resin_models_lists_the_registry(user_models: Path) -> None:
    from typer.testing import CliRunner

    from resin.cli import app

    result = CliRunner().invoke(app, ["models", "--models-dir", str(user_models)])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith("my_llama [user]") and "LlamaForCausalLM" in lines[0]
    assert any(line.startswith("gpt_oss [shipped]") for line in lines)
    assert lines[-1].startswith("torch [built-in]")


def test_resin_llm_is_lazy_and_torch_free() -> None:
    code = "import sys, resin; llm = resin.LLM; print(llm.__module__, 'torch' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.split() == ["resin.llm", "False"]


def test_serve_gpt_oss_through_the_registry() -> None:
    import httpx

    from resin.server.context import ServerOptions
    from resin.server.serve import build_context
    from tests.server_harness import LiveServer

    ctx = build_context(
        GPT_OSS_TINY, options=ServerOptions(served_model_names=["oss"]), max_model_len=64
    )
    assert type(ctx.loop.runner).__name__ == "ModelDirRunner"
    with LiveServer(ctx) as server:
        reply = httpx.post(
            f"{server.base_url}/v1/completions",
            timeout=60,
            json={"model": "oss", "prompt": "hello", "max_tokens": 4, "temperature": 0},
        )
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 4


def test_a_shared_runner_change_reaches_generated_models(
    user_models: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The generated directory holds no runner code: change the shared paged runner (here its
    final-norm step negates the hidden state, so every logit flips sign) and the generated
    model's tokens follow, with nothing edited in its directory — as a fix to the base would."""
    from resin.runners.torch.paged_runner import PagedRunner

    model_dir = user_models / "my_llama"
    assert not (model_dir / "runner.py").exists()
    before = {p.name: p.read_bytes() for p in model_dir.iterdir() if p.is_file()}
    llm = resin.LLM(FIXTURES / "llama", models_dirs=[user_models])
    prompt = [[3, 9, 27, 81]]
    normal = llm.generate(prompt, GREEDY)[0].token_ids
    real_final_norm = PagedRunner._final_norm

    def negated(self: Any, hidden: Any, ctx: Any) -> Any:
        return -real_final_norm(self, hidden, ctx)

    monkeypatch.setattr(PagedRunner, "_final_norm", negated)
    changed = llm.generate(prompt, GREEDY)[0].token_ids
    assert changed != normal
    assert {p.name: p.read_bytes() for p in model_dir.iterdir() if p.is_file()} == before


def test_eval_parity_and_bench_take_runner_models_dir_and_backend(
    user_models: Path, tmp_path: Path
) -> None:
    from typer.testing import CliRunner

    from resin.cli import app

    report = tmp_path / "parity.json"
    args = [
        "eval",
        "parity",
        str(FIXTURES / "llama"),
        "--runner",
        "my_llama",
        "--models-dir",
        str(user_models),
        "--attention-backend",
        "reference",
        "--json",
        str(report),
        "--max-new-tokens",
        "2",
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert json.loads(report.read_text())["runner"] == "model:my_llama"
    bad = CliRunner().invoke(app, [*args[:-4], "--attention-backend", "nope"])
    assert bad.exit_code == 1 and "unknown attention backend 'nope'" in bad.output
    bench = CliRunner().invoke(
        app,
        [
            "bench",
            "my_llama",
            "--models-dir",
            str(user_models),
            "--shapes",
            "decode:2@8",
            "--repeats",
            "2",
            "--warmup",
            "0",
            "--out",
            str(tmp_path / "bench"),
        ],
    )
    assert bench.exit_code == 0, bench.output


def test_a_broken_model_directory_is_skipped_with_a_warning(tmp_path: Path) -> None:
    broken = tmp_path / "models" / "broken"
    broken.mkdir(parents=True)
    (broken / "architecture.json").write_text("{not json")
    with pytest.warns(UserWarning, match="model directory skipped"):
        registry = ModelRegistry([tmp_path / "models"], use_cwd=False, use_env=False)
    assert registry.skipped and registry.for_checkpoint(FIXTURES / "llama").name == "torch"


@pytest.mark.parametrize("name", BUILTIN)
def test_serve_every_builtin_family_through_the_registry(name: str) -> None:
    import httpx

    from resin.server.context import ServerOptions
    from resin.server.serve import build_context
    from tests.server_harness import LiveServer

    ctx = build_context(
        FIXTURES / name, options=ServerOptions(served_model_names=[name]), max_model_len=64
    )
    assert type(ctx.loop.runner).__name__ == "TorchRunner"
    with LiveServer(ctx) as server:
        reply = httpx.post(
            f"{server.base_url}/v1/completions",
            timeout=60,
            json={
                "model": name,
                "prompt": [5, 6, 7],
                "max_tokens": 3,
                "temperature": 0,
                "ignore_eos": True,
            },
        )
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 3
