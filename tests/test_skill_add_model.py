"""Every command skills/add-model/SKILL.md shows, run as written (placeholders filled), in order.

The commands are read out of SKILL.md itself — each line of a ```bash block and each inline
code span that starts with ``resin `` or ``pytest `` — so a command added to or changed in the
skill fails :func:`test_skill_shows_only_commands_this_test_runs` until it is exercised here.
The loop then runs in a scratch directory (``models/`` under it, as from the repository root):

1. ``resin new-model SOURCE --name NAME --tiny`` with SOURCE = gpt-oss's config.json: exit 0,
   and the STUB / ASSUMED lines of the worked example appear in its output.
2. ``resin eval parity NAME --json ...`` on the unfilled scaffold: exit 1, the worked example's
   "runner not finished" line, and the JSON error the skill documents.
3. Filling the stubs is the agent's edit: here, the committed models/gpt_oss/blocks.py is
   copied over the generated one (nothing else in the directory changes).
4. ``resin eval parity NAME --json ...`` again: exit 0, output shaped like the skill's PASS block.
5. ``resin eval parity NAME --dtype bfloat16``, ``resin eval parity NAME --checkpoint DIR`` (the
   committed tiny checkpoint, a different one), ``pytest -q models/NAME/test_parity.py`` (its
   test function, called in this process), ``resin bench NAME`` (short ``--shapes``), and
   ``resin eval parity CHECKPOINT_DIR`` on a supported fixture.
6. ``resin new-model ... --out DIR/NAME`` elsewhere, ``resin models --models-dir DIR`` lists
   it, and ``resin serve CHECKPOINT_DIR --models-dir DIR --port PORT`` (a real process) answers
   a completion with it.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from typer.testing import CliRunner, Result  # noqa: E402

from resin.cli import app  # noqa: E402
from resin.evals.model_ref import import_model_module  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SKILL = REPO / "skills" / "add-model" / "SKILL.md"
GPT_OSS = REPO / "models" / "gpt_oss"
# Every command the skill shows, placeholders normalised (see _normalise).
HANDLED = {
    "resin new-model SOURCE --name NAME --tiny",
    "resin new-model SOURCE --name NAME --tiny --out DIR/NAME",
    "resin eval parity NAME --json JSON",
    "resin eval parity NAME --dtype bfloat16",
    "resin eval parity NAME --checkpoint CHECKPOINT_DIR",
    "resin eval parity CHECKPOINT_DIR",
    "resin models --models-dir DIR",
    "resin serve CHECKPOINT_DIR --models-dir DIR --port 8000",
    "pytest -q models/NAME/test_parity.py",
    "resin bench NAME",
}

COMMAND_NAMES = {
    "resin new-model",
    "resin eval parity",
    "resin bench",
    "resin eval",
    "resin serve",
    "resin models",
    "resin generate",
}


def _skill_text() -> str:
    return SKILL.read_text(encoding="utf-8")


def _bash_blocks(text: str) -> list[list[str]]:
    return [
        block.strip("\n").splitlines() for block in re.findall(r"```bash\n(.*?)```", text, re.S)
    ]


def skill_commands(text: str) -> list[str]:
    """Commands in ```bash blocks (non-comment lines) and inline spans starting resin/pytest."""
    commands = [
        line.strip()
        for block in _bash_blocks(text)
        for line in block
        if line.strip() and not line.lstrip().startswith("#")
    ]
    spans = re.findall(r"`((?:resin|pytest) [^`]+)`", text)
    return commands + [c for c in spans if c not in COMMAND_NAMES]  # prose naming a command


def _normalise(command: str) -> str:
    command = re.sub(r"/path/to/\S+", "SOURCE", command)
    command = re.sub(r"--json \S+", "--json JSON", command)
    return command.replace("gpt_oss", "NAME")


def _expected_output(block: list[str], command_prefix: str) -> list[str]:
    """The ``# ...`` lines right after the command starting with ``command_prefix``."""
    start = next(i for i, line in enumerate(block) if line.startswith(command_prefix))
    out = []
    for line in block[start + 1 :]:
        if not line.startswith("#"):
            break
        out.append(line[1:].strip())
    return out


def _pattern(expected: str) -> str:
    """A shown output line as a regex: ``...`` stands for anything, a measured diff (a number
    in scientific notation such as ``7.29e-07``, or the ``0`` of a bit-exact ``scaled diff
    0``) for any number, and a line number in transformers' source (``modeling_gpt_oss.py:149``)
    for any line (it moves between transformers releases: 5.25 shifted gpt-oss's by 2); the
    rest is exact."""
    pieces = []
    for part in expected.split("..."):
        tokens = re.split(r"([0-9.]+e[-+][0-9]+|(?<=diff )0\b|(?<=\.py:)[0-9]+)", part)
        pieces.append(
            "".join(
                (r"[0-9]+" if t.isdigit() and t != "0" else r"(?:0|[0-9.]+e[-+][0-9]+|[0-9.]+)")
                if i % 2
                else re.escape(t)
                for i, t in enumerate(tokens)
            )
        )
    return ".*".join(pieces)


def _run(*args: str) -> Result:
    return CliRunner().invoke(app, list(args))


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # ~50x faster on a shared 2-core machine (models/gpt_oss/NOTES.md)
    yield
    torch.set_num_threads(previous)


def test_skill_shows_only_commands_this_test_runs() -> None:
    shown = {_normalise(c) for c in skill_commands(_skill_text())}
    assert shown == HANDLED, (
        f"SKILL.md commands not exercised here: {shown - HANDLED}; "
        f"exercised but no longer shown: {HANDLED - shown}"
    )


def test_skill_loop_runs_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = _skill_text()
    worked = next(b for b in _bash_blocks(text) if any("/path/to/" in line for line in b))
    source = tmp_path / "gpt-oss-20b"
    source.mkdir()
    shutil.copy(GPT_OSS / "source" / "config.json", source / "config.json")
    monkeypatch.chdir(tmp_path)
    model = tmp_path / "models" / "gpt_oss"
    report = tmp_path / "gpt_oss_parity.json"

    # 1. Generate: the worked example's STUB / ASSUMED lines.
    result = _run("new-model", str(source / "config.json"), "--name", "gpt_oss", "--tiny")
    assert result.exit_code == 0, result.output
    for line in _expected_output(worked, "resin new-model"):
        assert re.search(_pattern(line), result.output), (line, result.output)
    assert (model / "tiny" / "config.json").is_file()

    # 2. Parity on the unfilled scaffold: exit 1, "runner not finished", the documented JSON.
    result = _run("eval", "parity", "gpt_oss", "--json", str(report))
    assert result.exit_code == 1
    for line in _expected_output(worked, "resin eval parity"):
        assert re.search(_pattern(line), result.output), (line, result.output)
    assert json.loads(report.read_text())["error"] == "runner not finished"

    # 3. Fill the stubs (the agent's edit): the committed blocks.py, nothing else.
    shutil.copy(GPT_OSS / "blocks.py", model / "blocks.py")
    # Each CLI call is a fresh process for an agent; here, forget the stub modules imported in 2.
    for key in [k for k in sys.modules if k.startswith("resin_models.gpt_oss")]:
        del sys.modules[key]
    assert import_model_module(model, "blocks", "gpt_oss").STUBS == ()

    # 4. Parity again: exit 0, shaped like the skill's PASS block.
    result = _run("eval", "parity", "gpt_oss", "--json", str(report))
    assert result.exit_code == 0, result.output
    assert json.loads(report.read_text())["passed"] is True
    shown_pass = re.search(r"```\n(parity PASS:.*?)```", text, re.S)
    assert shown_pass is not None
    for line in shown_pass.group(1).splitlines():
        if line.strip() != "...":
            assert re.search(_pattern(line.strip()), result.output), (line, result.output)

    # 5. bf16 parity, the generated test, the bench, and a checkpoint Resin already runs.
    result = _run("eval", "parity", "gpt_oss", "--dtype", "bfloat16")
    assert result.exit_code == 0, result.output
    import_model_module(model, "test_parity", "gpt_oss").test_parity()
    result = _run(
        "bench",
        "gpt_oss",
        "--shapes",
        "decode:2@24",
        "--repeats",
        "2",
        "--warmup",
        "0",
        "--out",
        str(tmp_path / "bench"),
    )
    assert result.exit_code == 0, result.output
    assert (tmp_path / "bench" / "report.json").is_file()
    result = _run(
        "eval", "parity", str(REPO / "tests" / "fixtures" / "llama"), "--max-new-tokens", "4"
    )
    assert result.exit_code == 0, result.output
    result = _run(
        "eval", "parity", "gpt_oss", "--checkpoint", str(GPT_OSS / "tiny"), "--max-new-tokens", "4"
    )
    assert result.exit_code == 0, result.output
    assert str(GPT_OSS / "tiny") in result.output

    # 6. A model directory elsewhere: registered with --models-dir, served by a real process.
    elsewhere = tmp_path / "my_models"
    result = _run(
        "new-model",
        str(source / "config.json"),
        "--name",
        "oss_elsewhere",
        "--tiny",
        "--out",
        str(elsewhere / "oss_elsewhere"),
    )
    assert result.exit_code == 0, result.output
    shutil.copy(GPT_OSS / "blocks.py", elsewhere / "oss_elsewhere" / "blocks.py")
    result = _run("models", "--models-dir", str(elsewhere))
    assert result.exit_code == 0 and "oss_elsewhere [user]" in result.output, result.output
    _serve_and_complete(elsewhere / "oss_elsewhere" / "tiny", elsewhere, tmp_path)


def _serve_and_complete(checkpoint: Path, models_dir: Path, cwd: Path) -> None:
    """``resin serve CHECKPOINT --models-dir DIR --port PORT`` as a process: /health, then one
    greedy completion; the server is always stopped."""
    import os
    import subprocess
    import time

    import httpx

    from tests.server_harness import free_port

    port = free_port()
    resin_cli = Path(sys.executable).parent / "resin"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    server = subprocess.Popen(
        [
            str(resin_cli),
            "serve",
            str(checkpoint),
            "--models-dir",
            str(models_dir),
            "--port",
            str(port),
            "--max-model-len",
            "128",
            "--served-model-name",
            "oss",
        ],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert server.poll() is None, server.communicate()[0]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        reply = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            timeout=60,
            json={"model": "oss", "prompt": "hello", "max_tokens": 3, "temperature": 0},
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 3
    finally:
        server.terminate()
        try:
            log = server.communicate(timeout=20)[0]
        except subprocess.TimeoutExpired:
            server.kill()
            log = server.communicate()[0]
    assert "oss_elsewhere" in log or "ModelDirRunner" in log, log
