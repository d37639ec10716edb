"""Code Mode test configuration: run ``async def`` tests without a plugin; the ``env`` fixture."""

from __future__ import annotations

import asyncio
import inspect

import pytest
from codemode_kit import Env


def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """Run ``async def`` tests in a fresh event loop (no plugin needed)."""
    if not inspect.iscoroutinefunction(pyfuncitem.obj):
        return None
    names = pyfuncitem._fixtureinfo.argnames
    kwargs = {name: pyfuncitem.funcargs[name] for name in names}
    asyncio.run(asyncio.wait_for(pyfuncitem.obj(**kwargs), 30))
    return True


@pytest.fixture
def env() -> Env:
    """A fresh code-mode environment with a fake code runtime and an in-memory session sink."""
    return Env()
