"""``resin generate MODEL --prompt ...`` on the fixture checkpoints, run as a subprocess.

Checks the command from the issue's "done when" (``resin generate tests/fixtures/llama --prompt
"def main():"``), that greedy CLI output is the offline API's text, ``--chat`` with ``--seed``,
a clear error for a missing model, and that the ``eval`` group is optional.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LLAMA = REPO / "tests" / "fixtures" / "llama"


def _torch_runner_available() -> bool:
    try:
        from resin.runners.torch import TorchRunner  # noqa: F401
    except ImportError:
        return False
    return True


needs_runner = pytest.mark.skipif(
    not _torch_runner_available(), reason="resin.runners.torch not available"
)


def resin_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    return subprocess.run(
        [sys.executable, "-m", "resin.cli", *args],
        capture_output=True,
        text=True,
        encoding="utf-8",
        errors="replace",
        cwd=REPO,
        env=env,
        timeout=120,
    )


@needs_runner
def test_generate_prints_text() -> None:
    result = resin_cli("generate", "tests/fixtures/llama", "--prompt", "def main():")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()


@needs_runner
def test_generate_greedy_matches_llm_and_chat_runs() -> None:
    import resin
    from resin.llm import LLM

    greedy = resin_cli(
        "generate", str(LLAMA), "--prompt", "def main():", "--max-tokens", "8", "--temperature", "0"
    )
    assert greedy.returncode == 0, greedy.stderr
    expected = (
        LLM(LLAMA)
        .generate("def main():", resin.SamplingParams(max_tokens=8, temperature=0.0))[0]
        .text
    )
    assert greedy.stdout == expected + "\n"
    chat = resin_cli(
        "generate", str(LLAMA), "-p", "Hello", "-n", "8", "-t", "1.0", "--seed", "7", "--chat"
    )
    assert chat.returncode == 0, chat.stderr


def test_generate_missing_model_fails_clearly(tmp_path: Path) -> None:
    result = resin_cli("generate", str(tmp_path / "nope"), "--prompt", "x")
    assert result.returncode == 1
    assert "does not exist" in result.stderr


def test_help_lists_generate_and_keeps_version() -> None:
    result = resin_cli("--help")
    assert result.returncode == 0 and "generate" in result.stdout
    version = resin_cli("version")
    assert version.returncode == 0 and version.stdout.strip()
    try:
        import resin.evals.cli  # noqa: F401
    except ImportError:
        assert "eval" not in result.stdout.split("Commands")[-1].split()
    else:
        assert resin_cli("eval", "--help").returncode == 0
