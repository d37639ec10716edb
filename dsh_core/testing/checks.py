"""The conformance checks: plain functions from a :class:`Target` to a list of failure messages.

Each message names the check (``[dsh:<check>]``), the plugin and the tool,
says what is wrong and how to fix it. An empty list means the check passed.
The pytest classes in :mod:`dsh_core.testing.conformance` only call these.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import functools
import inspect
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Mapping
from typing import Any, Final, Literal, ParamSpec, TypeVar

from attrs import define, field, frozen

from dsh_core.abort import AbortController, AbortedError, AbortSignal
from dsh_core.bounds import is_positive_seconds
from dsh_core.errors import DshError, ErrorCode
from dsh_core.hooks import REGISTRATION_HOOKS, SYNC_HOOKS, Hooks
from dsh_core.lossless import JSON, find_loss, freeze, thaw
from dsh_core.model import ToolContext, ToolDefinition, ToolExecutionInput, ToolResult, converter
from dsh_core.processes import child_pids, is_child_subreaper, proc_stat, set_child_subreaper, signal_if
from dsh_core.registry import TOOL_NAME_PATTERN, TRANSPORT_NAME
from dsh_core.runtime import APPROVAL_GRACE_S
from dsh_core.schema import check_schema, compile_validator, format_violations, violations
from dsh_core.testing.loader import (
    CALL_WATCH,
    BodyRun,
    CallWatch,
    LoadedPlugin,
    ToolSpy,
    WatchingHooks,
    check_config,
    load_factory,
    load_plugin,
    make_root,
)

__all__ = [
    "Target",
    "ABORT_BOUND_S",
    "CALL_TIMEOUT_S",
    "CHECKS",
    "check_entry_point",
    "check_stdout",
    "check_config_schema",
    "check_tool_schemas",
    "check_tool_names",
    "check_examples",
    "check_example_calls",
    "check_pre_abort",
    "check_abort",
    "check_concurrency_safe",
    "check_typed_errors",
    "check_dispose",
    "check_hookimpls",
]

#: Seconds the kit waits for tasks, threads and processes to end after dispose.
QUIESCENCE_GRACE_S: Final = 1.0
#: Seconds the stdout check lets a fresh interpreter take to import, start and dispose the plugin.
PROBE_TIMEOUT_S: Final = 120.0
#: Seconds past the abort bound after which a call that has not returned is cancelled and reported; also what a call
#: the kit aborted or cancelled is given to end. A call then waiting in its approval ask is given the runtime's
#: approval grace (``ToolRuntime.approval_grace_s``, at most :data:`dsh_core.runtime.APPROVAL_GRACE_S`) on top:
#: the runtime waits that long for a channel that ignores the ask's withdrawal, and the two being equal made it a race
#: whether the kit gave up first and blamed the call's body, which never ran (see :func:`_stuck_grace`).
STUCK_GRACE_S: Final = 5.0
#: Seconds the example-calls, typed-errors and dispose checks let a call run before they abort it and report it, and
#: the pre-abort check its call, aborted already, before it cancels it (``Target.call_timeout_s`` overrides it).
#: Generous on purpose: a slow but correct call must not be cut, and the shipped plugins' own limits are well below it
#: (bash's examples ask for at most 10 s, http-fetch's whole-call ``timeout_s`` is 15 s by default); it only bounds a
#: call that never returns, so a check reports, not hangs.
CALL_TIMEOUT_S: Final = 60.0
#: Seconds a tool body may take to return once its call is aborted, by default (``Target.abort_bound_s``,
#: ``--dsh-conformance-abort-bound``, ``ToolPluginConformance.abort_bound_s``).
ABORT_BOUND_S: Final = 2.0


@frozen
class Target:
    """What to check: an entry-point name, the config to start it with, and the kit's bounds."""

    name: str
    config: dict[str, Any] = field(factory=dict)
    abort_bound_s: float = ABORT_BOUND_S
    require_examples: bool = True
    #: Seconds a call may run in the checks that wait for calls to end; ``None``: :data:`CALL_TIMEOUT_S`.
    call_timeout_s: float | None = None


class _Failed(Exception):
    """A check cannot go on (the plugin did not load); carries the failure messages."""

    def __init__(self, failures: list[str]) -> None:
        super().__init__("\n".join(failures))
        self.failures = failures


def failure(target: Target, check: str, problem: str, fix: str, tool: str | None = None) -> str:
    """One failure message: ``[dsh:check] plugin "p", tool "t": problem`` and a ``fix:`` line."""
    who = f'plugin "{target.name}"' + (f', tool "{tool}"' if tool else "")
    return f"[dsh:{check}] {who}: {problem}\n    fix: {fix}"


_P = ParamSpec("_P")
_T = TypeVar("_T")

#: The tool whose call the kit is making (the checks set it around each call): what its threads are blamed on.
_TOOL: contextvars.ContextVar[str | None] = contextvars.ContextVar("dsh_conformance_tool", default=None)
#: While a check watches for leftover processes: each descendant process seen as a call ended, and that call's tool.
_OWNERS: contextvars.ContextVar[dict[int, str] | None] = contextvars.ContextVar("dsh_conformance_owners", default=None)


@frozen
class _Job:
    """A function the check's default executor runs in a thread of its own, and the tool whose call submitted it."""

    thread: threading.Thread
    what: str
    tool: str | None


def _job_name(function: Callable[..., Any]) -> str:
    """What a thread runs, by qualified name: ``asyncio.to_thread`` wraps it in ``partial(context.run, f, ...)``."""
    while isinstance(function, functools.partial):
        inner = function.func
        if (
            getattr(inner, "__name__", None) == "run"
            and isinstance(getattr(inner, "__self__", None), contextvars.Context)
            and function.args
        ):
            function = function.args[0]
        else:
            function = inner
    module = getattr(function, "__module__", None)
    name = getattr(function, "__qualname__", None) or repr(function)
    return f"{module}.{name}" if module and module not in ("builtins", "__main__") else name


class _DetachedExecutor(concurrent.futures.ThreadPoolExecutor):
    """The default executor of the kit's event loops: each job in a daemon thread of its own, never waited for.

    Closing an event loop waits for its default executor's threads with no bound (``asyncio.run``),
    and the interpreter joins a ``ThreadPoolExecutor``'s at exit: a body's work stuck in
    ``asyncio.to_thread`` (cancelling the await does not stop a thread) hung the check for as long as the
    work ran, forever for work that never returns, and nothing reported it. Here shutdown returns at once
    and the jobs still running are reported as leftovers of the call that submitted them.
    """

    def __init__(self) -> None:
        super().__init__(max_workers=1, thread_name_prefix="dsh-conformance")
        self.jobs: list[_Job] = []
        self._closed = False
        self._count = 0
        self._jobs_lock = threading.Lock()

    def submit(self, fn: Callable[_P, _T], /, *args: _P.args, **kwargs: _P.kwargs) -> concurrent.futures.Future[_T]:
        """Run ``fn(*args, **kwargs)`` in a new daemon thread; its future."""
        future: concurrent.futures.Future[_T] = concurrent.futures.Future()

        def work() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                result = fn(*args, **kwargs)
            except BaseException as error:  # as ThreadPoolExecutor: the awaiting coroutine gets it
                future.set_exception(error)
            else:
                future.set_result(result)

        with self._jobs_lock:
            if self._closed:
                raise RuntimeError("cannot schedule new futures after shutdown")
            self._count += 1
            thread = threading.Thread(target=work, name=f"dsh-conformance-executor-{self._count}", daemon=True)
            self.jobs.append(_Job(thread, _job_name(fn), _TOOL.get()))
        thread.start()
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Refuse new jobs; never wait for the running ones (see the class)."""
        with self._jobs_lock:
            self._closed = True

    def running(self) -> list[_Job]:
        """The jobs whose thread is still running."""
        with self._jobs_lock:
            return [job for job in self.jobs if job.thread.is_alive()]


#: Tasks the kit cancelled that did not end (their body swallowed the cancellation): reported once, by the check
#: that cancelled them, and then left to die with their event loop (weak: a task is gone once its loop is).
_IGNORED_CANCEL: Final[weakref.WeakSet[asyncio.Task[Any]]] = weakref.WeakSet()


def _stuck_grace(loaded: LoadedPlugin, watch: CallWatch | None) -> float:
    """Seconds a call the kit aborts or cancels now is given to end: ``STUCK_GRACE_S``, plus the runtime's approval
    grace, at most :data:`APPROVAL_GRACE_S`, if the call waits in its approval ask (``watch``; ``None`` for a call
    that never asks, as one aborted before dispatch: the runtime settles it before any ask).

    Withdrawn (the call aborted or cancelled), an ask whose channel ignores the withdrawal is waited
    for by the runtime for its whole grace before the call goes on: the kit must not give up first
    and report the call stuck. Read from the runtime the call runs in, so a grace lowered there is
    not waited for in vain; but the plugin can reach that runtime (``scope.lookup("runtime")``) and
    raise its grace, and waiting that out made a check wait as long as the plugin liked instead of
    reporting. The kit's runtime starts with :data:`APPROVAL_GRACE_S`, so it bounds the wait; past it
    the call is cancelled, which stops the runtime's wait for the channel at once.
    """
    if watch is None or not watch.asking:
        return STUCK_GRACE_S
    grace = loaded.runtime.approval_grace_s
    return STUCK_GRACE_S + (grace if is_positive_seconds(grace) and grace < APPROVAL_GRACE_S else APPROVAL_GRACE_S)


async def _cancel(task: asyncio.Task[Any], grace: float) -> bool:
    """Cancel ``task`` and give it ``grace`` seconds (:func:`_stuck_grace`) to end; whether it did.

    Awaiting a cancelled task with no bound hung the check forever when its body caught
    ``CancelledError`` and went on; one still running is remembered in :data:`_IGNORED_CANCEL`.
    """
    task.cancel()
    await asyncio.wait({task}, timeout=grace)
    if not task.done():
        _IGNORED_CANCEL.add(task)
        return False
    if not task.cancelled():
        task.exception()  # retrieved: what the body let out on the way is no "never retrieved" warning
    return True


def _run(coroutine_function: Callable[[], Any], executor: _DetachedExecutor | None = None) -> Any:
    """``asyncio.run``, but closing the loop never waits for a thread its default executor started, nor more than
    ``STUCK_GRACE_S`` for the tasks it cancels.

    ``asyncio.run`` cancels the tasks left when the coroutine returns and waits for them with no
    bound: a tool body that swallows cancellation hung the check (and pytest) forever. A task still
    running after the grace is left behind with the closed loop, never to run again.
    """
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)  # as asyncio.Runner does: code run on the loop may look it up
    left: set[asyncio.Task[Any]] = set()
    try:
        loop.set_default_executor(executor or _DetachedExecutor())
        return loop.run_until_complete(coroutine_function())
    finally:
        try:
            # A task a check already cancelled and gave up on had its grace: it is not waited for twice.
            left = set(_IGNORED_CANCEL) & asyncio.all_tasks(loop)
            left |= _settle(loop, asyncio.all_tasks(loop) - left)
            left |= _settle(loop, {loop.create_task(loop.shutdown_asyncgens())})
        finally:
            asyncio.set_event_loop(None)
            loop.close()  # the default executor's shutdown never waits (_DetachedExecutor)
            _abandon(loop, left)


def _settle(loop: asyncio.AbstractEventLoop, tasks: set[asyncio.Task[Any]]) -> set[asyncio.Task[Any]]:
    """Cancel ``tasks`` and run ``loop`` until they end, ``STUCK_GRACE_S`` at most; those still running.

    What the ended ones raised on the way is reported as ``asyncio.run`` reports it.
    """
    if not tasks:
        return set()
    for task in tasks:
        task.cancel()
    loop.run_until_complete(asyncio.wait(tasks, timeout=STUCK_GRACE_S))
    for task in tasks:
        if task.done() and not task.cancelled() and task.exception() is not None:
            loop.call_exception_handler(
                {
                    "message": "unhandled exception during the conformance kit's loop shutdown",
                    "exception": task.exception(),
                    "task": task,
                }
            )
    return {task for task in tasks if not task.done()}


#: Coroutines of abandoned tasks that would not close (they catch GeneratorExit too, and await again).
_UNCLOSED: Final[list[Coroutine[Any, Any, Any]]] = []


def _abandon(loop: asyncio.AbstractEventLoop, tasks: set[asyncio.Task[Any]]) -> None:
    """Close the coroutines of ``tasks``, still pending on the closed ``loop``, now rather than when collected.

    Left to the garbage collector, each would be closed at some random later point of the test
    run, running the body's ``finally`` blocks in the middle of whatever runs then: once, inside the
    AST rewriting of a module pytest imported, which then failed with a SystemError. The failure was
    reported by the check that cancelled the task, so asyncio's "Task was destroyed but it is
    pending!" report of each, when it is collected, is dropped (:func:`_drop_destroyed_pending`).
    """
    if tasks:
        _drop_destroyed_pending(loop, {id(task) for task in tasks})
    for task in tasks:
        coroutine = task.get_coro()
        if not inspect.iscoroutine(coroutine):
            continue
        try:
            coroutine.close()
        except RuntimeError:
            _UNCLOSED.append(coroutine)  # kept, so that it is never closed (and runs again) when collected
        except Exception:
            pass  # what its finally blocks raised on the way out; nothing is left to report it to


#: How asyncio's report of a task collected while still pending begins (``Task.__del__``).
_DESTROYED_PENDING: Final = "Task was destroyed but it is pending"


def _drop_destroyed_pending(loop: asyncio.AbstractEventLoop, abandoned: set[int]) -> None:
    """Make the closed ``loop`` drop asyncio's "Task was destroyed but it is pending!" report of each task whose id is
    in ``abandoned``, once; every other report goes to the handler the loop had, else to the default one.

    Through the loop's public exception handler, where the report goes, not asyncio's private switch on
    the task. By id, not by weak reference: the garbage collector clears those before it finalizes a
    task caught in a cycle. The task is alive while it reports, and its id is dropped then, so a later
    object that reuses the id is never mistaken for it.
    """
    previous = loop.get_exception_handler()

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        task = id(context.get("task"))
        if task in abandoned and str(context.get("message", "")).startswith(_DESTROYED_PENDING):
            abandoned.discard(task)
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)


async def _load(target: Target, check: str, *, record_only: bool = False) -> LoadedPlugin:
    try:
        return await load_plugin(target.name, target.config, record_only=record_only)
    except Exception as error:
        message = error.message if isinstance(error, DshError) else f"{type(error).__name__}: {error}"
        raise _Failed(
            [
                failure(
                    target,
                    check,
                    f"the plugin did not start, so this check could not run: {message}",
                    "make the plugin load and start alone (see the entry-point check)",
                )
            ]
        ) from None


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def _dsh_warnings() -> Iterator[list[logging.LogRecord]]:
    """What the ``dsh`` logger warns about meanwhile (:class:`_Culprit` keeps the plugin's)."""
    handler = _Records()
    logger = logging.getLogger("dsh")
    logger.addHandler(handler)
    try:
        yield handler.records
    finally:
        logger.removeHandler(handler)


def _in_package(module: object, package: str) -> bool:
    return isinstance(module, str) and (module == package or module.startswith(package + "."))


def _exception_modules(error: BaseException) -> Iterator[object]:
    """The modules of every frame the exception (and its causes and contexts) passed through."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [error]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        tb = current.__traceback__
        while tb is not None:
            yield tb.tb_frame.f_globals.get("__name__")
            tb = tb.tb_next
        pending += [current.__cause__, current.__context__]


@frozen
class _Culprit:
    """What marks a warning dsh logged as the plugin's: its id, its scope, its package.

    dsh logs a plugin's failure naming the plugin id (hooks), the scope whose disposer or task
    failed, or the guard's qualified name, and with the exception; a plugin may also warn itself
    on a ``dsh`` logger. A warning with none of these (the kit's own root scope, dsh itself) is
    not the plugin's, and is left to the log (pytest shows it) rather than failing the plugin.
    """

    name: str
    scope_path: str | None
    package: str | None

    def caused(self, record: logging.LogRecord) -> bool:
        """Whether ``record`` names the plugin, its scope or its code, or was issued from its code."""
        args = record.args.values() if isinstance(record.args, dict) else (record.args or ())
        for arg in args:
            if not isinstance(arg, str):
                continue
            if arg == self.name:
                return True
            if self.scope_path is not None and (arg == self.scope_path or arg.startswith(self.scope_path + "/")):
                return True
            if self.package is not None and _in_package(arg, self.package):
                return True  # a callable of the plugin's, by qualified name (a registry guard)
        if self.package is None:
            return False
        error = record.exc_info[1] if record.exc_info else None
        if error is not None and any(_in_package(m, self.package) for m in _exception_modules(error)):
            return True
        return self._issued_from_package(record.pathname)

    def _issued_from_package(self, pathname: str) -> bool:
        module = sys.modules.get(self.package or "")
        if module is None or not pathname:
            return False
        where = os.path.realpath(pathname)
        roots = list(getattr(module, "__path__", None) or ())
        if roots:
            return any(where.startswith(os.path.realpath(root) + os.sep) for root in roots)
        file = getattr(module, "__file__", None)
        return isinstance(file, str) and where == os.path.realpath(file)


def _culprit(target: Target, scope_path: str | None) -> _Culprit:
    from dsh_core.testing import loader

    try:
        package: str | None = loader.find_entry_point(target.name).module.split(".")[0]
    except Exception:
        package = None  # the entry-point check reports it; the id and the scope still attribute
    return _Culprit(target.name, scope_path, package)


def _logged(target: Target, check: str, records: list[logging.LogRecord], culprit: _Culprit) -> list[str]:
    """One failure per distinct failure of the plugin dsh logged (an observer that raises on every call is
    named once); what dsh warned about that the plugin did not cause is not its failure."""
    texts: dict[str, None] = {}
    for record in records:
        if not culprit.caused(record):
            continue
        text = record.getMessage()
        error = record.exc_info[1] if record.exc_info else None
        if error is not None:
            text += f" ({type(error).__name__}: {error})"
        texts[text] = None
    return [
        failure(
            target,
            check,
            f"dsh logged a failure of the plugin: {text}",
            "hooks, disposers and spawned tasks must not raise: dsh catches the exception, logs it and "
            "goes on as if the hook had not run (a raising guard denies the call); handle errors inside "
            "them",
        )
        for text in texts
    ]


def probe_command(target: Target) -> str:
    """The shell command that runs the stdout check's probe on ``target`` by hand (quoted for a POSIX shell)."""
    return f"python -m dsh_core.testing.probe {shlex.quote(target.name)} {shlex.quote(json.dumps(target.config))}"


def _with_plugin(
    target: Target,
    check: str,
    probe: Callable[[LoadedPlugin, list[str]], Awaitable[None]],
    *,
    disposed: Callable[[LoadedPlugin], list[str]] | None = None,
    quiesce_when: str | None = None,
    load_leftovers: bool = False,
) -> list[str]:
    """Load the plugin fresh, let ``probe`` append its failures, always dispose; those failures.

    ``disposed`` adds the failures it finds once the plugin is disposed. Failures of the plugin dsh
    isolated and only logged (a raising observer hook or disposer) are failures too. With ``quiesce_when``, so are
    asyncio tasks started since the load and still running after dispose (the event loop closing
    would otherwise cancel them unseen), then threads and descendant processes still running after it
    (orphans included: the kit is a child subreaper meanwhile), which are then killed and reaped. Without it,
    the descendant processes still running are killed and reaped all the same, unreported (see
    :func:`_ending_processes`).

    What was already running once the plugin had loaded (and the processes those start) is no call's:
    it is reported, as left running at load, only with ``load_leftovers`` (the dispose check; every
    check loads the plugin, so each would report it again), and is otherwise taken as running before.
    """

    scope_paths: list[str] = []
    owners: dict[int, str] = {}
    at_load = _AtLoad()

    async def scenario() -> list[str]:
        if quiesce_when is not None:
            _OWNERS.set(owners)  # this task's context, copied into the calls' tasks
        tasks_before = asyncio.all_tasks()
        loaded = await _load(target, check)
        if quiesce_when is not None:
            at_load.take(tasks_before, threads_before, owners)
        if loaded.scope is not None:
            scope_paths.append(loaded.scope.path)
        found: list[str] = []
        try:
            await probe(loaded, found)
        finally:
            await loaded.dispose()
        if disposed is not None:
            found.extend(disposed(loaded))
        if quiesce_when is not None:
            asks = loaded.hooks.asks if isinstance(loaded.hooks, WatchingHooks) else {}
            found.extend(await _stray_tasks(target, check, quiesce_when, tasks_before, at_load, load_leftovers, asks))
        return found

    executor = _DetachedExecutor()
    with _ending_processes() as children_before:
        threads_before = set(threading.enumerate())
        owners.update(dict.fromkeys(children_before, ""))  # not the plugin's, nor is what they start
        with _dsh_warnings() as records:
            result: list[str] = _run(scenario, executor)
        result += _logged(target, check, records, _culprit(target, scope_paths[0] if scope_paths else None))
        if quiesce_when is not None:
            result += _strays(
                target, check, quiesce_when, threads_before, children_before, executor, owners, at_load, load_leftovers
            )
    return result


@contextlib.contextmanager
def _ending_processes() -> Iterator[set[int]]:
    """The descendant processes running now; on the way out, every one started since is killed and reaped,
    unreported, orphans included (this process is a child subreaper meanwhile: see :func:`_adopting`).

    Every check that starts the plugin runs in it: what its factory or a hook dsh called as it started
    leaves running (a server, a ``sleep``) would otherwise run on after the check, and after the kit, in
    the checks that look for no leftovers. Reporting it is the dispose check's alone (:func:`_with_plugin`);
    the others that look for leftovers report and kill theirs before (:func:`_strays`), leaving nothing here.
    """
    with _adopting():
        before = set(_descendants())
        try:
            yield before
        finally:
            _end_processes(before)


#: The owner of a process the plugin left running at load (and of what it starts) in ``_OWNERS``: never a tool
#: name, which holds no ``<``.
_LOAD_OWNER: Final = "<load>"

#: What a failure says of a leftover that was already running once the plugin had loaded, before its ``when``.
_AT_LOAD: Final = "was left running at load and "


@define
class _AtLoad:
    """What was running once the plugin had loaded (its factory and the hooks dsh calls as it starts) that was not
    before: no call of a check's left it."""

    tasks: set[asyncio.Task[Any]] = field(factory=set)
    threads: set[threading.Thread] = field(factory=set)

    def take(
        self, tasks_before: set[asyncio.Task[Any]], threads_before: set[threading.Thread], owners: dict[int, str]
    ) -> None:
        """Note what runs now (called in the check's task, right after the load), and claim the processes for it."""
        self.tasks = asyncio.all_tasks() - tasks_before - {asyncio.current_task()}
        # The executor's jobs are threads too: the load's jobs are those running now.
        self.threads = {t for t in set(threading.enumerate()) - threads_before if t.is_alive()}
        _claim(owners, _LOAD_OWNER)  # else the first call to end took them, and they were blamed on its tool


def _guarded(check: Callable[[Target], list[str]]) -> Callable[[Target], list[str]]:
    def run(target: Target) -> list[str]:
        try:
            return check(target)
        except _Failed as failed:
            return failed.failures

    run.__name__ = check.__name__
    run.__doc__ = check.__doc__
    return run


def same(left: object, right: object) -> bool:
    """Deep equality that also compares types (``1``, ``1.0`` and ``True`` all differ)."""
    stack = [(left, right)]
    while stack:
        a, b = stack.pop()
        if (
            type(a) is not type(b)
            and not (isinstance(a, dict) and isinstance(b, dict))
            and not (isinstance(a, list) and isinstance(b, list))
        ):
            return False
        if isinstance(a, dict):
            if list(a) != list(b):  # type: ignore[call-overload]
                return False
            stack.extend((a[k], b[k]) for k in a)  # type: ignore[index]
        elif isinstance(a, list):
            if len(a) != len(b):  # type: ignore[arg-type]
                return False
            stack.extend(zip(a, b, strict=True))  # type: ignore[call-overload]
        elif a != b:
            return False
    return True


def _brief(value: object, limit: int = 200) -> str:
    text = json.dumps(thaw(value), ensure_ascii=False) if find_loss(value) is None else repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


async def _call(
    loaded: LoadedPlugin,
    name: str,
    arguments: JSON,
    signal: AbortSignal | None = None,
    call_id: str = "conformance",
    watch: CallWatch | None = None,
) -> Any:
    """Make one call through the runtime; ``watch`` follows it (whether it waits in its approval ask)."""
    request = ToolExecutionInput(call_id=call_id, name=name, arguments=arguments, signal=signal or AbortSignal.never())
    previous = _TOOL.get()
    _TOOL.set(name)  # the tasks the call starts copy it: their threads are this tool's
    CALL_WATCH.set(watch)  # this call's task's own context (each call runs in a task of its own), copied likewise
    try:
        return await loaded.runtime.execute(request)
    finally:
        # Not a token's reset: an abandoned call is closed from outside its task's context (_abandon).
        _TOOL.set(previous)
        owners = _OWNERS.get()
        if owners is not None:
            _claim(owners, name)


def _call_limit(target: Target) -> float:
    """Seconds a call the kit makes may run: ``Target.call_timeout_s``, else :data:`CALL_TIMEOUT_S` (read now, so a
    test may change it)."""
    return CALL_TIMEOUT_S if target.call_timeout_s is None else target.call_timeout_s


@frozen
class _CallMarks:
    """Where one call's traces begin in its tool's :class:`ToolSpy`, to read them back as the call's own: its body's
    runs (:meth:`ToolSpy.runs_of`) and its ``finalize_content``'s (:meth:`ToolSpy.finalized_for`) for ``call_id``, from
    the spy's counts before the call (``known``, ``finalized``). Another call's body (the plugin's own, or one an
    earlier check abandoned) may be entered meanwhile: it is told apart by its call id, not counted.
    """

    #: ``None`` where the registry refused the tool the plugin registered through the kit's register callable and the
    #: plugin went on (it swallowed the error): the kit has its definition, so it calls it, but no spy.
    spy: ToolSpy | None
    call_id: str
    #: Whether the call is dispatched (``False``: its signal was aborted before it was made, so the runtime settles it
    #: without running the body): what the call is taken to have done where no spy sees its body (:meth:`runs`).
    dispatched: bool = True
    #: ``len(spy.runs)`` before the call.
    known: int = 0
    #: ``len(spy.finalizations)`` before the call.
    finalized: int = 0
    #: Without a spy: whether the registry holds a tool of the name all the same (one the plugin registered straight
    #: in the registry, which it reaches as ``scope.lookup("tools")``), whose body no spy sees. Without one, the
    #: runtime finds no tool to run: no body can run for the call.
    unseen_body: bool = False

    @classmethod
    def before(cls, loaded: LoadedPlugin, name: str, call_id: str, *, dispatched: bool = True) -> _CallMarks:
        """The marks of a call about to be made of the tool ``name`` of ``loaded``."""
        spy = loaded.spies.get(name)
        if spy is None:
            return cls(None, call_id, dispatched, unseen_body=loaded.registry.get(name) is not None)
        return cls(spy, call_id, dispatched, len(spy.runs), len(spy.finalizations))

    def runs(self) -> list[BodyRun] | None:
        """The body's runs for the call, so far. Where no spy sees the body, ``None`` (taken as running: the body is
        blamed, as for any dispatched call) if the call is dispatched and the registry holds a body of the name, else
        ``[]`` (taken as never run: the runtime runs no body for a call aborted before dispatch, so only its result
        observers can hold it, nor for a tool it does not hold, so only the stages before the body and after it
        can)."""
        if self.spy is None:
            return None if self.dispatched and self.unseen_body else []
        return self.spy.runs_of(self.call_id, self.known)

    def finalize_s(self) -> float:
        """The seconds the tool's ``finalize_content`` ran (so blocked the event loop) for the call, so far: 0 without
        a spy or a run that ended."""
        if self.spy is None:
            return 0.0
        return max((run.seconds or 0.0 for run in self.spy.finalized_for(self.call_id, self.finalized)), default=0.0)

    def blocked(self, limit: float) -> bool:
        """Whether the call's body (ended or not) or its tool's ``finalize_content`` blocked the event loop past
        ``limit``: no timer fires meanwhile, so the kit could not enforce it (:func:`_blocked_past`,
        :func:`_grace_if_blocked`)."""
        return _blocked_over(self.runs(), limit) is not None or self.finalize_s() > limit

    def hold(self, asking: bool, limit: float) -> _Hold:
        """Where the call was held, now (:func:`_held_by`): ``asking`` is whether it waits in its own approval ask;
        its body and its tool's ``finalize_content`` are named for blocking the event loop if they did past
        ``limit``."""
        runs = self.runs()
        finalize_s = self.finalize_s()
        return _held_by(
            asking,
            runs,
            dispatched=self.dispatched,
            finalize_s=finalize_s if finalize_s > limit else None,
            blocked_s=_blocked_over(runs, limit),
        )


async def _wait(task: asyncio.Future[Any], seconds: float) -> bool:
    """Wait up to ``seconds`` for ``task`` to end, never cancelling it; whether it has."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.shield(task), seconds)
    return task.done()


async def _grace_if_blocked(task: asyncio.Future[Any], marks: _CallMarks, limit: float, grace: float) -> bool:
    """Give the call ``task`` runs ``grace`` seconds more (:func:`_stuck_grace`, for a stuck call) if it is still
    running and its body or its tool's ``finalize_content`` blocked the event loop past ``limit``; whether it has
    ended.

    The kit's wait ended only once that stage freed the loop, what runs next given next to no time (a body that then
    awaits 0.05 s, a post-execute hook or a result observer that does): the call gets the grace once, before it is
    aborted or judged. Not aborted first: a stage that returns only once aborted would be blamed for not returning,
    and a call that returns in the grace did not need the abort; it is reported as one that blocked and returned
    (:func:`_blocked_past`), not as one held by what ran next.
    """
    if not task.done() and marks.blocked(limit):
        await _wait(task, grace)
    return task.done()


async def _bounded_call(
    target: Target,
    check: str,
    loaded: LoadedPlugin,
    name: str,
    arguments: JSON,
    what: str,
    found: list[str],
    call_id: str,
) -> ToolResult | None:
    """One call as :func:`_call`, given ``Target.call_timeout_s`` (else :data:`CALL_TIMEOUT_S`) to return.

    ``call_id`` is the call's own among the calls of tool ``name`` the check makes: what the body did
    for this call is told apart from what it did for others by it (:class:`_CallMarks`).

    A call that returned only after the limit because its body or its tool's ``finalize_content`` blocked the
    event loop that long at a stretch (so the kit's timeout could not fire) is reported too, and its result
    returned (:func:`_blocked_past`). So is one still running once such a stage freed the loop (the body going on,
    or a stage after the blocking one) that then returns within the grace of a stuck call, which it is given first,
    not aborted (:func:`_grace_if_blocked`).

    A call still running then is aborted through its signal and, still running ``STUCK_GRACE_S`` later
    (more if it waited in its approval ask: :func:`_stuck_grace`), cancelled; either way it is reported
    in ``found`` (``what`` names the arguments), blamed on what held it (the body, the approval ask,
    the stages before the body, or, the body having ended, those after it), and ``None`` returned. A body or a
    ``finalize_content`` that blocked the event loop past the limit is named for that first, whatever the call was
    doing once the loop was free and the timeout could fire (still in the body, or already past what blocked), then
    the stage after it if that one still held the call once aborted (:func:`_held_after`); how long the call ran on
    once the loop was free is said with the grace it had before the abort counted, not only the one after it.
    Awaited with no bound, a body that never returns hung the check forever, and it reported nothing.
    """
    limit = _call_limit(target)
    controller = AbortController()
    watch = CallWatch(call_id)
    marks = _CallMarks.before(loaded, name, call_id)
    task = asyncio.ensure_future(_call(loaded, name, arguments, controller.signal, call_id=call_id, watch=watch))
    await _wait(task, limit)
    first = _stuck_grace(loaded, watch)
    if await _grace_if_blocked(task, marks, limit, first):
        _blocked_past(target, check, name, f"{what}: the call", limit, marks, found)
        result: ToolResult = task.result()
        return result
    # The grace the call was just given, if a stage blocked the loop past the limit: it ran on that long once the loop
    # was free, before the abort. The verdict counts it: said only after the abort, the call read as aborted as soon
    # as the loop was free, and what held it then as given only the grace after the abort.
    before = first if marks.blocked(limit) else 0.0
    # What held the call, seen before the abort: the abort ends the ask (withdrawn) and the stages before the body.
    # The spy's runs, not the call's context: a middleware may run the body in a task started elsewhere.
    runs = marks.runs()
    hold = marks.hold(watch.asking, limit)
    grace = _stuck_grace(loaded, watch)
    controller.abort(f"conformance: the call did not return within {limit:g} s")
    await _wait(task, grace)
    late: _After | None = None
    if not task.done():
        late = _held_after(hold)
        # A body still running at the limit that ended once aborted, the call going on: held after it, too.
        if late is None and hold.stage == "body" and (ended := _body_end(runs or [])) is not None:
            late = _After(f"its body {ended} once its signal was aborted", _AFTER_BODY, _AFTER_FIX)
    fix = hold.fix + (f"; and {late.fix}" if late is not None else "") + _LARGER_LIMIT
    if task.done():
        after = "it returned once its signal was aborted"
        if before:
            after = (
                f"it was still running {before:g} s after the event loop was free, and returned once its signal was "
                "then aborted"
            )
    elif await _cancel(task, cancel_grace := _stuck_grace(loaded, watch)):
        since = (
            f"{before + grace:g} s after the event loop was free and {grace:g} s after"
            if before
            else f"{grace:g} s after"
        )
        if late is None:
            after = f"it was still running {since} its signal was aborted, and was cancelled"
        else:
            after = f"{late.clause}, still running {since} the abort, and was cancelled"
    else:
        after = _IGNORED_CANCEL_PROBLEM.format(grace=cancel_grace)
        fix = f"{_IGNORED_CANCEL_FIX}; and {fix}"
    found.append(
        failure(target, check, f"{what}: the call did not return within {limit:g} s: {hold.held} ({after})", fix, name)
    )
    return None


def _blocked_past(
    target: Target, check: str, name: str, call: str, limit: float, marks: _CallMarks, found: list[str]
) -> None:
    """Report in ``found`` a call (``call`` names it, ``marks`` its traces) of tool ``name`` that returned, but only
    after ``limit`` because its body or its tool's ``finalize_content`` blocked the event loop longer than that at a
    stretch: the kit's timeout cannot fire while the loop is blocked, so the call returned unseen. What the body did
    is measured by how long it held the loop without awaiting, as the abort check does
    (:attr:`BodyRun.longest_step_s`), not by how long it ran: one that awaits lets the timeout fire."""
    if not marks.blocked(limit):
        return
    hold = marks.hold(False, limit)
    found.append(
        failure(
            target, check, f"{call} did not return within {limit:g} s: {hold.held} (it returned then)", hold.fix, name
        )
    )


@frozen
class _Hold:
    """Where a call that did not return in time was held, in a failure's words, and the fix to suggest.

    Made by :func:`_held_by` (through :meth:`_CallMarks.hold`) for every check that reports a stuck call (each frames
    it: how long it waited, what it then did to the call) and for a call that returned only after the limit or the
    abort bound because a stage held it (:func:`_blocked_past`, the abort check once the body has returned in time).
    What held the call after a stage that blocked the loop and ended is :func:`_held_after`'s. The abort check judges
    the body's own timing against the abort itself (a first step that delayed its delivery, a later one that blocked
    past the bound, a return too long after it): those say how the body answered the abort, not where a call was
    held.
    """

    #: ``"ask"`` (its own approval ask), ``"before"`` (a stage before the body), ``"body"``, ``"after"`` (a stage
    #: after the body), ``"observers"`` (the result observers: all a call aborted before dispatch reaches) or
    #: ``"finalize"`` (the tool's ``finalize_content``, which blocked the event loop; a body that blocked it before is
    #: named in :attr:`held` too). A body that blocked the event loop is ``"body"``, with :attr:`body_end` set once it
    #: ended.
    stage: Literal["ask", "before", "body", "after", "observers", "finalize"]
    #: What held it, as a clause: ``it was held ...`` (it follows "did not return within N s: ").
    held: str
    #: The fix, naming the stage the plugin must change.
    fix: str
    #: Whether the body was entered for the call (taken as entered where no spy sees it: :meth:`_CallMarks.runs`).
    body_ran: bool
    #: How the body ended for the call (``"returned"``, ``"raised NAME"``), ``None`` if it never ran or still runs,
    #: and for a call held in its ask.
    body_end: str | None = None


@frozen
class _After:
    """What held a call after the stage that ended first (a body, a ``finalize_content``), in a failure's words:
    reported beside that stage's own :class:`_Hold`, once the call was still running past it."""

    #: How the first stage ended, as a clause: ``its body had returned`` (or ``had raised NAME``), ``its body
    #: returned once its signal was aborted``, ``its finalize_content had returned``. :attr:`clause` adds what then
    #: held the call; the check, for how long.
    ended: str
    #: The stages that may have held it, as :data:`_AFTER_BODY` (``by ...``).
    by: str
    #: The fix of those stages.
    fix: str

    @property
    def clause(self) -> str:
        """The whole clause: how the first stage ended, and what then held the call."""
        return f"{self.ended}, but the call was then held after it ({self.by})"


def _held_after(hold: _Hold) -> _After | None:
    """What held a call after the stage ``hold`` names, if that stage blocked the event loop past the limit and ended:
    a body that had returned, or the tool's ``finalize_content`` (which always ends). The kit's timeout fired only
    once the loop was free, when the call was past that stage, so a stage after it that is still running once the
    call was given its grace held the call too (as a body that blocked, then awaited, held it both ways). ``None``
    for any other hold: what held the call is all :attr:`_Hold.held` says."""
    if hold.stage == "finalize":
        # Only the result observers run after finalize_content (dsh awaits nothing else once it returns).
        return _After("its finalize_content had returned", _AFTER_FINALIZE, _AFTER_FINALIZE_FIX)
    if hold.stage == "body" and hold.body_end is not None:
        return _After(f"its body had {hold.body_end}", _AFTER_BODY, _AFTER_FIX)
    return None


def _held_by(
    asking: bool,
    runs: list[BodyRun] | None,
    *,
    dispatched: bool = True,
    finalize_s: float | None = None,
    blocked_s: float | None = None,
) -> _Hold:
    """Where a call that did not return in time was held (or, one that returned late, what made it late): ``asking``
    is whether it waits in its own approval ask (its :class:`CallWatch`), ``runs`` the body's runs for its call id
    (:meth:`_CallMarks.runs`; ``None``, for a body no spy sees, is taken as running). ``dispatched=False``: the call
    was aborted before dispatch, so of the plugin's stages only its result observers run for it, unless the body ran
    anyway (which the core never does).
    ``finalize_s``: the seconds the tool's ``finalize_content`` blocked the event loop for the call, given when
    that is what made it late (it runs for every call, a pre-aborted one too, and outranks every stage that did not
    block the loop).
    ``blocked_s``: the longest the body blocked the event loop without awaiting for the call, given when that is
    what made it late (:attr:`BodyRun.longest_step_s`, :func:`_blocked_over`): the kit's timeout could not fire
    meanwhile. Said with whether the body had returned: one that blocked, then went on awaiting, held the call both
    ways, and both fixes apply. Given both, both are named (the body first, as it ran first), with both fixes: each
    alone made the call late.
    """
    ran = runs is None or bool(runs)
    if asking:
        return _Hold("ask", _HELD_IN_ASK, _APPROVAL_FIX, ran)
    ended = _body_end(runs) if runs is not None else None
    if finalize_s is not None:
        held = _HELD_BY_FINALIZE.format(seconds=finalize_s)
        if blocked_s is None:
            return _Hold("finalize", held, _FINALIZE_FIX, ran, ended)
        body = _HELD_BY_BLOCKING_BODY.format(seconds=blocked_s)
        return _Hold(
            "finalize",
            f"{body}, and {held.removeprefix('it was held ')}",
            f"{_BLOCKING_BODY_FIX}; and {_FINALIZE_FIX}",
            ran,
            ended,
        )
    if blocked_s is not None:
        held = _HELD_BY_BLOCKING_BODY.format(seconds=blocked_s)
        if ended is None:
            return _Hold("body", f"{held}, and had not returned", f"{_BLOCKING_BODY_FIX}; and {_BODY_FIX}", True)
        return _Hold("body", held, _BLOCKING_BODY_FIX, True, ended)
    if not ran:
        if not dispatched:
            return _Hold("observers", f"it was held {_PRE_ABORTED_HELD}", _PRE_ABORTED_FIX, ran)
        return _Hold("before", f"it was held before its body ({_BEFORE_BODY}), so the body never ran", _HELD_FIX, ran)
    if ended is not None:
        return _Hold("after", _HELD_AFTER.format(ended=ended), _AFTER_FIX, ran, ended)
    if not dispatched:
        return _Hold(
            "body",
            "it was held by its body, which ran although the call was aborted before dispatch",
            _NO_BODY_FROM_HOOKS_FIX,
            ran,
        )
    return _Hold("body", "it was held by its body, which had not returned", _BODY_FIX, ran)


def _blocked_over(runs: list[BodyRun] | None, limit: float) -> float | None:
    """The longest the body blocked the event loop without awaiting in ``runs`` (one call's), if longer than
    ``limit``: no timer fires while the loop is blocked, so a limit the body blocked past is one the kit could not
    enforce; ``None`` otherwise."""
    blocked = max((run.longest_step_s for run in runs or ()), default=0.0)
    return blocked if blocked > limit else None


#: What a failure says of a call its tool's ``finalize_content`` held (``seconds``: how long it blocked the loop).
_HELD_BY_FINALIZE: Final = (
    "it was held by the tool's finalize_content, which blocked the event loop for {seconds:.2f} s "
    "(dsh calls it synchronously, once the call's result is settled)"
)
#: The fix of a call held by its tool's ``finalize_content``.
_FINALIZE_FIX: Final = (
    "finalize_content runs on the event loop and is never awaited: make it a quick transform of the result's "
    "content (no sleeping, blocking I/O or waiting on locks or threads); do slow work in the body, where it can be "
    "awaited and aborted"
)


#: What a failure says of a call its body held by blocking the event loop (``seconds``: the longest it did so without
#: awaiting, in one step).
_HELD_BY_BLOCKING_BODY: Final = (
    "it was held by its body, which blocked the event loop for {seconds:.2f} s without awaiting "
    "(blocking work in async def: time.sleep, blocking I/O, subprocess.run)"
)
#: The fix of a body that blocks the event loop: the abort check's (the abort cannot be delivered, or once delivered
#: cannot act) and the call-limit checks' (their timeout cannot fire).
_BLOCKING_BODY_FIX: Final = (
    "await instead of blocking: run blocking work with await asyncio.to_thread(...) or in an executor "
    "(loop.run_in_executor), processes with asyncio.create_subprocess_exec, and watch ctx.signal"
)


#: What a failure says of a call that waited for the answer to its own approval ask.
_HELD_IN_ASK: Final = "it was waiting for the answer to an approval ask, which never came, so the body never ran"
#: The fix of a call held by its body.
_BODY_FIX: Final = (
    "return promptly or honour ctx.signal (ctx.signal.add_listener or await ctx.signal.wait()) "
    "and stop waiting on what never ends"
)


#: The stages of a call before its body, all the plugin's in the kit (an approval ask is named on its own). The
#: approval observers run once the ask is resolved, when the call is no longer asking: one that never returns holds it.
_BEFORE_BODY: Final = (
    "by a pre-execute hook, an approval observer (dsh_approval_resolved), a guard or an around-dispatch middleware"
)
#: The fix of a call that waited for the answer to an approval ask: the kit's calls have no one to answer them.
_APPROVAL_FIX: Final = (
    "an approval channel (dsh_approve) must answer, or abstain by returning None, when it can "
    "reach no one (no one answers the kit's calls), and end as soon as its ask is withdrawn "
    "(never swallow asyncio.CancelledError there); to check the tools, give the plugin a config "
    "that asks no one about them (plugin_config in your subclass, --dsh-conformance-config)"
)
#: The stages of a call after its body has returned or raised, all the plugin's in the kit (a middleware resumes once
#: ``proceed`` returns; ``finalize_content`` is not awaited, so it holds a call only by blocking the loop, and is named
#: on its own, by how long it ran: :data:`_HELD_BY_FINALIZE`).
_AFTER_BODY: Final = (
    "by a post-execute hook, a result observer (dsh_tool_result) or an around-dispatch middleware "
    "that did not return once proceed had"
)
#: The stage of a call after its tool's ``finalize_content``: dsh awaits only the result observers once it returned.
_AFTER_FINALIZE: Final = "by a result observer (dsh_tool_result)"
#: The fix of a call held after its tool's ``finalize_content``.
_AFTER_FINALIZE_FIX: Final = (
    "make result observers (dsh_tool_result) return promptly, and end when the call is aborted or cancelled"
)
#: What a call-limit failure says of a call held after its body (``ended``: "returned" or "raised NAME").
_HELD_AFTER: Final = "it was held after its body (" + _AFTER_BODY + "), which had {ended} already"
#: The fix of a body run for a call aborted before dispatch (the pre-abort check's, whether or not the call returned).
_NO_BODY_FROM_HOOKS_FIX: Final = "do not call tool bodies from hooks; let the runtime dispatch"
#: The fix of a call held after its body.
_AFTER_FIX: Final = (
    "make post-execute hooks, result observers (dsh_tool_result) and around-dispatch middleware "
    "return promptly (a middleware returns once proceed has returned), and end when the call is "
    "aborted or cancelled"
)
#: The stage of the plugin's that a call aborted before dispatch still reaches: the runtime settles it before any
#: pre-execute hook (so no approval, guard, middleware, body or post-execute either) and only finishes it, which
#: notifies the result observers (and runs ``finalize_content``, named on its own: :data:`_HELD_BY_FINALIZE`).
_PRE_ABORTED_HELD: Final = (
    "by a result observer (dsh_tool_result), the only hook of the plugin's a call aborted before dispatch still runs"
)
#: The fix of a call aborted before dispatch that did not return.
_PRE_ABORTED_FIX: Final = (
    "make result observers (dsh_tool_result) return promptly, and end when the call is "
    "cancelled: they hear every call's result, a call aborted before dispatch included"
)
#: The end of the fix of a call that ran past the call timeout.
_LARGER_LIMIT: Final = (
    "; a call that is slow on purpose needs a larger limit (call_timeout_s in your subclass, "
    "--dsh-conformance-call-timeout)"
)
#: The fix of a call held before its body, not in an approval ask.
_HELD_FIX: Final = (
    "make pre-execute hooks, approval observers, guards and around-dispatch middleware return "
    "promptly (a middleware calls proceed or answers itself), and end when the call is aborted or "
    "cancelled"
)


#: What a failure says of a call that ran on once cancelled (``grace``: how long the kit waited), and its fix.
_IGNORED_CANCEL_PROBLEM: Final = (
    "it ignored cancellation: it was still running {grace:g} s after it was cancelled, "
    "so the kit stopped waiting for it"
)
_IGNORED_CANCEL_FIX: Final = (
    "never swallow asyncio.CancelledError: catch it only to clean up, then re-raise it "
    "(code that goes on once cancelled runs with no caller, and a loop that waits for it "
    "never closes)"
)


def _body_end(runs: list[BodyRun]) -> str | None:
    """How the body ended in ``runs`` (one call's): ``"returned"`` or ``"raised NAME"``; ``None`` if it never ran or
    still runs."""
    if not runs or not runs[-1].ended:
        return None
    error = runs[-1].error
    return "returned" if error is None else f"raised {type(error).__name__}"


def _spied(loaded: LoadedPlugin) -> Iterator[tuple[ToolDefinition, ToolSpy]]:
    """Each tool ``loaded`` registered that the registry took, with the spy of its body, in registration order.

    A tool the registry refused, the plugin going on (it swallowed the error), has a definition but no spy: the
    checks that judge what its body did (ran, raised, how it took an abort) cannot see it run, so they skip it,
    and the tool-names check reports it. The checks that only time a call make it all the same
    (:meth:`_CallMarks.before`).
    """
    for definition in loaded.definitions:
        spy = loaded.spies.get(definition.name)
        # A refused duplicate of a tool the plugin registered first finds that tool's spy, which is not its own.
        if spy is not None and spy.definition is definition:
            yield definition, spy


def _schemas_valid(definition: ToolDefinition) -> bool:
    """False when a schema is invalid: such a tool is reported by the tool-schemas check and skipped elsewhere."""
    try:
        check_schema(thaw(definition.parameters), owner="parameters")
        check_schema(thaw(definition.output.schema), owner="output schema")
    except DshError:
        return False
    return True


# -- loading -------------------------------------------------------------------------------------------------


@_guarded
def check_entry_point(target: Target) -> list[str]:
    """The entry point exists, loads strictly, and the plugin starts and stops alone."""
    from dsh_core.testing.loader import find_entry_point

    try:
        find_entry_point(target.name)
    except DshError as error:
        return [
            failure(
                target,
                "entry-point",
                error.message,
                'declare [project.entry-points."dsh.plugins"] NAME = "module:factory" and install the distribution',
            )
        ]
    try:
        load_factory(target.name)
    except DshError as error:
        # The entry point is declared: what failed is its module, its object or its config schema.
        return [
            failure(
                target,
                "entry-point",
                error.message,
                "fix what the message names: the module must import without errors (and never call "
                "sys.exit), the entry point must name the factory function (decorated with "
                "@plugin(...)), and its config_schema must be a valid Draft 2020-12 schema",
            )
        ]

    async def scenario() -> list[str]:
        try:
            loaded = await load_plugin(target.name, target.config)
        except Exception as error:
            message = error.message if isinstance(error, DshError) else f"{type(error).__name__}: {error}"
            return [
                failure(
                    target,
                    "entry-point",
                    f"the plugin did not start alone: {message}",
                    "fix what the message names: the factory must be a plain function (never "
                    "`async def`) that starts the plugin from its scope and config alone, with no other "
                    "plugin loaded, and its hook implementations must be accepted when it is registered "
                    "(the hookimpls check says how)",
                )
            ]
        await loaded.dispose()
        return []

    with _ending_processes():
        result: list[str] = _run(scenario)
    return result


@frozen
class _Phase:
    """One phase of the stdout probe: what it does, and the fix for output, a failure or a hang in it."""

    doing: str
    output_fix: str
    failure_fix: str
    hang_fix: str


_LOG_INSTEAD = "stdout may be a protocol channel: log to stderr (logging) instead"

#: The probe's phases (see :mod:`dsh_core.testing.probe`), plus "startup": before its first mark.
_PHASES: Final[dict[str, _Phase]] = {
    "startup": _Phase(
        "starting the fresh interpreter, before the plugin was imported",
        "this output is not the plugin's: look for sitecustomize or usercustomize modules or .pth files that "
        "print in the environment the tests run in",
        "run the tests with an interpreter that can import dsh_core and the plugin's distribution",
        "look for sitecustomize or usercustomize modules or .pth files that block in that environment",
    ),
    "import": _Phase(
        "importing the plugin's module",
        f"remove print() and other writes to stdout at module level (the plugin's modules and what they import "
        f"as they load); {_LOG_INSTEAD}",
        "make the entry point importable on its own (no reliance on modules the tests imported, such as "
        "conftest.py) and never call sys.exit at import",
        "do no blocking work at import (connect, download or start processes when the plugin starts, and "
        "without blocking: scope.spawn)",
    ),
    "start": _Phase(
        "starting the plugin (its factory and the hooks dsh calls as it starts, such as dsh_register_tools)",
        "do not print() in the factory or in hooks: dsh sends what print() writes there to stderr, so this "
        "reached file descriptor 1 directly: a child process that inherits stdout (pass stdout=subprocess.DEVNULL "
        f"or PIPE), os.write(1, ...) or sys.__stdout__; {_LOG_INSTEAD}",
        "make the factory start the plugin from its scope and config alone in a fresh process (no reliance on "
        "state the tests set up); the entry-point check names what failed",
        "do no blocking work in the factory or in hooks: start it with scope.spawn(...)",
    ),
    "dispose": _Phase(
        "disposing the plugin (its disposers and the tasks dispose cancels)",
        f"do not print() in disposers or background tasks, nor let a child process inherit stdout; {_LOG_INSTEAD}",
        "disposers must neither raise SystemExit (sys.exit) nor end the process (os._exit): clean up and return",
        "make dispose return promptly: cancel and await what the plugin started, kill its processes",
    ),
    "exit": _Phase(
        "exiting the interpreter after the plugin was disposed (an atexit handler, or a thread or child process "
        "still running)",
        "stop threads and child processes in a disposer (scope.on_dispose) and print nothing in atexit handlers; "
        + _LOG_INSTEAD,
        "do not end the process from a thread or an atexit handler (sys.exit, os._exit)",
        "stop threads and child processes in a disposer (scope.on_dispose): the interpreter waits for them",
    ),
}


def _read_marks(text: str) -> list[tuple[str, int | None]]:
    """The probe's marks, in order: each phase begun, with the stdout offset it began at."""
    marks: list[tuple[str, int | None]] = []
    for line in text.splitlines():
        phase, _, offset = line.partition(" ")
        if phase in _PHASES:
            marks.append((phase, int(offset) if offset.isdigit() else None))
    return marks


def _stdout_by_phase(stdout: bytes, marks: list[tuple[str, int | None]]) -> list[tuple[str | None, bytes]]:
    """``stdout`` cut at the marks into (phase, bytes) pieces that are not empty; one ``None`` piece without marks."""
    offsets = [offset for _, offset in marks]
    if not marks or None in offsets:
        return [(None, stdout)] if stdout else []
    bounds = [("startup", 0)] + [(phase, offset or 0) for phase, offset in marks]
    pieces: list[tuple[str | None, bytes]] = []
    for index, (phase, begin) in enumerate(bounds):
        end = bounds[index + 1][1] if index + 1 < len(bounds) else len(stdout)
        if stdout[begin:end]:
            pieces.append((phase, stdout[begin:end]))
    return pieces


@_guarded
def check_stdout(target: Target) -> list[str]:
    """Importing, starting and disposing the plugin in a fresh interpreter writes nothing to stdout.

    The probe marks where each phase begins, so a failure says which phase wrote, failed or hung
    (import, start, dispose) and gives the fix for that phase. What the plugin left running in that
    interpreter is killed and reaped once it has ended, unreported, as every check that starts the plugin
    does (reporting it is the dispose check's).
    """
    loss = find_loss(target.config)
    if loss is not None:
        # The probe gets the config as a JSON argument: json.dumps would raise out of the check.
        return [
            failure(
                target,
                "stdout",
                f"the config cannot be passed to a fresh interpreter: {loss}",
                "give the config as JSON values only (str(path) for a path, lists for tuples)",
            )
        ]
    env = dict(os.environ)
    # The child must see exactly the distributions this process sees (pytester directories included).
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
    # Files, not pipes: a process the plugin leaked would hold a pipe open and stall the read
    # (the dispose check reports such leaks; this one only cares about stdout). A file also has
    # offsets, which the probe's marks need.
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, tempfile.TemporaryDirectory() as scratch:
        marks_path = os.path.join(scratch, "marks")
        try:
            # As every check that starts the plugin: what it left running (here, in the probe) is killed and
            # reaped, orphans included. The probe's leftovers are its children, reparented to this process
            # (a subreaper meanwhile) by the time its exit is seen, whether it exited or was killed at the timeout.
            with _ending_processes():
                completed = subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "dsh_core.testing.probe",
                        target.name,
                        json.dumps(target.config),
                        marks_path,
                    ],
                    stdout=out,
                    stderr=err,
                    env=env,
                    timeout=PROBE_TIMEOUT_S,
                    check=False,
                )
        except subprocess.TimeoutExpired:
            hung = _last_phase(marks_path)
            if hung is None:
                return [
                    failure(
                        target,
                        "stdout",
                        "loading, starting and disposing the plugin in a fresh "
                        f"interpreter took more than {PROBE_TIMEOUT_S:g} s",
                        "do no blocking work at import or in the factory (start it with scope.spawn) "
                        "and make dispose return promptly",
                    )
                ]
            phase = _PHASES[hung]
            return [
                failure(
                    target,
                    "stdout",
                    f"{phase.doing} in a fresh interpreter took more than {PROBE_TIMEOUT_S:g} s",
                    phase.hang_fix,
                )
            ]
        out.seek(0)
        err.seek(0)
        stdout, stderr_bytes = out.read(), err.read()
        marks = _read_marks(_read_text(marks_path))
    failures = []
    for phase_name, written in _stdout_by_phase(stdout, marks):
        if phase_name is None:
            failures.append(
                failure(
                    target,
                    "stdout",
                    f"loading, starting or disposing the plugin wrote to stdout: {written[:300]!r}",
                    f"never print() at import, start-up or dispose; {_LOG_INSTEAD}",
                )
            )
        else:
            phase = _PHASES[phase_name]
            failures.append(
                failure(target, "stdout", f"{phase.doing} wrote to stdout: {written[:300]!r}", phase.output_fix)
            )
    if completed.returncode != 0:
        stderr = stderr_bytes.decode("utf-8", errors="replace").strip().splitlines()
        detail = stderr[-1] if stderr else f"exit status {completed.returncode}"
        if not marks:
            failures.append(
                failure(
                    target,
                    "stdout",
                    f"the plugin did not load and start in a fresh interpreter: {detail}",
                    f"run the probe to see where it fails: {probe_command(target)}",
                )
            )
        else:
            phase = _PHASES[marks[-1][0]]
            failures.append(
                failure(target, "stdout", f"{phase.doing} in a fresh interpreter failed: {detail}", phase.failure_fix)
            )
    return failures


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except OSError:
        return ""  # the probe never began (or is not the kit's): no marks


def _last_phase(marks_path: str) -> str | None:
    marks = _read_marks(_read_text(marks_path))
    return marks[-1][0] if marks else None


@_guarded
def check_config_schema(target: Target) -> list[str]:
    """The config schema is a valid Draft 2020-12 object schema, and the given config matches it."""
    from dsh_core.testing.loader import check_config, find_entry_point

    try:
        factory = find_entry_point(target.name).load()
    except Exception as error:
        message = error.message if isinstance(error, DshError) else f"{type(error).__name__}: {error}"
        return [
            failure(target, "config-schema", f"the entry point did not load: {message}", "fix the entry point first")
        ]
    schema = getattr(factory, "config_schema", None)
    # Without a declared schema there is nothing to vet, but the config still must be {} (as dsh checks it).
    if schema is not None:
        try:
            check_schema(schema, owner="config schema")
        except DshError as error:
            return [
                failure(
                    target,
                    "config-schema",
                    error.message,
                    "declare a valid Draft 2020-12 schema with @plugin(config_schema={...})",
                )
            ]
        if schema.get("type") != "object":
            return [
                failure(
                    target,
                    "config-schema",
                    'the config schema\'s root must have "type": "object"',
                    "a plugin's config is a TOML table: describe it as an object schema",
                )
            ]
    try:
        check_config(target.name, factory, target.config)
    except DshError as error:
        undeclared = (
            ""
            if schema is not None
            else (
                "the plugin declares no config schema, so it takes only {} "
                "(or declare one with @plugin(config_schema={...})); "
            )
        )
        return [
            failure(
                target,
                "config-schema",
                error.message,
                f"{undeclared}pass a matching config (subclass: override the plugin_config fixture; command "
                f"line: --dsh-conformance-config '{target.name}=JSON')",
            )
        ]
    return []


# -- definitions -----------------------------------------------------------------------------------------------


def _recorded(target: Target, check: str) -> list[ToolDefinition]:
    async def scenario() -> list[ToolDefinition]:
        loaded = await _load(target, check, record_only=True)
        await loaded.dispose()
        return loaded.definitions

    with _ending_processes():
        result: list[ToolDefinition] = _run(scenario)
    return result


@_guarded
def check_tool_schemas(target: Target) -> list[str]:
    """Every tool's parameter and output schema is valid Draft 2020-12; parameters are an object schema; the
    description is not blank."""
    failures = []
    for definition in _recorded(target, "tool-schemas"):
        for label, schema in (("parameters", definition.parameters), ("output schema", definition.output.schema)):
            try:
                check_schema(thaw(schema), owner=label)
            except DshError as error:
                failures.append(
                    failure(
                        target,
                        "tool-schemas",
                        error.message,
                        "fix the schema given to define_tool (JSON Schema Draft 2020-12)",
                        definition.name,
                    )
                )
        if isinstance(definition.parameters, dict) and definition.parameters.get("type") != "object":
            failures.append(
                failure(
                    target,
                    "tool-schemas",
                    'parameters must have "type": "object" at the root',
                    "describe the arguments as one JSON object",
                    definition.name,
                )
            )
        # define_tool refuses it, but a definition built otherwise (attrs.evolve) reaches the registry.
        if not isinstance(definition.description, str) or not definition.description.strip():
            failures.append(
                failure(
                    target,
                    "tool-schemas",
                    "the description is blank, so the model is told nothing of what the tool does",
                    "describe what the tool does and when to use it (define_tool(description=...))",
                    definition.name,
                )
            )
    return failures


def _refused_and_gone_on(target: Target) -> list[tuple[ToolDefinition, str]]:
    """The registry's refusals of tools the plugin registered (:attr:`LoadedPlugin.refusals`), when it started all
    the same: it swallowed each and went on without the tool.

    A load of its own, each tool registered: :func:`_recorded` registers none, so the registry refuses nothing
    there (a duplicate of a tool the plugin put straight in the registry, which the names alone do not show,
    included). None when the plugin does not start so: it let a refusal out, as it should, or failed otherwise,
    which the entry-point check reports.
    """

    async def scenario() -> list[tuple[ToolDefinition, str]]:
        try:
            loaded = await load_plugin(target.name, target.config)
        except Exception:
            return []
        await loaded.dispose()
        return loaded.refusals

    with _ending_processes():
        result: list[tuple[ToolDefinition, str]] = _run(scenario)
    return result


@_guarded
def check_tool_names(target: Target) -> list[str]:
    """Tool names are unique within the plugin, valid, and never the reserved ``run_code``; and the plugin never
    goes on after the registry refuses a tool it registers, starting without the tool."""
    failures = []
    seen: set[str] = set()
    for definition in _recorded(target, "tool-names"):
        name = definition.name
        if name == TRANSPORT_NAME:
            failures.append(
                failure(
                    target,
                    "tool-names",
                    f'"{TRANSPORT_NAME}" is reserved for the Code Mode transport',
                    "rename the tool",
                    name,
                )
            )
        elif not isinstance(name, str) or not TOOL_NAME_PATTERN.fullmatch(name):
            failures.append(
                failure(
                    target,
                    "tool-names",
                    f"invalid tool name {name!r}",
                    "use 1-64 characters from [A-Za-z0-9_-]",
                    str(name),
                )
            )
        if name in seen:
            failures.append(
                failure(
                    target, "tool-names", "the plugin registers this name twice", "give every tool a unique name", name
                )
            )
        seen.add(name)
    for definition, refusal in _refused_and_gone_on(target):
        failures.append(
            failure(
                target,
                "tool-names",
                f"the registry refused to register the tool ({refusal}), and the plugin swallowed the error and "
                "went on: it started without the tool, and nothing said so",
                "let the error propagate out of dsh_register_tools, so the plugin fails to start naming the tool; "
                "and fix what the registry's message names (register a valid name no other tool has, built with "
                "define_tool)",
                str(definition.name),
            )
        )
    return failures


@_guarded
def check_examples(target: Target) -> list[str]:
    """Examples exist, match the parameters, and round-trip through freeze and the cattrs converter."""
    failures = []
    for definition in _recorded(target, "examples"):
        name = definition.name
        if not definition.examples:
            if target.require_examples:
                failures.append(
                    failure(
                        target,
                        "examples",
                        "the tool declares no examples, so the kit cannot call it",
                        "pass examples=[{...}] to define_tool (argument objects that succeed in a fresh workspace)",
                        name,
                    )
                )
            continue
        if not _schemas_valid(definition):
            continue
        validator = compile_validator(thaw(definition.parameters))
        for index, example in enumerate(definition.examples):
            plain = thaw(example)
            found = violations(validator, plain)
            if found:
                failures.append(
                    failure(
                        target,
                        "examples",
                        f"examples[{index}] does not match the parameters: {format_violations(found)}",
                        "fix the example or the schema",
                        name,
                    )
                )
            loss = find_loss(plain)
            if loss is not None:
                failures.append(
                    failure(
                        target,
                        "examples",
                        f"examples[{index}] is not lossless JSON: {loss}",
                        "use only JSON types (dict, list, str, int, finite float, bool, None)",
                        name,
                    )
                )
                continue
            back = json.loads(json.dumps(converter.unstructure(plain)))
            back = converter.structure(back, dict[str, Any])
            if not same(back, plain) or not same(thaw(freeze(plain)), plain):
                failures.append(
                    failure(
                        target,
                        "examples",
                        f"examples[{index}] does not round-trip: {_brief(plain)} came back as {_brief(back)}",
                        "use only JSON types",
                        name,
                    )
                )
    return failures


@_guarded
def check_concurrency_safe(target: Target) -> list[str]:
    """``is_concurrency_safe`` is declared, returns a ``bool`` and gives the same answer every time."""
    failures = []
    for definition in _recorded(target, "concurrency-safe"):
        name = definition.name
        classify = definition.is_concurrency_safe
        if classify is None:
            failures.append(
                failure(
                    target,
                    "concurrency-safe",
                    "is_concurrency_safe is not declared",
                    "pass is_concurrency_safe=True (read-only, no shared state) or False "
                    "(always acceptable) to define_tool",
                    name,
                )
            )
            continue
        probes = definition.examples
        if (
            not probes
            and _schemas_valid(definition)
            and not violations(compile_validator(thaw(definition.parameters)), {})
        ):
            probes = (freeze({}),)  # no examples: probe with {} only where {} is a valid argument object
        for index, example in enumerate(probes):
            answers: list[object] = []
            try:
                for copy in (example, example, freeze(thaw(example))):
                    answers.append(classify(copy))
            except (Exception, SystemExit) as error:  # sys.exit() too: a plugin's bug, reported as one
                failures.append(
                    failure(
                        target,
                        "concurrency-safe",
                        f"is_concurrency_safe raised on examples[{index}]: {type(error).__name__}: {error}",
                        "make it a pure function of the arguments that never raises",
                        name,
                    )
                )
                continue
            wrong = [a for a in answers if type(a) is not bool]
            if wrong:
                failures.append(
                    failure(
                        target,
                        "concurrency-safe",
                        f"is_concurrency_safe returned {wrong[0]!r} "
                        f"({type(wrong[0]).__name__}) for examples[{index}], not a bool",
                        "return exactly True or False",
                        name,
                    )
                )
            elif len(set(answers)) > 1:
                failures.append(
                    failure(
                        target,
                        "concurrency-safe",
                        f"is_concurrency_safe is not pure: it answered {answers} for the same examples[{index}]",
                        "decide from the arguments only (no counters, clocks or state)",
                        name,
                    )
                )
    return failures


# -- calls --------------------------------------------------------------------------------------------------------


def _result_problem(definition: ToolDefinition, result: ToolResult) -> str | None:
    if result.is_error:
        return f"it returned error {result.code}: {result.error.message if result.error else ''}"
    value = thaw(result.value)
    loss = find_loss(value)
    if loss is not None:
        return f"its value is not lossless JSON: {loss}"
    if not same(json.loads(json.dumps(value)), value):
        return "its value does not survive a JSON round trip"
    found = violations(compile_validator(thaw(definition.output.schema)), value)
    if found:
        return f"its value does not match the output schema: {format_violations(found)}"
    try:
        json.dumps(converter.unstructure(list(result.content)))
    except Exception as error:
        return f"its content does not serialize: {error}"
    return None


async def _watching_stdout(call: Awaitable[_T]) -> tuple[_T, bytes]:
    """What ``call`` gives, and what reached file descriptor 1 while it ran.

    sys.stdout goes to stderr meanwhile, as dsh sends it while it runs tools (so print() is no failure);
    what still reaches the descriptor (a child process that inherits it, os.write(1, ...)) would land in
    what dsh prints there, such as the JSON of ``dsh tools call --json``.
    """
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 1)
        try:
            with contextlib.redirect_stdout(sys.stderr):
                result = await call
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        sink.seek(0)
        return result, sink.read()


@_guarded
def check_example_calls(target: Target) -> list[str]:
    """Each tool, called with each example (registration order), succeeds with lossless JSON matching its schema
    and writes nothing to stdout (file descriptor 1)."""

    async def probe(loaded: LoadedPlugin, found: list[str]) -> None:
        for definition in filter(_schemas_valid, loaded.definitions):
            for index, example in enumerate(definition.examples):
                result, written = await _watching_stdout(
                    _bounded_call(
                        target,
                        "example-calls",
                        loaded,
                        definition.name,
                        example,
                        f"examples[{index}] {_brief(example)}",
                        found,
                        call_id=f"example-{index}",
                    )
                )
                if written:
                    found.append(
                        failure(
                            target,
                            "example-calls",
                            f"examples[{index}] {_brief(example)}: the call wrote to stdout "
                            f"(file descriptor 1): {written[:300]!r}",
                            "stdout is what dsh prints its results on: run child processes with "
                            "stdout=subprocess.PIPE (or DEVNULL) and never os.write(1, ...); log to stderr",
                            definition.name,
                        )
                    )
                problem = None if result is None else _result_problem(definition, result)
                if problem is not None:
                    found.append(
                        failure(
                            target,
                            "example-calls",
                            f"examples[{index}] {_brief(example)}: {problem}",
                            "examples must succeed when called in registration order in a fresh config (the "
                            "kit gives workspace-like plugins an empty temporary root) and return values "
                            "matching output_schema",
                            definition.name,
                        )
                    )

    # Each example's call may leave work running that the dispose check, calling examples[0] only, never starts.
    return _with_plugin(target, "example-calls", probe, quiesce_when="after the example calls and dispose")


async def _pre_aborted_call(
    target: Target, loaded: LoadedPlugin, name: str, arguments: JSON, found: list[str]
) -> ToolResult | None:
    """One call as :func:`_call`, its signal aborted before it is made, given ``Target.call_timeout_s`` (else
    :data:`CALL_TIMEOUT_S`) to return.

    Such a call runs no body and, of the plugin's hooks, only its result observers (dsh_tool_result),
    but those it does: awaited with no bound, an observer that never returns hung the check, and the
    plugin author's test run. Its tool's ``finalize_content`` runs too: one that blocks the event loop past
    the limit is reported, whether the call has returned once the loop is free (:func:`_blocked_past`) or a result
    observer after it still runs (given ``STUCK_GRACE_S`` more first, and named too if it still holds the call:
    :func:`_held_after`). So is a body the runtime ran anyway (the core never does) that blocked the loop past the
    limit, as in :func:`_bounded_call`: the same grace, once (:func:`_grace_if_blocked`). Its signal already
    aborted, there is nothing left to abort at the limit: the call is cancelled and given ``STUCK_GRACE_S`` to end
    (it never waits in an approval ask), then reported in ``found``, blamed on what held it, and ``None`` returned.
    """
    limit = _call_limit(target)
    call_id = "conformance"
    what = "the call aborted before dispatch"
    marks = _CallMarks.before(loaded, name, call_id, dispatched=False)
    grace = _stuck_grace(loaded, None)
    task = asyncio.ensure_future(
        _call(
            loaded, name, arguments, AbortSignal.aborted_with("conformance: aborted before the call"), call_id=call_id
        )
    )
    await _wait(task, limit)
    if await _grace_if_blocked(task, marks, limit, grace):
        _blocked_past(target, "pre-abort", name, what, limit, marks, found)
        result: ToolResult = task.result()
        return result
    # A body run for this call (the check reports that too) means the runtime dispatched it after all, so whatever
    # follows a body may hold it; else only the result observers can, and finalize_content blocking the loop.
    hold = marks.hold(False, limit)
    late = _held_after(hold)
    problem = f"{what} did not return within {limit:g} s: {hold.held}"
    fix = hold.fix
    if late is not None:
        problem += f"; {late.clause}, still running {grace:g} s later"
        fix += f"; and {late.fix}"
    fix += _LARGER_LIMIT
    if await _cancel(task, grace):
        after = "it was cancelled then"
    else:
        after = _IGNORED_CANCEL_PROBLEM.format(grace=grace)
        fix = f"{_IGNORED_CANCEL_FIX}; and {fix}"
    found.append(failure(target, "pre-abort", f"{problem} ({after})", fix, name))
    return None


@_guarded
def check_pre_abort(target: Target) -> list[str]:
    """A call whose signal is already aborted gives ``ABORTED_BEFORE_DISPATCH``, never runs the body, and returns
    within ``Target.call_timeout_s`` (else :data:`CALL_TIMEOUT_S`)."""

    async def probe(loaded: LoadedPlugin, found: list[str]) -> None:
        for definition, spy in _spied(loaded):
            for example in definition.examples[:1]:
                result = await _pre_aborted_call(target, loaded, definition.name, example, found)
                if spy.runs_of("conformance"):  # this call's (the plugin may run the tool for calls of its own)
                    found.append(
                        failure(
                            target,
                            "pre-abort",
                            "the body ran although the call was aborted before dispatch",
                            _NO_BODY_FROM_HOOKS_FIX,
                            definition.name,
                        )
                    )
                if result is not None and result.code != ErrorCode.ABORTED_BEFORE_DISPATCH:
                    found.append(
                        failure(
                            target,
                            "pre-abort",
                            f"expected ABORTED_BEFORE_DISPATCH, got {result.code or 'a success'}",
                            "do not replace results of aborted calls in around-dispatch or post-execute hooks",
                            definition.name,
                        )
                    )

    return _with_plugin(target, "pre-abort", probe)


@_guarded
def check_abort(target: Target) -> list[str]:
    """Aborting a running call makes the body return within ``abort_bound_s``, leaving nothing running."""
    bound = target.abort_bound_s

    async def probe(loaded: LoadedPlugin, found: list[str]) -> None:
        loop = asyncio.get_running_loop()
        call_id = "conformance"  # one call of each tool
        for definition, spy in _spied(loaded):
            if not definition.examples:
                continue
            controller = AbortController()
            aborted_at: list[float] = []

            def abort(controller: AbortController = controller, stamps: list[float] = aborted_at) -> None:
                stamps.append(time.monotonic())
                controller.abort("conformance: aborted mid-call")

            # Abort at the body's first suspension point: it is running, and must notice. Only this call's
            # body: the plugin may run the tool for calls of its own meanwhile.
            def on_enter(context: ToolContext, abort: Callable[[], None] = abort) -> None:
                if context.call_id == call_id:
                    loop.call_soon(abort)

            spy.on_enter = on_enter
            watch = CallWatch(call_id)
            marks = _CallMarks(spy, call_id)  # from the spy's first run: the check makes one call of each tool
            task = asyncio.ensure_future(
                _call(loaded, definition.name, definition.examples[0], controller.signal, call_id=call_id, watch=watch)
            )
            waited = bound + STUCK_GRACE_S
            await _wait(task, waited)
            spy.on_enter = None
            # The abort was delivered already: a call still running once a stage that blocked the loop past the bound
            # freed it gets the grace before it is judged. One that returns then is judged as one that returned
            # (below); one that does not, as a stuck call, its hold taken once the grace is over (its body may have
            # returned meanwhile into a stage that holds it).
            if not await _grace_if_blocked(task, marks, bound, _stuck_grace(loaded, watch)):
                # A body or finalize_content that blocked the loop past the bound is named, as when its call
                # returns: blocking that long fails this check on its own (the abort cannot act meanwhile), whether
                # or not the call then ends.
                hold = marks.hold(watch.asking, bound)
                late = _held_after(hold)
                fix = hold.fix
                if hold.body_ran:
                    problem = f"the call, aborted as its body began, did not return within {waited:g} s: {hold.held}"
                else:
                    # The abort comes as the body is entered: a call held before its body was never aborted.
                    problem = (
                        f"the call did not return within {waited:g} s: {hold.held}; its abort, due as the body "
                        "begins, could not be checked"
                    )
                if late is not None:
                    problem += f"; {late.clause}, still running {_stuck_grace(loaded, watch):g} s later"
                    fix += f"; and {late.fix}"
                if await _cancel(task, grace := _stuck_grace(loaded, watch)):
                    problem += " (it was cancelled then)"
                else:
                    problem += f" ({_IGNORED_CANCEL_PROBLEM.format(grace=grace)})"
                    fix = f"{_IGNORED_CANCEL_FIX}; and {fix}"
                found.append(failure(target, "abort", problem, fix, definition.name))
                continue
            if not spy.runs_of(call_id):
                result = task.result()
                found.append(
                    failure(
                        target,
                        "abort",
                        f"the call never reached the body ({result.code}: "
                        f"{result.error.message if result.error else ''})",
                        "make the first example callable",
                        definition.name,
                    )
                )
                continue
            # The abort is requested when the body is entered, and delivered at its first suspension: a
            # body that blocks the event loop (time.sleep, subprocess.run in async def) delays the
            # delivery itself, possibly past its own return, so the delay is a failure of its own. Only the
            # body's share of it, its first step as the spy timed it: a body that returns without awaiting is
            # followed at once, in the same step, by what runs after it (a finalize_content that blocks the
            # loop delays the delivery as much). The call-limit checks take the same measure (_blocked_past).
            returned = time.monotonic()
            runs = spy.runs_of(call_id)
            body_end = runs[-1].ended_at if runs[-1].ended_at is not None else returned
            blocked = runs[0].first_step_s or 0.0
            # Every later step runs once the abort was delivered (it was queued before the first step, so the loop
            # ran it at that suspension): a body that blocks in one past the bound returns late, but watching
            # ctx.signal, the fix for a late return, cannot help it, as nothing runs while it blocks (no listener,
            # no cancellation, no timer). Its blocking is the failure to name, with its own fix. The first step
            # is part of the longest, so past the bound the longest is a later one only when the first is not.
            blocked_after = max(run.longest_step_s for run in runs)
            finalize_s = marks.finalize_s()
            # A finalize_content that blocked the loop past the bound as well, once the body had ended, made the call
            # late on its own, with its own fix: named after the body's blocking.
            then, then_fix = (
                (f"; then {_HELD_BY_FINALIZE.format(seconds=finalize_s)}", f"; and {_FINALIZE_FIX}")
                if finalize_s > bound
                else ("", "")
            )
            if blocked > bound:
                found.append(
                    failure(
                        target,
                        "abort",
                        f"the body kept the event loop busy for {blocked:.2f} s "
                        "without awaiting, so the abort could not even be delivered "
                        f"(bound: {bound:g} s){then}",
                        _BLOCKING_BODY_FIX + then_fix,
                        definition.name,
                    )
                )
            elif blocked_after > bound:
                found.append(
                    failure(
                        target,
                        "abort",
                        f"the body kept the event loop busy for {blocked_after:.2f} s without awaiting after the "
                        f"abort was delivered, so nothing could stop it meanwhile (bound: {bound:g} s){then}",
                        _BLOCKING_BODY_FIX + then_fix,
                        definition.name,
                    )
                )
            elif aborted_at:
                # The body timed to its own end (the spy's), the call to its return: what runs after the body
                # (post-execute hooks, result observers, a middleware once proceed returned, finalize_content)
                # is not the body's.
                elapsed = body_end - aborted_at[0]
                if elapsed > bound:
                    found.append(
                        failure(
                            target,
                            "abort",
                            f"the body returned {elapsed:.2f} s after the abort (bound: {bound:g} s)",
                            "watch ctx.signal (ctx.signal.add_listener or await "
                            "ctx.signal.wait()), stop the work (kill processes, cancel "
                            "requests) and return or raise promptly",
                            definition.name,
                        )
                    )
                elif (elapsed := returned - min(body_end, aborted_at[0])) > bound:
                    since = "its body" if body_end < aborted_at[0] else "the abort"
                    # The body blocked the loop past the bound in no step (judged above): only finalize_content may
                    # be named for blocking it.
                    hold = marks.hold(False, bound)
                    found.append(
                        failure(
                            target,
                            "abort",
                            f"the call returned {elapsed:.2f} s after {since} (bound: {bound:g} s): {hold.held}",
                            hold.fix,
                            definition.name,
                        )
                    )

    # A body that returns promptly on abort but leaves its work running (a process it never kills,
    # a task it never cancels) is caught here: the dispose check only makes calls that run to completion.
    return _with_plugin(target, "abort", probe, quiesce_when="after the aborted call and dispose")


def _perturbations(definition: ToolDefinition) -> Iterator[JSON]:
    """Each example, then variants with one string emptied, one number zeroed or negated, one bool flipped."""
    if not _schemas_valid(definition):
        return
    validator = compile_validator(thaw(definition.parameters))
    seen: list[Any] = []
    for example in definition.examples:
        plain = thaw(example)
        candidates = [plain]
        if isinstance(plain, dict):
            for key, value in plain.items():
                replacements: list[Any] = []
                if isinstance(value, str):
                    replacements = ["", "\0"]
                elif isinstance(value, bool):
                    replacements = [not value]
                elif isinstance(value, int | float):
                    replacements = [0, -1]
                for replacement in replacements:
                    candidates.append({**plain, key: replacement})
        for candidate in candidates:
            if any(same(candidate, s) for s in seen) or violations(validator, candidate):
                continue
            seen.append(candidate)
            yield candidate


@_guarded
def check_typed_errors(target: Target) -> list[str]:
    """Bodies fail only with typed errors (``ToolError``/``DshError``) and return only output the runtime accepts,
    for the examples and edge variants."""

    async def probe(loaded: LoadedPlugin, found: list[str]) -> None:
        for definition, spy in _spied(loaded):
            for index, arguments in enumerate(_perturbations(definition)):
                call_id = f"typed-errors-{index}"
                result = await _bounded_call(
                    target,
                    "typed-errors",
                    loaded,
                    definition.name,
                    arguments,
                    f"called with {_brief(arguments)}",
                    found,
                    call_id=call_id,
                )
                if result is None:
                    continue  # reported; what an aborted or cancelled body let out is no failure of its own
                # Judged on this call alone, by its call id: a middleware may answer a call without running the
                # body, and the body of another call (one abandoned above that goes on) may raise meanwhile.
                runs = spy.runs_of(call_id)
                errors = [run.error for run in runs if run.error is not None]
                if result.code == ErrorCode.INVALID_TOOL_OUTPUT and runs and not errors:
                    # The body returned normally, but what it returned is refused (the example-calls
                    # check sees only the examples: an output_schema broken on other inputs shows here).
                    found.append(
                        failure(
                            target,
                            "typed-errors",
                            f"called with {_brief(arguments)}, the tool returned output the "
                            f"runtime refused (INVALID_TOOL_OUTPUT): {result.error.message if result.error else ''}",
                            "return values matching output_schema for every argument object the parameters accept, "
                            'or raise dsh_core.ToolError("...") for arguments the tool cannot serve',
                            definition.name,
                        )
                    )
                for error in errors:
                    if isinstance(error, AbortedError | asyncio.CancelledError):
                        # These calls are never cancelled nor aborted: the body let out what something it
                        # awaited raised, and the call fails as TOOL_FAILED or ABORTED, not with its message.
                        found.append(
                            failure(
                                target,
                                "typed-errors",
                                f"called with {_brief(arguments)}, the body let out "
                                f"{type(error).__name__} although its call was neither cancelled nor aborted "
                                "(something it awaited was cancelled or aborted elsewhere)",
                                'catch it where you await that work and raise dsh_core.ToolError("what went wrong"); '
                                "let it out only when ctx.signal is aborted or your own task is being cancelled",
                                definition.name,
                            )
                        )
                    elif not isinstance(error, Exception):
                        found.append(
                            failure(
                                target,
                                "typed-errors",
                                f"called with {_brief(arguments)}, the body raised "
                                f"{type(error).__name__}" + (f" ({error})" if str(error) else "") + ", which ends "
                                "the process dsh runs in (the agent, a Code Mode run, every other tool's call)",
                                "never call sys.exit() nor raise KeyboardInterrupt in a tool body: raise "
                                'dsh_core.ToolError("what went wrong") so only this call fails',
                                definition.name,
                            )
                        )
                    elif not isinstance(error, DshError):
                        found.append(
                            failure(
                                target,
                                "typed-errors",
                                f"called with {_brief(arguments)}, the body raised the "
                                f"untyped {type(error).__name__}: {error}",
                                'catch it and raise dsh_core.ToolError("what went wrong and what to do") so the '
                                "model reads a clear message",
                                definition.name,
                            )
                        )

    # An edge variant may fail half-way and leave what it started running (a process never killed on the error path).
    return _with_plugin(target, "typed-errors", probe, quiesce_when="after the calls and dispose")


# -- lifecycle --------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _adopting() -> Iterator[None]:
    """This process as a child subreaper meanwhile (Linux; elsewhere, and where refused, nothing changes).

    A process whose parent ends (``sh -c "sleep 9 &"``, a double fork, a daemon that left the session)
    is reparented to the nearest subreaper, else to init, where the kit no longer sees it as its
    descendant. As a subreaper the kit adopts exactly its own descendants' orphans, no one else's, and
    must reap them (:func:`_end_processes` does). A process that already was a subreaper is left as it was.
    """
    enabled = not is_child_subreaper() and set_child_subreaper(True)
    try:
        yield
    finally:
        if enabled:
            set_child_subreaper(False)


def _claim(owners: dict[int, str], tool: str) -> None:
    """Blame the descendants no call was blamed for yet on the nearest blamed ancestor's tool, else on ``tool``.

    Called as each call ends: a process a shell of an earlier call started since is that call's, not this one's.
    """
    tree = _descendants()
    for pid in sorted(tree.keys() - owners.keys()):
        ancestor = tree.get(pid)
        while ancestor is not None and ancestor not in owners:
            ancestor = tree.get(ancestor)
        owners[pid] = owners[ancestor] if ancestor is not None else tool


def _descendants() -> dict[int, int]:
    """Every process descended from this one, at any depth, and its parent, through ``/proc`` (Linux; empty
    elsewhere)."""
    found: dict[int, int] = {}
    pending = [os.getpid()]
    while pending:
        pid = pending.pop()
        for child in child_pids(pid):  # none if it ended meanwhile, or not Linux: processes are not checked
            if child not in found:
                found[child] = pid
                pending.append(child)
    return found


def _ended(pid: int) -> bool:
    """Whether ``pid`` is gone or a zombie: it exited, and only its parent's wait is missing."""
    stat = proc_stat(pid)
    return stat is None or stat.state in "ZX"


def _end_processes(before: set[int]) -> None:
    """Kill every descendant not in ``before``, and reap those that are (or, killed, become) this process's children.

    Bounded by ``QUIESCENCE_GRACE_S``: SIGKILL ends a process at once unless it is stuck in the kernel.
    """
    me = os.getpid()
    deadline = time.monotonic() + QUIESCENCE_GRACE_S
    while True:
        left = False
        for pid in sorted(_descendants().keys() - before):
            stat = proc_stat(pid)
            if stat is None:
                continue
            if stat.state not in "ZX":
                left = True
                _kill(pid)
            elif stat.parent == me:
                # Ours to reap: a child never waited for, or an orphan adopted as subreaper. A zombie
                # keeps its pid, so this waits for that very process and no other.
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)
                left = left or proc_stat(pid) is not None
            else:
                left = True  # its parent (killed too) has not reaped it yet, or it is about to be adopted
        if not left or time.monotonic() > deadline:
            return
        time.sleep(0.01)


def _kill(pid: int) -> None:
    """SIGKILL ``pid`` if it is still this process's descendant (:func:`~dsh_core.processes.signal_if`: a pid
    reused meanwhile by another process is never signalled where there are pidfds)."""
    signal_if(pid, signal.SIGKILL, lambda found: found in _descendants())


def _describe_pid(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            command = handle.read().replace(b"\0", b" ").decode("utf-8", errors="replace").strip()
    except OSError:
        command = ""
    return f"pid {pid} ({command or 'no command line'})"  # it may have ended just now


@_guarded
def check_dispose(target: Target) -> list[str]:
    """Disposing the plugin unregisters every tool and hook and leaves no task, thread or process running."""

    async def probe(loaded: LoadedPlugin, found: list[str]) -> None:
        for definition in loaded.definitions:
            for example in definition.examples[:1]:
                await _bounded_call(
                    target,
                    "dispose",
                    loaded,
                    definition.name,
                    example,
                    f"examples[0] {_brief(example)}",
                    found,
                    call_id="dispose",
                )

    def leftovers(loaded: LoadedPlugin) -> list[str]:
        return [
            failure(
                target,
                "dispose",
                f"after dispose, {what} is still registered",
                "register through the plugin's scope (the register callables, scope=scope for registry "
                "guards, restrictions and modes, scope.on_dispose(undo) for on_change) so dispose can "
                "undo it",
            )
            for what in loaded.leftovers()
        ]

    # Every check loads the plugin: this one alone reports what it left running at load.
    return _with_plugin(target, "dispose", probe, disposed=leftovers, quiesce_when="after dispose", load_leftovers=True)


async def _stray_tasks(
    target: Target,
    check: str,
    when: str,
    tasks_before: set[asyncio.Task[Any]],
    at_load: _AtLoad,
    load_leftovers: bool,
    asks: Mapping[asyncio.Task[Any], tuple[str, str]],
) -> list[str]:
    """Tasks started since ``tasks_before`` and still running ``QUIESCENCE_GRACE_S`` on; those already running at
    load only with ``load_leftovers`` (see :func:`_with_plugin`).

    One of ``asks`` (the tasks the runtime asked approval in, with call id and tool) is the plugin's channel, which
    ignored its ask's withdrawal (the runtime let it go after its grace): dsh started that task, so it is
    named as the ask it is, with the channel's fix, not as background work the plugin should have spawned.
    """
    before = tasks_before if load_leftovers else tasks_before | at_load.tasks
    deadline = time.monotonic() + QUIESCENCE_GRACE_S
    pending: set[asyncio.Task[Any]] = set()
    while time.monotonic() < deadline:
        # A call that ignored its cancellation is already reported, as such, by the check that cancelled it.
        pending = {t for t in asyncio.all_tasks() - before if not t.done() and t not in _IGNORED_CANCEL}
        current = asyncio.current_task()
        if current is not None:
            pending.discard(current)
        if not pending:
            break
        await asyncio.sleep(0.02)
    return [
        failure(
            target,
            check,
            f"the approval ask of call {asks[task][0]!r} (its channel, dsh_approve) ignored "
            f"its withdrawal and is still running {when}",
            "end dsh_approve's ask as soon as it is cancelled "
            "(never swallow asyncio.CancelledError there): dsh waits for it only its approval grace, then "
            "leaves it running with no one to answer",
            asks[task][1],
        )
        if task in asks
        else failure(
            target,
            check,
            f"task {task.get_name()} ({task.get_coro()!r}) "
            f"{_AT_LOAD if task in at_load.tasks else ''}is still running {when}",
            "start background work with scope.spawn(...) so dispose cancels and awaits it",
        )
        for task in pending
    ]


def _strays(
    target: Target,
    check: str,
    when: str,
    threads_before: set[threading.Thread],
    children_before: set[int],
    executor: _DetachedExecutor,
    owners: dict[int, str],
    at_load: _AtLoad,
    load_leftovers: bool,
) -> list[str]:
    """Threads (the executor's jobs apart) and descendant processes started since ``*_before``, and the executor's
    jobs, still running ``QUIESCENCE_GRACE_S`` on; the processes are then killed and reaped. Those already running
    at load are reported only with ``load_leftovers`` (see :func:`_with_plugin`), and killed all the same.

    A process that exited is no leftover, though it may wait out the grace for its parent to reap
    it; one still a zombie then was left to the kit (an orphan it adopted), which reaps it.
    """
    ignored = set() if load_leftovers else at_load.threads
    deadline = time.monotonic() + QUIESCENCE_GRACE_S
    threads: set[threading.Thread] = set()
    processes: set[int] = set()
    jobs: list[_Job] = []
    while time.monotonic() < deadline:
        jobs = [job for job in executor.running() if job.thread not in ignored]
        threads = {t for t in set(threading.enumerate()) - threads_before - ignored if t.is_alive()} - {
            job.thread for job in executor.jobs
        }
        processes = {
            pid for pid in _descendants().keys() - children_before if load_leftovers or owners.get(pid) != _LOAD_OWNER
        }
        if not threads and not processes and not jobs:
            break
        time.sleep(0.02)
    running = sorted(pid for pid in processes if not _ended(pid))
    described = {pid: _describe_pid(pid) for pid in running}  # before the kill: a killed process has no command
    _end_processes(children_before)  # the load's processes too: no check leaves one running
    found = []
    for job in jobs:
        loaded = job.thread in at_load.threads
        found.append(
            failure(
                target,
                check,
                f"thread {job.thread.name!r} running {job.what} (asyncio.to_thread or "
                f"loop.run_in_executor) {_AT_LOAD if loaded else ''}is still running {when}",
                "a thread cannot be cancelled (cancelling the await leaves it running): make the "
                "blocking work end in a disposer (scope.on_dispose) and wait for it there"
                if loaded
                else "a thread cannot be cancelled (cancelling the await leaves it running): make the "
                "blocking work end when ctx.signal aborts (a threading.Event set from "
                "ctx.signal.add_listener that it checks, a timeout, or closing what it waits on) "
                "and wait for it before returning",
                job.tool,
            )
        )
    for thread in sorted(threads, key=lambda t: t.name):
        found.append(
            failure(
                target,
                check,
                f"thread {thread.name!r} {_AT_LOAD if thread in at_load.threads else ''}is still running {when}",
                "stop and join threads in a disposer (scope.on_dispose) or use asyncio.to_thread",
            )
        )
    for pid in running:
        loaded = owners.get(pid) == _LOAD_OWNER
        found.append(
            failure(
                target,
                check,
                f"child process {described[pid]} {_AT_LOAD if loaded else ''}is still running {when}",
                "kill and reap every process the plugin starts, on completion, on abort and in a disposer",
                None if loaded else owners.get(pid) or None,
            )
        )
    return found


def _hook_specs() -> dict[str, bool]:
    manager = Hooks().plugin_manager
    specs: dict[str, bool] = {}
    for name in dir(manager.hook):
        if name.startswith("dsh_"):
            caller = getattr(manager.hook, name)
            specs[name] = bool(caller.spec is not None and caller.spec.opts.get("firstresult"))
    return specs


@_guarded
def check_hookimpls(target: Target) -> list[str]:
    """Hook implementations name known hooks (or are optionalhook), have no defaults, and are no wrappers or async
    firstresult."""
    from dsh_hookspecs import PROJECT

    try:
        _, factory = load_factory(target.name)
    except DshError as error:
        return [
            failure(target, "hookimpls", f"the entry point did not load: {error.message}", "fix the entry point first")
        ]
    try:
        check_config(target.name, factory, target.config)
    except DshError as error:
        return [
            failure(
                target,
                "hookimpls",
                error.message,
                f"pass a valid config: --dsh-conformance-config '{target.name}=JSON', or plugin_config "
                "in your subclass",
            )
        ]
    specs = _hook_specs()

    async def make() -> object:
        # The scope load_plugin gives (a plugin may look up "tools" or "runtime" in its factory).
        root, _registry, _runtime = make_root(Hooks())
        try:
            return factory(root.child(f"plugin:{target.name}"), freeze(dict(target.config)))
        finally:
            await root.dispose()

    try:
        with _ending_processes():  # what the factory started: the plugin is never disposed here
            instance = _run(make)
    except (Exception, SystemExit) as error:  # sys.exit() too: a plugin's bug, reported as one
        return [
            failure(
                target,
                "hookimpls",
                f"the factory raised {type(error).__name__}: {error}",
                "make the factory succeed with the given config",
            )
        ]
    if instance is None:
        return []
    found: list[str] = []
    marker = f"{PROJECT}_impl"
    for attribute in sorted(dir(instance)):
        try:
            member = getattr(instance, attribute)
        except Exception:
            continue
        options = getattr(member, marker, None)
        if not isinstance(options, dict):
            if attribute.startswith("dsh_") and callable(member):
                # pluggy only sees marked methods: this one is silently never called.
                known = f"hook {attribute}" if attribute in specs else "no known hook"
                found.append(
                    failure(
                        target,
                        "hookimpls",
                        f"{attribute} ({known}) is not marked @hookimpl, so pluggy never calls it",
                        "decorate it with @dsh_core.hookimpl"
                        + ("" if attribute in specs else f" and name a known hook: {', '.join(sorted(specs))}"),
                    )
                )
            continue
        hook = options.get("specname") or attribute
        where = f"{attribute} (hook {hook})"
        if hook not in specs:
            if options.get("optionalhook"):
                continue  # as pluggy (and Hooks.register) accept it: never called, so nothing to check
            found.append(
                failure(
                    target,
                    "hookimpls",
                    f"{where} implements no known hook",
                    f"use one of: {', '.join(sorted(specs))} (or mark it "
                    "@hookimpl(optionalhook=True) if it is meant for a hook this dsh may not define)",
                )
            )
            continue
        if options.get("wrapper") or options.get("hookwrapper"):
            found.append(
                failure(
                    target,
                    "hookimpls",
                    f"{where} is a pluggy wrapper (wrapper=True/hookwrapper=True), "
                    "which dsh refuses: it calls hooks itself and awaits their results",
                    "return middleware from dsh_around_dispatch to wrap tool bodies",
                )
            )
        function = inspect.unwrap(member)
        defaulted = [
            p.name for p in inspect.signature(function).parameters.values() if p.default is not inspect.Parameter.empty
        ]
        if defaulted:
            found.append(
                failure(
                    target,
                    "hookimpls",
                    f"{where} declares defaults for {', '.join(defaulted)}; "
                    "pluggy versions disagree on whether such arguments are passed",
                    "remove the defaults (accept only the arguments you use, all required)",
                )
            )
        is_async = inspect.iscoroutinefunction(function) or inspect.isasyncgenfunction(function)
        if is_async and hook in SYNC_HOOKS:
            found.append(
                failure(
                    target,
                    "hookimpls",
                    f"{where} is async def, but dsh calls {hook} synchronously "
                    "and never awaits what it returns: the coroutine is discarded"
                    + (", so nothing is registered" if hook in REGISTRATION_HOOKS else ""),
                    "make it a plain def (start async work with scope.spawn(...))",
                )
            )
        elif is_async and specs[hook]:
            found.append(
                failure(
                    target,
                    "hookimpls",
                    f"{where} is async def on a first-result hook: its "
                    "coroutine is never None, so it always wins, even when it means to abstain",
                    "make it a plain function that returns None or an awaitable",
                )
            )
    return found


#: Every check, by id, in the order the suite runs them.
CHECKS: Final[dict[str, Callable[[Target], list[str]]]] = {
    "entry-point": check_entry_point,
    "stdout": check_stdout,
    "config-schema": check_config_schema,
    "tool-schemas": check_tool_schemas,
    "tool-names": check_tool_names,
    "examples": check_examples,
    "example-calls": check_example_calls,
    "pre-abort": check_pre_abort,
    "abort": check_abort,
    "concurrency-safe": check_concurrency_safe,
    "typed-errors": check_typed_errors,
    "dispose": check_dispose,
    "hookimpls": check_hookimpls,
}
