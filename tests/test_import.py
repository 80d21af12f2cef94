"""``import resin`` loads numpy and the compiled core only; the ``resin`` CLI starts.

Each check runs in a fresh interpreter. Importing resin must not load torch, MLX, triton,
jax, cupy or any CUDA module, and no third-party package beyond what ``import numpy``
itself loads. ``resin._core`` is the compiled extension. ``resin --help`` (the console
script) and ``python -m resin.cli --help`` work, and ``resin version`` prints the version.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BANNED = (
    "torch",
    "mlx",
    "triton",
    "jax",
    "jaxlib",
    "cupy",
    "pycuda",
    "cuda",
    "tensorflow",
    "numba",
    "nvidia",
    "tensorrt",
    "flashinfer",
    "vllm",
    "transformers",
    "typer",
    "click",
)


def loaded_modules(code: str) -> set[str]:
    script = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stdout.splitlines()[-1]))


def top_level(modules: set[str]) -> set[str]:
    return {m.split(".")[0] for m in modules}


def test_import_resin_loads_no_torch_or_cuda() -> None:
    modules = loaded_modules("import resin")
    assert "resin._core" in modules  # numpy may load lazily, with the first plan
    heavy = sorted(m for m in modules if m.split(".")[0] in BANNED or "cuda" in m.lower())
    assert heavy == []


def test_runner_selection_loads_no_framework() -> None:
    """The registry, the offline API and the MLX runner package resolve names without loading
    torch or MLX (a runner loads its framework when it is built)."""
    modules = loaded_modules("import resin, resin.registry, resin.llm, resin.runners.mlx")
    heavy = sorted(m for m in modules if m.split(".")[0] in ("torch", "mlx", "transformers"))
    assert heavy == []


def test_import_resin_adds_nothing_beyond_numpy() -> None:
    with_numpy = top_level(loaded_modules("import numpy"))
    with_resin = top_level(loaded_modules("import resin"))
    extra = with_resin - with_numpy - set(sys.stdlib_module_names) - {"resin"}
    assert extra == set()


def test_core_is_the_compiled_extension() -> None:
    code = "import resin, resin._core as c; print(c.__file__); print(resin.__version__)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    path, version = done.stdout.split()
    assert Path(path).suffix in (".so", ".pyd") and version


def test_cli_help() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "resin.cli", "--help"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "Usage" in done.stdout and "version" in done.stdout
    script = Path(sys.executable).parent / "resin"
    assert script.exists(), f"console script missing: {script}"
    done = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Usage" in done.stdout


def test_cli_version() -> None:
    import resin

    done = subprocess.run(
        [sys.executable, "-m", "resin.cli", "version"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == resin.__version__
