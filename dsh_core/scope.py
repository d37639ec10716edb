"""Lifecycle scopes: everything registered through a scope dies with it.

A scope (the original's "fiber") owns registrations (tools, hook
implementations, services), timers and background tasks. :meth:`Scope.dispose`
unwinds children first (newest first), then the scope's own disposers in
reverse order, then cancels and awaits its tasks: when it returns, nothing
the scope started is still running.

Agents, presets and dynamic-package runs are *layered* scopes: the tool
registry keeps one layer per layered scope (see :mod:`dsh_core.registry`).
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import Any

__all__ = ["Scope", "ScopeDisposedError"]

log = logging.getLogger("dsh")

Disposer = Callable[[], "None | Awaitable[None]"]

_ids = itertools.count(1)


class ScopeDisposedError(RuntimeError):
    """Something was registered on, or spawned in, a disposed scope."""


class Scope:
    """A node of the lifecycle tree. Create children with :meth:`child`."""

    def __init__(self, name: str = "root", parent: Scope | None = None, *, layered: bool = False) -> None:
        self.name = name
        self.parent = parent
        self.layered = layered
        self.serial = next(_ids)
        self._children: list[Scope] = []
        self._disposers: list[Disposer] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self._services: dict[str, object] = {}
        self._state = "active"
        self.depth: int = 0 if parent is None else parent.depth + 1

    def __repr__(self) -> str:
        return f"<Scope {self.path}{' layered' if self.layered else ''} {self._state}>"

    @property
    def path(self) -> str:
        """Names from the root, joined by ``/``."""
        names: list[str] = []
        node: Scope | None = self
        while node is not None:
            names.append(node.name)
            node = node.parent
        return "/".join(reversed(names))

    @property
    def active(self) -> bool:
        """True until disposal starts."""
        return self._state == "active"

    @property
    def disposed(self) -> bool:
        """True once disposal finished."""
        return self._state == "disposed"

    def _ensure_active(self, what: str) -> None:
        if self._state != "active":
            raise ScopeDisposedError(f"cannot {what}: scope {self.path!r} is {self._state}")

    def child(self, name: str, *, layered: bool = False) -> Scope:
        """Create a child scope, disposed with (and before) this one."""
        self._ensure_active(f"create child scope {name!r}")
        scope = Scope(name, self, layered=layered)
        self._children.append(scope)
        return scope

    def chain(self) -> Iterator[Scope]:
        """This scope, then its ancestors up to the root."""
        node: Scope | None = self
        while node is not None:
            yield node
            node = node.parent

    def is_within(self, other: Scope) -> bool:
        """True if this scope is ``other`` or one of its descendants."""
        if self.depth < other.depth:
            return False
        node: Scope | None = self
        for _ in range(self.depth - other.depth):
            node = node.parent if node is not None else None
        return node is other

    @property
    def layer_owner(self) -> Scope | None:
        """The nearest layered scope at or above this one (``None``: the global layer)."""
        for node in self.chain():
            if node.layered:
                return node
        return None

    def on_dispose(self, disposer: Disposer) -> Callable[[], None]:
        """Run ``disposer`` (sync or async) when this scope is disposed.

        Returns a function that forgets the disposer without running it.
        """
        self._ensure_active("register a disposer")
        self._disposers.append(disposer)

        def forget() -> None:
            if disposer in self._disposers:
                self._disposers.remove(disposer)

        return forget

    def spawn(self, coro: Coroutine[Any, Any, Any], *, name: str | None = None) -> asyncio.Task[Any]:
        """Start a background task owned by this scope (cancelled and awaited on dispose)."""
        if self._state != "active":
            coro.close()
            raise ScopeDisposedError(f"cannot start a task: scope {self.path!r} is {self._state}")
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    @property
    def tasks(self) -> frozenset[asyncio.Task[Any]]:
        """Tasks this scope started that are still running."""
        return frozenset(t for t in self._tasks if not t.done())

    def provide(self, key: str, service: object) -> Callable[[], None]:
        """Make ``service`` visible to this scope and its descendants under ``key``."""
        self._ensure_active(f"provide service {key!r}")
        if key in self._services:
            raise ValueError(f"service {key!r} is already provided in scope {self.path!r}")
        self._services[key] = service

        def withdraw() -> None:
            if self._services.get(key) is service:
                del self._services[key]

        self._disposers.append(withdraw)
        return withdraw

    def lookup(self, key: str) -> Any:
        """The nearest service provided under ``key``, or ``None``."""
        for node in self.chain():
            if key in node._services:
                return node._services[key]
        return None

    async def dispose(self) -> None:
        """Unwind everything this scope owns and wait until it is quiescent.

        Children go first (newest first), then disposers in reverse order, then
        owned tasks are cancelled and awaited. Errors are logged, never stop
        the unwinding. Disposing twice is harmless.
        """
        if self._state != "active":
            return
        self._state = "disposing"
        for child in reversed(self._children):
            await child.dispose()
        self._children.clear()
        while self._disposers:
            disposer = self._disposers.pop()
            try:
                outcome = disposer()
                if inspect.isawaitable(outcome):
                    await outcome
            except Exception:
                log.warning("a disposer of scope %r failed", self.path, exc_info=True)
        tasks = [t for t in self._tasks if not t.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            results = await asyncio.gather(*tasks, return_exceptions=True)
            for result in results:
                if isinstance(result, Exception) and not isinstance(result, asyncio.CancelledError):
                    log.warning("a task of scope %r failed: %r", self.path, result)
        self._services.clear()
        self._state = "disposed"
        if self.parent is not None and self in self.parent._children:
            self.parent._children.remove(self)
