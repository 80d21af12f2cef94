"""The installed wheel is enough: ``resin serve`` a gpt-oss checkpoint, ``resin models``,
``resin new-model`` and a generated runner, with no checkout on the path (issue 9).

Builds the wheel the way ``pip install .`` does (pip's PEP 517 build through the maturin
backend, ``--no-build-isolation`` so nothing is downloaded; it reuses ``target/``: after
``make install`` the extension is already compiled, and the build takes seconds), installs it with ``--no-deps`` into a clean venv in a temp
dir, and makes this interpreter's site-packages visible to it through a ``.pth`` file, so no
dependency is downloaded again. Lines of a ``.pth`` file are plain path entries: the ``.pth``
files inside that directory (the editable install's ``resin.pth`` -> the checkout) are not
processed, and the venv's own site-packages comes first, so the wheel's ``resin`` is the one
imported (checked). Every command runs from a temp cwd outside the checkout (no ``./models``),
and the serving/running ones with ``transformers`` blocked (a shim package first on
PYTHONPATH whose import raises), which proves a model directory runs without it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHIPPED = REPO / "resin" / "models"
TEMPLATES = REPO / "resin" / "scaffold" / "templates"
GPT_OSS_TINY = SHIPPED / "gpt_oss" / "tiny"
LLAMA_FIXTURE = REPO / "tests" / "fixtures" / "llama"
BUILD_TIMEOUT_S = 900  # a cold release build on 2 cores is ~70 s; warm it is ~2 s
COMMAND_TIMEOUT_S = 180
STARTUP_TIMEOUT_S = 120.0
SERVED_NAME = "tiny-gpt-oss"
BLOCKER = "raise ImportError('transformers is blocked: resin must run a model without it')\n"
RUNTIME_DEPS = (
    "torch",
    "tokenizers",
    "safetensors",
    "numpy",
    "typer",
    "jinja2",
    "fastapi",
    "uvicorn",
)


@dataclass
class WheelEnv:
    wheel: Path
    venv: Path
    bin: Path
    site_packages: Path
    env: dict[str, str]  # no transformers (the shim is first on PYTHONPATH)
    env_dev: dict[str, str]  # transformers allowed (resin new-model)
    cwd: Path  # outside the checkout
    tmp: Path

    def run(
        self, *args: str | Path, dev: bool = False, timeout: float = COMMAND_TIMEOUT_S
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(a) for a in args],
            cwd=self.cwd,
            env=self.env_dev if dev else self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )


def _skip_reason() -> str | None:
    if importlib.util.find_spec("maturin") is None:
        return "maturin (the build backend) is not installed: pip install 'maturin>=1.7,<2'"
    if importlib.util.find_spec("venv") is None:
        return "the venv module is missing (python3-venv)"
    try:
        pip_version = tuple(int(p) for p in importlib.metadata.version("pip").split(".")[:2])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return "pip is not installed in this interpreter"
    if pip_version < (22, 3):
        return f"pip {pip_version} has no --python option (need >= 22.3)"
    missing = [m for m in RUNTIME_DEPS if importlib.util.find_spec(m) is None]
    if missing:
        return f"runtime dependencies to reuse are not installed here: {', '.join(missing)}"
    return None


def _tail(proc: subprocess.CompletedProcess[str], n: int = 3000) -> str:
    return f"rc={proc.returncode}\nstdout:\n{proc.stdout[-n:]}\nstderr:\n{proc.stderr[-n:]}"


def _build_wheel(out: Path) -> Path:
    venv = Path(sys.prefix)
    # the same environment as `make install` (maturin develop), so cargo reuses its artifacts
    env = dict(
        os.environ,
        VIRTUAL_ENV=str(venv),
        PATH=f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
    )
    start = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-w",
            str(out),
            str(REPO),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
    )
    assert proc.returncode == 0, f"building the wheel (pip wheel .) failed\n{_tail(proc)}"
    wheels = sorted(out.glob("resin-*.whl"))
    assert len(wheels) == 1, f"expected one wheel in {out}: {wheels}"
    print(f"wheel build: {time.monotonic() - start:.1f}s -> {wheels[0].name}")
    return wheels[0]


@pytest.fixture(scope="module")
def wheel_env(tmp_path_factory: pytest.TempPathFactory) -> WheelEnv:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("wheel")
    assert not tmp.resolve().is_relative_to(REPO), f"temp dir {tmp} is inside the checkout"
    wheel = _build_wheel(tmp / "dist")

    venv = tmp / "venv"
    proc = subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)],
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot create a venv: {proc.stderr.strip()[-500:]}")
    py = venv / "bin" / "python"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(py),
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            str(wheel),
        ],
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
    )
    assert proc.returncode == 0, f"pip install of the wheel failed\n{_tail(proc)}"
    site_packages = Path(
        subprocess.check_output(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
        ).strip()
    )
    # this interpreter's dependencies, after the venv's own site-packages (no re-download)
    deps = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    (site_packages / "_resin_test_deps.pth").write_text("".join(f"{d}\n" for d in deps))

    shim = tmp / "no_transformers"
    (shim / "transformers").mkdir(parents=True)
    (shim / "transformers" / "__init__.py").write_text(BLOCKER)
    cwd = tmp / "cwd"
    cwd.mkdir()
    base = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "RESIN_MODELS_PATH")
    }
    base.update(
        PATH=f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
        VIRTUAL_ENV=str(venv),
        PYTHONNOUSERSITE="1",
    )
    return WheelEnv(
        wheel=wheel,
        venv=venv,
        bin=venv / "bin",
        site_packages=site_packages,
        env=dict(base, PYTHONPATH=str(shim)),
        env_dev=base,
        cwd=cwd,
        tmp=tmp,
    )


def _data_files(root: Path) -> list[str]:
    return sorted(
        str(p.relative_to(REPO))
        for p in root.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    )


def test_wheel_contents(wheel_env: WheelEnv) -> None:
    names = zipfile.ZipFile(wheel_env.wheel).namelist()
    # every shipped model file (tiny checkpoints included) and every template is package data
    expected = _data_files(SHIPPED) + _data_files(TEMPLATES)
    for f in (
        "architecture.json",
        "blocks.py",
        "tiny/config.json",
        "tiny/model.safetensors",
        "tiny/tokenizer.json",
        "tiny/tokenizer_config.json",
    ):
        assert f"resin/models/gpt_oss/{f}" in expected, f
    assert "resin/scaffold/templates/model/blocks.py.j2" in expected
    missing = [f for f in expected if f not in names]
    assert not missing, f"not in {wheel_env.wheel.name}: {missing}"
    assert any(n.startswith("resin/_core.") and n.endswith(".so") for n in names), names
    odd = [
        n
        for n in names
        if not (n.startswith("resin/") or ".dist-info/" in n)
        or "__pycache__" in n
        or n.endswith(".pyc")
        or (n.endswith(".so") and not n.startswith("resin/_core."))
    ]
    assert not odd, f"unexpected files in the wheel: {odd}"


def test_wheel_is_imported_and_transformers_is_blocked(wheel_env: WheelEnv) -> None:
    probe = (
        "import importlib.util, resin, resin._core, torch, fastapi, uvicorn\n"
        "print(resin.__file__); print(resin._core.__file__)\n"
        "try:\n    import transformers\nexcept ImportError:\n    print('blocked')\n"
        "else:\n    print('IMPORTED', transformers.__file__)\n"
    )
    proc = wheel_env.run(wheel_env.bin / "python", "-c", probe)
    assert proc.returncode == 0, _tail(proc)
    resin_file, core_file, verdict = proc.stdout.split()
    for path in (resin_file, core_file):
        assert Path(path).resolve().is_relative_to(wheel_env.site_packages.resolve()), (
            f"{path} is not the wheel's (the checkout's editable install shadows it?)"
        )
    assert verdict == "blocked", proc.stdout


def test_wheel_lists_shipped_models(wheel_env: WheelEnv) -> None:
    proc = wheel_env.run(wheel_env.bin / "resin", "models")
    assert proc.returncode == 0, _tail(proc)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("gpt_oss ")), None)
    assert line is not None, proc.stdout
    assert "[shipped]" in line and str(wheel_env.site_packages / "resin" / "models") in line, line
    assert str(REPO) not in proc.stdout, proc.stdout


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _get(url: str) -> int:
    with urllib.request.urlopen(url, timeout=2) as response:
        return int(response.status)


def test_wheel_serves_gpt_oss_without_transformers(wheel_env: WheelEnv) -> None:
    checkpoint = wheel_env.tmp / "gpt_oss_tiny"
    shutil.copytree(GPT_OSS_TINY, checkpoint)
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = wheel_env.tmp / "serve.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen(
            [
                str(wheel_env.bin / "resin"),
                "serve",
                str(checkpoint),
                "--port",
                str(port),
                "--max-model-len",
                "128",
                "--num-pages",
                "32",
                "--served-model-name",
                SERVED_NAME,
                "--log-level",
                "warning",
            ],
            cwd=wheel_env.cwd,
            env=wheel_env.env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if server.poll() is not None:
                pytest.fail(
                    f"resin serve exited with {server.returncode}:\n{log_path.read_text()[-3000:]}"
                )
            try:
                if _get(f"{base}/health") == 200:
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            assert time.monotonic() < deadline, (
                f"no /health after {STARTUP_TIMEOUT_S}s:\n{log_path.read_text()[-3000:]}"
            )
            time.sleep(0.1)
        body = json.dumps(
            {"model": SERVED_NAME, "prompt": "hello", "max_tokens": 4, "temperature": 0}
        ).encode()
        request = urllib.request.Request(
            f"{base}/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            assert response.status == 200
            reply = json.loads(response.read())
    finally:
        server.terminate()
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=15)
    choice = reply["choices"][0]
    assert isinstance(choice["text"], str) and choice["text"], reply
    assert reply["usage"]["completion_tokens"] == 4, reply
    assert choice["finish_reason"] == "length", reply
    assert "ModelDirRunner" in log_path.read_text(), log_path.read_text()[-3000:]


def test_wheel_new_model_and_generated_runner(wheel_env: WheelEnv) -> None:
    # the scaffold needs transformers (a dev-time tool); its templates come from the wheel
    source = wheel_env.tmp / "llama_source"
    source.mkdir()
    shutil.copyfile(LLAMA_FIXTURE / "config.json", source / "config.json")
    out = wheel_env.tmp / "my_models" / "x"
    proc = wheel_env.run(
        wheel_env.bin / "resin",
        "new-model",
        source / "config.json",
        "--name",
        "x",
        "--out",
        out,
        "--tiny",
        dev=True,
    )
    assert proc.returncode == 0, _tail(proc)
    for name in (
        "blocks.py",
        "architecture.json",
        "tiny/model.safetensors",
        "tiny/tokenizer.json",
    ):  # the tiny tokenizer is package data too
        assert (out / name).is_file(), f"new-model wrote no {name}\n{_tail(proc)}"
    json.loads((out / "architecture.json").read_text())

    # the generated runner runs a checkpoint with no transformers at run time
    checkpoint = wheel_env.tmp / "llama_tiny"
    checkpoint.mkdir()
    for f in LLAMA_FIXTURE.iterdir():
        if f.name != "goldens.json":
            shutil.copyfile(f, checkpoint / f.name)
    proc = wheel_env.run(
        wheel_env.bin / "resin",
        "generate",
        checkpoint,
        "--runner",
        out,
        "--prompt",
        "hello",
        "--max-tokens",
        "4",
        "--temperature",
        "0",
    )
    assert proc.returncode == 0, _tail(proc)
    assert proc.stdout.strip(), _tail(proc)
