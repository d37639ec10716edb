"""The production composition: a :class:`~dsh_core.harness.Harness` with dsh's own run_code transport."""

from __future__ import annotations

from dsh_core.config import Deployment
from dsh_core.harness import Harness
from dsh_core.plugins import PluginCatalog

__all__ = ["start_harness"]


async def start_harness(deployment: Deployment, *, catalog: PluginCatalog | None = None) -> Harness:
    """Boot ``deployment`` with the installed plugins."""
    return await Harness.start(deployment, catalog=catalog)
