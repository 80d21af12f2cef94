"""Shared pytest setup: makes ``tests/harness.py`` importable and provides small helpers.

``harness.py`` holds the recording runner and the plan-checking engine driver used by
the plan-layout, bad-output and engine-API tests.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

REPO = TESTS.parent


@pytest.fixture
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="module")
def one_torch_thread():  # type: ignore[no-untyped-def]
    """torch with one thread for a module: on a shared 2-core machine two threads per process
    make the tiny models' small ops ~50x slower (models/gpt_oss/NOTES.md). Use with
    ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    torch = pytest.importorskip("torch")
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
