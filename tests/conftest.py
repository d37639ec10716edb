"""Shared fixtures: the anyio backend for async tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def anyio_backend() -> str:
    """Run ``@pytest.mark.anyio`` tests on asyncio (dsh is asyncio-based)."""
    return "asyncio"
