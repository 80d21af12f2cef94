"""``resin serve`` as users start it: the CLI documents every option and serves a checkpoint."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
from typer.testing import CliRunner

from resin.cli import app
from tests.server_harness import free_port

ROOT = Path(__file__).resolve().parent.parent
OPTIONS = [
    "--host",
    "--port",
    "--runner",
    "--served-model-name",
    "--api-key",
    "--page-size",
    "--num-pages",
    "--kv-cache-memory-bytes",
    "--max-num-seqs",
    "--max-num-batched-tokens",
    "--max-model-len",
    "--enable-prefix-caching",
    "--no-enable-prefix-caching",
    "--tool-parser",
    "--reasoning-parser",
    "--chat-template",
    "--max-queued-requests",
    "--max-request-body-bytes",
    "--max-logprob-entries",
    "--timeout-keep-alive",
    "--timeout-header",
    "--timeout-body",
    "--max-header-bytes",
    "--max-connections",
    "--enable-fastapi-docs",
    "--disable-fastapi-docs",
    "--device",
    "--dtype",
    "--speculative-method",
    "--num-speculative-tokens",
    "--tensor-parallel-size",
    "--expert-parallel-size",
    "--data-parallel-size",
    "--context-parallel-size",
    "--allowed-origins",
]


def test_serve_help_documents_every_option():
    result = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for option in OPTIONS:
        assert option in result.output, option


def test_serve_rejects_unknown_parser_and_missing_model():
    result = CliRunner().invoke(
        app,
        ["serve", str(ROOT / "tests/fixtures/qwen3"), "--runner", "null", "--tool-parser", "nope"],
    )
    assert result.exit_code == 2 and "unknown --tool-parser 'nope'" in result.output
    result = CliRunner().invoke(app, ["serve", str(ROOT / "no/such/dir")])
    assert result.exit_code == 2 and "does not exist" in result.output
    result = CliRunner().invoke(
        app,
        ["serve", str(ROOT / "tests/fixtures/qwen3"), "--speculative-method", "eagle"],
        env={"COLUMNS": "200"},
    )
    assert result.exit_code == 2 and "the speculative methods are: ngram, mtp" in result.output


def test_resin_serve_subprocess_answers_and_stops():
    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "resin.cli",
            "serve",
            "tests/fixtures/qwen3",
            "--port",
            str(port),
            "--served-model-name",
            "demo",
            "--max-model-len",
            "256",
            "--max-num-seqs",
            "4",
            "--log-level",
            "warning",
        ],
        cwd=ROOT,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert server.poll() is None, "resin serve exited"
            assert time.monotonic() < deadline, "resin serve did not start"
            time.sleep(0.2)
        response = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json={
                "model": "demo",
                "messages": [{"role": "user", "content": "Hello"}],
                "max_tokens": 5,
                "ignore_eos": True,
            },
        )
        assert response.status_code == 200
        assert response.json()["usage"]["completion_tokens"] == 5
    finally:
        server.terminate()
        # uvicorn shuts down gracefully, then re-raises SIGTERM (exit status -15)
        assert server.wait(timeout=30) in (0, -15)


def test_readme_serving_snippets_run_against_a_live_server():
    """The README's curl command and openai snippet, pointed at a live server (port swapped)."""
    import re
    import shutil

    from resin.server.context import ServerOptions
    from resin.server.serve import build_context
    from tests.server_harness import LiveServer

    readme = (ROOT / "README.md").read_text()
    python_snippet = next(
        b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "OpenAI(" in b
    )
    curl_snippet = next(
        b for b in re.findall(r"```bash\n(.*?)```", readme, re.S) if b.startswith("curl ")
    )
    ctx = build_context(
        ROOT / "tests/fixtures/qwen3",
        runner="null",
        max_model_len=256,
        options=ServerOptions(served_model_names=["demo"]),
    )
    with LiveServer(ctx) as live:
        port = str(live.port)
        namespace: dict[str, object] = {}
        exec(python_snippet.replace("8000", port), namespace)  # noqa: S102 - doc snippet
        assert namespace["reply"].usage.completion_tokens == 16
        if shutil.which("curl"):
            out = subprocess.run(
                ["bash", "-c", curl_snippet.replace("8000", port)],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            assert '"completion_tokens":16' in out


def test_allowed_origins_option():
    from resin.server.cli import cors_origins

    assert cors_origins(None) == ["*"]
    assert cors_origins(["https://a.example", "https://b.example"]) == [
        "https://a.example",
        "https://b.example",
    ]
    assert cors_origins(["none"]) == []
