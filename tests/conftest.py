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
