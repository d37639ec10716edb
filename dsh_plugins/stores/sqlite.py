"""The ``sqlite-sessions`` plugin: registers the embedded SQLite session store as ``sqlite``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from dsh_core import Scope, hookimpl
from dsh_core.plugins import plugin as declare_plugin
from dsh_core.sessions.sqlite import SqliteSessionStore
from dsh_core.sessions.store import SessionStoreFactory

__all__ = ["plugin", "SqliteSessionsPlugin"]

CONFIG_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "name": {
            "type": "string",
            "minLength": 1,
            "default": "sqlite",
            "description": "the store name deployments select with [sessions] store",
        },
    },
}


class SqliteSessionsPlugin:
    """Provides the ``sqlite`` store factory (``<home>/sessions.db``)."""

    def __init__(self, name: str) -> None:
        self.name = name

    @hookimpl
    def dsh_register_session_stores(self, register: Callable[[str, SessionStoreFactory], None]) -> None:
        """Register ``factory(home, *, create=True) -> SqliteSessionStore``."""

        def factory(home: Path, *, create: bool = True) -> SqliteSessionStore:
            return SqliteSessionStore.open(home, create=create)

        register(self.name, factory)


@declare_plugin(config_schema=CONFIG_SCHEMA)
def plugin(scope: Scope, config: Any) -> SqliteSessionsPlugin:
    """Plugin factory of ``sqlite-sessions`` (entry point ``dsh_plugins.stores.sqlite:plugin``)."""
    return SqliteSessionsPlugin(str(config.get("name", "sqlite")))
