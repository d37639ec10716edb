"""Every built-in plugin passes the conformance kit (subclass style, as a third party would write it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dsh_core.testing import ToolPluginConformance


class TestWorkspaceConformance(ToolPluginConformance):
    """workspace: root defaults to the kit's temporary directory."""

    plugin_name = "workspace"


class TestBashConformance(ToolPluginConformance):
    """bash: root defaults to the kit's temporary directory."""

    plugin_name = "bash"


class TestApprovalConformance(ToolPluginConformance):
    """approval: no tools; its hooks are checked (dsh_approve must not be async def)."""

    plugin_name = "approval"

    @pytest.fixture
    def plugin_config(self) -> dict[str, Any]:
        """No terminal: the kit must never prompt."""
        return {"preset": "workspace-write", "terminal": "/dev/null"}


class TestGuardsConformance(ToolPluginConformance):
    """guards: no tools; a realistic config."""

    plugin_name = "guards"

    @pytest.fixture
    def plugin_config(self, tmp_path: Path) -> dict[str, Any]:
        """Deny globs and an allowed root."""
        return {"root": str(tmp_path), "deny_paths": ["**/.env"], "allowed_roots": ["."]}
