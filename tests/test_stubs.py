"""``resin/_core.pyi`` agrees with the compiled ``resin._core`` (``python -m mypy.stubtest``).

Skipped only when mypy is not installed (it is in the dev extra that ``make install`` uses).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(importlib.util.find_spec("mypy") is None, reason="mypy is not installed")
def test_stubs_match_the_compiled_module() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "resin._core"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"stubtest failed:\n{done.stdout}\n{done.stderr}"
