"""Helpers for the built-in plugin tests: boot a real Harness with chosen plugin rows."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import pytest

from dsh_core.config import compose
from dsh_core.harness import Harness
from dsh_core.plugins import PluginCatalog


@asynccontextmanager
async def harness(*rows: dict[str, Any], mode: str = "native", **tools: Any) -> AsyncIterator[Harness]:
    """A harness of the installed plugins (strict catalog) with ``rows`` as its ``[[plugins]]``.

    ``tools`` are further ``[tools]`` settings (``approval_timeout_s=...``).
    """
    deployment = compose([("test", {"tools": {"mode": mode, **tools}, "plugins": list(rows)})], env={})
    running = await Harness.start(deployment, catalog=PluginCatalog(strict=True))
    try:
        yield running
    finally:
        await running.aclose()


Boot = Callable[..., AbstractAsyncContextManager[Harness]]


@pytest.fixture
def boot() -> Boot:
    """``async with boot(row, ...) as h``: a harness with these plugin rows (see :func:`harness`)."""
    return harness
