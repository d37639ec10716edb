"""The dsh conformance kit for plugin authors (also a pytest plugin, ``-p dsh``).

Run the shipped suite on an installed plugin::

    pytest --dsh-conformance=my-plugin [--dsh-conformance-config 'my-plugin={"root": "{tmp}"}']

or subclass :class:`ToolPluginConformance` in your tests. Names are imported
lazily: pytest imports this package in every run where dsh is installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dsh_core.testing.checks import CHECKS, Target
    from dsh_core.testing.conformance import ToolPluginConformance
    from dsh_core.testing.loader import LoadedPlugin, load_plugin

__all__ = ["CHECKS", "LoadedPlugin", "Target", "ToolPluginConformance", "load_plugin"]

_WHERE = {
    "CHECKS": "dsh_core.testing.checks",
    "Target": "dsh_core.testing.checks",
    "ToolPluginConformance": "dsh_core.testing.conformance",
    "LoadedPlugin": "dsh_core.testing.loader",
    "load_plugin": "dsh_core.testing.loader",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'dsh_core.testing' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
