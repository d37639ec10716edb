"""The per-program scheduler of nested ``run_code`` calls.

Each ``run_code`` execution owns one :class:`ProgramScheduler` (the cap is
per program, not a process-wide semaphore). State: a FIFO ``pending`` queue of
submitted calls, the ``in_flight`` set of running bodies, a ``commits`` queue in
submission order and an ``exclusive`` flag. One driver task, alive from the first
call until the run is over, does on each pass:

1. **Commit first.** If the head of ``commits`` has settled, pop it and
   commit it (post-execute, finish, context deferral, turn control, then
   resolve the program's call and append the settle event). An exclusive entry
   clears the flag only *after* its commit: its barrier covers post-execute.
2. **Else consider the head of ``pending``.** If the run is over, abandon it
   (the program's call raises; no start event is logged). Otherwise reclassify
   it *now* (a tool replaced while queued is reclassified; anything unknown
   fails closed to exclusive). It starts when no exclusive call holds the
   barrier and either it is parallel and fewer than the cap are in flight, or
   it is exclusive and nothing is in flight. Starting logs the start event and
   runs ``prepare`` (pre-execute, approval, guards) on the lane; only a
   ``dispatch`` result runs the body: a parallel one as an in-flight task, an
   exclusive one on the lane itself (nothing may overlap it anyway).
3. **Else exit** when the run is over and nothing is pending, committing or in
   flight, **or sleep** until a body settles, a call is submitted or the run is
   aborted.

So only around-dispatch plus the body overlap; starts, policy, post-execute,
finalization, context deferral and settlement run on one ordered lane in
submission order, even when bodies finish out of order, and a slow policy on
one call delays the next start.

Per call, the program's binding gets a future (no task of its own: see
:data:`~dsh_core.coderuntime.seam.BindingFunction`) that the commit resolves
with the plain result value or fails with :class:`SubCallError`; only a
concurrency-safe body gets a task. The settle event is appended on the lane
right after the program's call is resolved, so events keep commit order and
a slow session store slows the lane instead of piling up writes.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable
from typing import Final

from dsh_core.abort import AbortSignal
from dsh_core.codemode.history import DispatchHistory
from dsh_core.errors import ErrorCode
from dsh_core.lossless import JSON, thaw
from dsh_core.model import ToolContext, ToolExecutionInput, ToolResult
from dsh_core.runtime import ABORTED_MESSAGE, Staged, ToolRuntime, error_result

__all__ = ["DEFAULT_MAX_PARALLEL_SUB_CALLS", "ProgramScheduler", "SubCall", "check_max_parallel", "SubCallError"]

log = logging.getLogger("dsh")

#: The default number of concurrency-safe nested calls one program may have in flight.
DEFAULT_MAX_PARALLEL_SUB_CALLS: Final = 10


def check_max_parallel(value: object) -> int:
    """Return ``value`` if it is a positive ``int`` (not a bool), else raise ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"max_parallel_sub_calls must be a positive integer, got {value!r}")
    return value


class SubCallError(Exception):
    """A nested call failed, was refused, or was dropped because its program's run is over.

    The message is exactly what the program's ``ToolCallError`` carries: the
    tool's error text, never internal detail.
    """


class SubCall:
    """One nested call between submission and commit."""

    __slots__ = ("exclusive", "failure", "future", "logged", "request", "settled", "staged")

    def __init__(self, request: ToolExecutionInput, logged: JSON) -> None:
        self.request = request
        self.logged = logged
        #: What the program's call resolves to: the plain result value, or :class:`SubCallError`.
        self.future: asyncio.Future[JSON] = asyncio.get_running_loop().create_future()
        self.staged: Staged | None = None
        self.exclusive = True
        self.settled = False
        #: A result for a call whose ``prepare`` itself raised (no staged execution exists).
        self.failure: ToolResult | None = None

    @property
    def sub_call_id(self) -> str:
        """``"<run_code call id>:code:<n>"``."""
        return self.request.call_id

    @property
    def name(self) -> str:
        """The tool name the program called."""
        return self.request.name


def _mark_retrieved(future: asyncio.Future[JSON]) -> None:
    # A program that stopped awaiting (it settled, or fired and forgot) never reads the
    # rejection; reading it here keeps asyncio from reporting it as never retrieved.
    if not future.cancelled():
        future.exception()


class ProgramScheduler:
    """Orders one program's nested calls; see the module docstring."""

    def __init__(
        self,
        runtime: ToolRuntime,
        *,
        signal: AbortSignal,
        history: DispatchHistory,
        context: ToolContext | None,
        max_parallel_sub_calls: int = DEFAULT_MAX_PARALLEL_SUB_CALLS,
        on_commit: Callable[[SubCall, ToolResult], None] | None = None,
    ) -> None:
        self._runtime = runtime
        self._signal = signal
        self._history = history
        self._context = context
        self._cap = check_max_parallel(max_parallel_sub_calls)
        self._on_commit = on_commit
        self._pending: collections.deque[SubCall] = collections.deque()
        self._commits: collections.deque[SubCall] = collections.deque()
        self._in_flight: set[asyncio.Task[None]] = set()
        self._exclusive = False
        self._closing = False
        self._wake = asyncio.Event()
        self._driver: asyncio.Task[None] | None = None
        #: The code runtime's run control (set by the transport from the first binding call).
        self.run_control: object | None = None
        self._unlisten = signal.add_listener(lambda _reason: self._wake.set())

    # -- submission -----------------------------------------------------------------------------------

    def submit(self, request: ToolExecutionInput, logged: JSON) -> asyncio.Future[JSON]:
        """Queue a nested call; the future settles at its commit, with what the program sees.

        That is the tool's plain (unfrozen) result value, or :class:`SubCallError`
        carrying only the tool's error text. Plain code, no await: the binding that
        calls it runs in the code runtime's event-loop callback.
        """
        call = SubCall(request, logged)
        self._pending.append(call)
        self._wake.set()
        if self._driver is None or self._driver.done():
            self._driver = asyncio.get_running_loop().create_task(self._drive(), name="dsh-code-scheduler")
        return call.future

    # -- the driver -----------------------------------------------------------------------------------

    async def _drive(self) -> None:
        while True:
            # Cleared before the state is inspected, so a wake-up during a pass is never lost.
            self._wake.clear()
            if self._commits and self._commits[0].settled:
                call = self._commits.popleft()
                await self._commit(call)
                if call.exclusive:
                    self._exclusive = False
                continue
            if self._pending:
                head = self._pending[0]
                if self._signal.aborted:
                    self._pending.popleft()
                    self._abandon(head)
                    continue
                exclusive = self._runtime.execution_mode(head.request) != "parallel"
                in_flight = len(self._in_flight)
                if not self._exclusive and (in_flight == 0 if exclusive else in_flight < self._cap):
                    self._pending.popleft()
                    head.exclusive = exclusive
                    if exclusive:
                        self._exclusive = True
                    self._commits.append(head)
                    await self._start(head)
                    continue
            idle = not self._pending and not self._commits and not self._in_flight
            if idle and (self._closing or self._signal.aborted):
                return
            await self._wake.wait()

    def _abandon(self, call: SubCall) -> None:
        call.future.add_done_callback(_mark_retrieved)
        call.future.set_exception(SubCallError(
            f"run_code run is over ({self._signal.reason}); {call.name} tool call abandoned"))

    async def _start(self, call: SubCall) -> None:
        if self._history.enabled:
            await self._history.started(call.sub_call_id, call.name, call.logged)
        try:
            control = self.run_control
            pause = getattr(control, "pause_wall_clock", None)
            if pause is not None:
                # The program is blocked on host policy (mostly a person answering an approval):
                # that wait is not the program's doing, so it does not use up its wall clock.
                with pause():
                    staged = await self._runtime.prepare(call.request)
            else:
                staged = await self._runtime.prepare(call.request)
        except Exception as error:
            log.warning("prepare of nested call %s failed", call.sub_call_id, exc_info=True)
            call.failure = error_result(error)
            call.settled = True
            return
        call.staged = staged
        if staged.kind != "dispatch":
            call.settled = True
            return
        if call.exclusive:
            # Nothing else may start until this call commits, so the lane itself runs the body:
            # the same ordering as an in-flight task, without the task and its wake-ups.
            await self._dispatch(call)
            return
        task = asyncio.get_running_loop().create_task(self._body(call), name=f"dsh-sub-call:{call.sub_call_id}")
        self._in_flight.add(task)

    async def _dispatch(self, call: SubCall) -> None:
        staged = call.staged
        assert staged is not None
        try:
            call.staged = await self._runtime.dispatch(staged)
        except Exception as error:
            staged.settle("final-result", error_result(error))
        finally:
            call.settled = True

    async def _body(self, call: SubCall) -> None:
        try:
            await self._dispatch(call)
        finally:
            # Done here rather than in a done-callback, which would cost the driver a loop turn.
            task = asyncio.current_task()
            if task is not None:
                self._in_flight.discard(task)
            self._wake.set()

    async def _commit(self, call: SubCall) -> None:
        result = await self._final_result(call)
        context = self._context
        if context is not None:
            # Deferred at commit, in submission order, onto the outer execution: they ride the
            # run_code result even if the program fails later.
            for message in result.additional_contexts:
                context.defer_context(message)
            if result.concludes_turn and not result.is_error:
                context.conclude_turn()
        future = call.future
        if not future.done():  # the code runtime cancels the calls of a run that settled
            error = result.error
            if error is None:
                # A plain copy: the value is frozen (dict/list subclasses), and the seam carries
                # plain JSON only (the worker wire refuses subclasses rather than guessing).
                future.set_result(thaw(result.value))
            else:
                future.add_done_callback(_mark_retrieved)
                # Only the tool's error text reaches the program: no "Error: " prefix, no code.
                future.set_exception(SubCallError(error.message))
        if self._on_commit is not None:
            try:
                self._on_commit(call, result)
            except Exception:
                log.warning("on_commit observer failed for %s", call.sub_call_id, exc_info=True)
        if self._history.enabled:
            await self._history.settled(call.sub_call_id, call.name, call.logged, result)

    async def _final_result(self, call: SubCall) -> ToolResult:
        staged = call.staged
        if staged is None:
            assert call.failure is not None
            return call.failure
        try:
            if staged.kind == "dispatch":
                # The body task ended without settling (it was cancelled from outside).
                staged.settle("final-result", ToolResult.failure(ErrorCode.ABORTED, ABORTED_MESSAGE))
            if staged.kind == "post-result":
                return await self._runtime.finalize(staged)
            return await self._runtime.finish(staged)
        except Exception as error:
            log.warning("finishing nested call %s failed", call.sub_call_id, exc_info=True)
            return error_result(error)

    # -- settlement -------------------------------------------------------------------------------------

    async def drain(self) -> None:
        """Wait for quiescence after the run was aborted or settled.

        Queued calls are abandoned, started bodies are awaited, every commit
        (one already in progress included) finishes, and every log write ends.
        """
        self._closing = True
        self._wake.set()
        driver = self._driver
        if driver is not None:
            await asyncio.shield(driver)
        self._unlisten()
