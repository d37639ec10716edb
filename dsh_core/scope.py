"""Lifecycle scopes: everything registered through a scope dies with it.

A scope (the original's "fiber") owns registrations (tools, hook
implementations, services), timers and background tasks. :meth:`Scope.dispose`
unwinds children first (newest first), then the scope's own disposers in
reverse order, then cancels its tasks and waits for them, for at most the
scope's task grace: when it returns, nothing the scope started is still
running but a task that did not end for that long after its cancellation, which is
named in a warning.

Agents, presets and dynamic-package runs are *layered* scopes: the tool
registry keeps one layer per layered scope (see :mod:`dsh_core.registry`).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import itertools
import logging
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import Any

from dsh_core.bounds import is_positive_seconds

__all__ = ["TASK_GRACE_S", "Scope", "ScopeDisposedError", "one_shot"]

log = logging.getLogger("dsh")

Disposer = Callable[[], "None | Awaitable[None]"]

_ids = itertools.count(1)

#: Seconds :meth:`Scope.dispose` waits for the tasks it cancelled, unless the scope (or an ancestor) says otherwise.
#: Above the runtime's APPROVAL_GRACE_S (5 s), with room to spare: a cancelled task's tool call may wait that
#: long for a deaf approval channel, then still has to end; at 5 s too, the call outlived the dispose.
TASK_GRACE_S = 10.0

#: The scopes the current context is unwinding (set in unwinding tasks, inherited by what they start).
_unwinding: contextvars.ContextVar[frozenset[Scope]] = contextvars.ContextVar(
    "dsh_scope_unwinding", default=frozenset()
)


def one_shot(undo: Callable[[], None]) -> Callable[[], None]:
    """``undo`` made safe to call more than once: it does its work the first time only.

    What a ``register``-style call returns (and hands to its scope's disposal) undoes
    that one registration. Called again after the same object was registered anew, a
    plain undo would find a registration that looks like its own and remove it: a
    guard, a restriction or a mode declared later would silently be gone.
    """
    done = False

    @functools.wraps(undo)
    def undo_once() -> None:
        nonlocal done
        if not done:
            done = True
            undo()

    return undo_once


class ScopeDisposedError(RuntimeError):
    """Something was registered on, or spawned in, a disposed scope."""


class Scope:
    """A node of the lifecycle tree. Create children with :meth:`child`.

    ``task_grace_s`` bounds how long :meth:`dispose` waits for the scope's tasks once it
    cancelled them (a positive, finite number of seconds); without one, a scope takes its
    parent's, and a root scope :data:`TASK_GRACE_S`.
    """

    def __init__(
        self,
        name: str = "root",
        parent: Scope | None = None,
        *,
        layered: bool = False,
        task_grace_s: float | None = None,
    ) -> None:
        if task_grace_s is None:
            grace = parent.task_grace_s if parent is not None else TASK_GRACE_S
        elif is_positive_seconds(task_grace_s):
            grace = float(task_grace_s)
        else:
            raise ValueError(
                f"task_grace_s of scope {name!r} must be a positive, finite number of seconds, got {task_grace_s!r}"
            )
        self._task_grace_s = grace
        self.name = name
        self.parent = parent
        self.layered = layered
        self.serial = next(_ids)
        self._children: list[Scope] = []
        self._disposers: list[Disposer] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self._services: dict[str, object] = {}
        self._state = "active"
        # Set when the unwinding starts: resolved when it ends; the task running it.
        self._done: asyncio.Future[None] | None = None
        self._unwinder: asyncio.Task[Any] | None = None
        self._task: asyncio.Task[None] | None = None  # the unwinding task dispose() started, if it did
        self.depth: int = 0 if parent is None else parent.depth + 1

    def __repr__(self) -> str:
        return f"<Scope {self.path}{' layered' if self.layered else ''} {self._state}>"

    @property
    def task_grace_s(self) -> float:
        """Seconds :meth:`dispose` waits for this scope's cancelled tasks before it leaves them running."""
        return self._task_grace_s

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

    def child(self, name: str, *, layered: bool = False, task_grace_s: float | None = None) -> Scope:
        """Create a child scope, disposed with (and before) this one.

        Its task grace is ``task_grace_s``, or this scope's when that is ``None``.
        """
        self._ensure_active(f"create child scope {name!r}")
        scope = Scope(name, self, layered=layered, task_grace_s=task_grace_s)
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

        @one_shot
        def forget() -> None:
            if disposer in self._disposers:
                self._disposers.remove(disposer)

        return forget

    def spawn(self, coro: Coroutine[Any, Any, Any], *, name: str | None = None) -> asyncio.Task[Any]:
        """Start a background task owned by this scope (cancelled on dispose, and awaited for its task grace)."""
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

        @one_shot
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
        owned tasks are cancelled and awaited for at most :attr:`task_grace_s`;
        when this returns, nothing the scope started is still running, but for
        a task that ignored its cancellation that long: it is left running and
        named in a warning (a disposer, by contrast, is awaited for as long as
        it takes). The unwinding runs once, in a task of
        its own: every call (concurrent ones included) waits for that one
        unwinding, and cancelling a caller does not stop it (the caller still
        gets its :class:`asyncio.CancelledError`). Disposing twice is harmless.

        Errors never stop the unwinding: a disposer (or owned task) that raises
        is logged and the next step runs. If the unwinding task itself is
        cancelled (an event loop shutting down cancels every task), the step it
        was awaiting is abandoned and the rest still run. Only
        :class:`KeyboardInterrupt` and :class:`SystemExit` stop it: they are
        asyncio's way out of the event loop, and swallowing them would make a
        hung disposer unstoppable; the scope then stays "disposing" with what
        is left, and a later call resumes from there.

        Called from within an unwinding (a disposer, or a task one started) on
        a scope being unwound or one of its ancestors, this starts that scope's
        unwinding if needed but returns without waiting: the wait would
        deadlock on the caller itself.
        """
        while self._state != "disposed":
            if self._done is None:
                loop = asyncio.get_running_loop()
                self._done = loop.create_future()
                self._task = self._unwinder = loop.create_task(self._unwind_alone(), name=f"dispose {self.path}")
                self._task.add_done_callback(self._unwinder_ended)
            done, task = self._done, self._task
            if any(scope.is_within(self) for scope in _unwinding.get()):
                return
            try:
                await asyncio.shield(done)
                if task is not None and not task.done():
                    await asyncio.shield(task)  # it ends right after: leave no task behind, not even this one
            except asyncio.CancelledError:
                me = asyncio.current_task()
                if me is None or me.cancelling():
                    raise  # this caller was cancelled: the unwinding goes on without it
                # Not this caller: the unwinding task was cancelled before it ran (go again), or
                # just after it finished (done).

    async def _unwind_alone(self) -> None:
        # The task started by dispose(): a fresh context, unaware of what its creator was unwinding.
        _unwinding.set(frozenset())
        await self._unwind()

    def _unwinder_ended(self, task: asyncio.Task[Any]) -> None:
        # A task cancelled before its first step never runs _unwind: release the waiters, allow a retry.
        done = self._done
        if self._task is task and done is not None and not done.done():
            self._done = None
            done.cancel()

    def _unwinding_elsewhere(self) -> bool:
        unwinder = self._unwinder
        return unwinder is not None and not unwinder.done() and unwinder is not asyncio.current_task()

    async def _unwind(self) -> None:
        """Unwind this scope in the current task (the scope's own unwinding task, or its parent's)."""
        self._state = "disposing"
        self._unwinder = asyncio.current_task()
        if self._done is None:
            self._done = asyncio.get_running_loop().create_future()
        token = _unwinding.set(_unwinding.get() | {self})
        try:
            for child in reversed(list(self._children)):
                if child.disposed:
                    continue
                if child._unwinding_elsewhere():
                    assert child._done is not None
                    await self._step("the unwinding of a child", functools.partial(asyncio.shield, child._done))
                else:
                    await self._step("a child", child._unwind)
            self._children.clear()
            while self._disposers:
                await self._step("a disposer", self._disposers.pop())
            await self._step("the wait for its tasks", self._end_tasks)
            self._services.clear()
            self._state = "disposed"
            if self.parent is not None and self in self.parent._children:
                self.parent._children.remove(self)
            if not self._done.done():
                self._done.set_result(None)
        except BaseException:
            # KeyboardInterrupt or SystemExit (nothing else reaches here): stop, and let a later
            # dispose() resume with what is left. Whoever waits is interrupted too.
            done, self._done = self._done, None
            if done is not None and not done.done():
                done.cancel()
            raise
        finally:
            _unwinding.reset(token)

    async def _step(self, what: str, step: Callable[[], object]) -> None:
        """Run one step of the unwinding; nothing but KeyboardInterrupt and SystemExit stops the rest."""
        try:
            outcome = step()
            if inspect.isawaitable(outcome):
                await outcome
        except (KeyboardInterrupt, SystemExit):
            raise
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                task.uncancel()  # the cancel abandoned this step; the next ones must not see it pending
            log.warning("%s of scope %r was cancelled; the unwinding goes on", what, self.path)
        except BaseException:
            log.warning("%s of scope %r failed", what, self.path, exc_info=True)

    async def _end_tasks(self) -> None:
        tasks = [t for t in self._tasks if not t.done()]
        for task in tasks:
            task.cancel()
        if not tasks:
            return
        # Bounded: a task that swallows its cancellation (or awaits again) would hang the whole unwinding,
        # and with it every dispose() up to the harness's close. It is left running, and named.
        grace = self._task_grace_s
        _, running = await asyncio.wait(tasks, timeout=grace)
        for task in tasks:
            if task in running:
                log.warning(
                    "task %s of scope %r did not end within %g s of its cancellation; dispose leaves it running",
                    _describe_task(task),
                    self.path,
                    grace,
                )
            elif not task.cancelled() and (error := task.exception()) is not None:
                log.warning("a task of scope %r failed: %r", self.path, error)


def _describe_task(task: asyncio.Task[Any]) -> str:
    """``'name' (qualified name of its coroutine)``: the name alone is often asyncio's ``Task-N``."""
    coro = task.get_coro()
    qualname = getattr(coro, "__qualname__", None) or type(coro).__name__
    return f"{task.get_name()!r} ({qualname})"
