"""The per-program scheduler of nested ``run_code`` calls.

Each ``run_code`` execution owns one :class:`ProgramScheduler` (the cap is
per program, not a process-wide semaphore). State: a FIFO ``pending`` queue of
submitted calls, the number of bodies ``in flight``, a ``commits`` queue in
submission order, an ``exclusive`` flag, and the **lane**: a baton that at most
one of the scheduler's tasks holds at a time. The holder repeats:

1. **Commit first.** If the head of ``commits`` has settled, pop it and
   commit it (post-execute, finish, context deferral, turn control, then
   resolve the program's call and append the settle event). An exclusive entry
   clears the flag only *after* its commit: its barrier covers post-execute.
2. **Else consider the head of ``pending``.** If the run is over (the run's
   signal is aborted, or the code runtime cancelled the call's future because
   the program settled), abandon it: the program's call raises if anyone still
   waits, and no start event is logged. Otherwise reclassify
   it *now* (a tool replaced while queued is reclassified; anything unknown
   fails closed to exclusive). It starts when no exclusive call holds the
   barrier and either it is parallel and fewer than the cap are in flight, or
   it is exclusive and nothing is in flight. Starting logs the start event and
   runs ``prepare`` (pre-execute, approval, guards) on the lane; only a
   ``dispatch`` result runs the body, unless the run is over by then (a call
   whose policy answered while the code runtime tore its run down commits as
   aborted before dispatch: no body starts for a program that is gone). The
   call is classified again once its policy has answered, by the definition its
   policy judged (pinned when ``prepare`` created it, and the only one its body
   may run: a tool replaced since fails the call at dispatch, see
   :attr:`~dsh_core.runtime.Staged.definition`): one that started parallel and
   is now exclusive raises the barrier and is *parked* until the bodies in
   flight end (or it is aborted), then runs like any exclusive body. An exclusive body runs on the lane
   (nothing may overlap it anyway). A parallel one gets a task of its own if
   the lane has more to do now; otherwise the holder lets go of the lane and
   runs the body itself. A task whose body ended takes the lane if nobody
   holds it.
3. **Else release the lane.** Whoever changes the state next takes it: a
   submission (a new task), a body that ends (its own task), or the run's
   abort (a new task, which abandons what is queued).

So only around-dispatch plus the body overlap; starts, policy, post-execute,
finalization, context deferral and settlement run on one ordered lane in
submission order, even when bodies finish out of order, and a slow policy on
one call delays the next start. No task ever waits for the lane: work it
finds taken stays queued for the holder, which looks again before letting go.

Per call that is one task, started when the lane picks the call up, and no
wake-ups between the stages of a lone call. The program's binding gets a
future (no task of its own: see
:data:`~dsh_core.coderuntime.seam.BindingFunction`) that the commit resolves
with the plain result value or fails with :class:`SubCallError`. The settle
event is appended on the lane right after the program's call is resolved, so
events keep commit order and a slow session store slows the lane instead of
piling up writes.

**A call the program cancels** (its await of the call was cancelled: ``asyncio.wait_for``,
``asyncio.timeout``, ``task.cancel()``) has its future cancelled by the code runtime while
the run goes on. Each call has an abort controller of its own (its request's signal), which
the run's abort reaches until the call commits (through the scheduler's one listener on the
run's signal, not one per call). A done-callback on the future aborts it with
:data:`PROGRAM_CANCELLED`, so policy waiting for it (an approval prompt) and its body stop,
and cuts the task running its around-dispatch and body, so a body that ignores its signal
stops too and an exclusive call frees the barrier (only once its body really ended: a body
that a middleware runs in a task of its own is cut through the dispatch, and waited for).
The call commits as aborted (a queued one is abandoned: it never starts and logs nothing);
a call whose body had already ended commits as it ended. A future cancelled because the
run settled (the run's control signal is aborted first) is left to the run's own abort,
which reaches every call not yet committed.

Besides :meth:`ProgramScheduler.cancel_bodies` (a cancelled run cuts the bodies and a
call's policy), nothing in dsh cancels the scheduler's tasks, but loop teardown or a
foreign task-killer may, at any point (before a task's first step included). Each
task's done-callback repairs what a cancelled one left: its body counts as
ended (the call commits as aborted), the lane it held is let go and handed on
if there is work, and an exclusive barrier is cleared by its commit's
``finally``. A call cancelled mid-commit (or mid-policy) still emits its one
result event (finished as aborted, even cut in post-execute), answers the program and logs
its settle event: a settle write the cancellation interrupted wrote nothing
(a session sink's contract), so it is written again, through further
cancellations, for at most :data:`WRITE_AFTER_CANCEL_TIMEOUT_S`. A start
write the cancellation interrupted is written again the same way (the call
then commits as aborted), so the session never shows a settle without its
start; a start given up on drops the call's settle event too.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, Final

from dsh_core.abort import AbortController, AbortSignal
from dsh_core.codemode.history import DispatchHistory
from dsh_core.errors import ErrorCode
from dsh_core.lossless import JSON, thaw
from dsh_core.model import ToolContext, ToolExecutionInput, ToolResult
from dsh_core.runtime import ABORTED_BEFORE_DISPATCH_MESSAGE, Staged, ToolRuntime, aborted_result, error_result

__all__ = [
    "DEFAULT_MAX_PARALLEL_SUB_CALLS",
    "PROGRAM_CANCELLED",
    "WRITE_AFTER_CANCEL_TIMEOUT_S",
    "ProgramScheduler",
    "SubCall",
    "check_max_parallel",
    "SubCallError",
]

log = logging.getLogger("dsh")

#: The default number of concurrency-safe nested calls one program may have in flight.
DEFAULT_MAX_PARALLEL_SUB_CALLS: Final = 10

#: The abort reason of a nested call whose program cancelled it.
PROGRAM_CANCELLED: Final = "cancelled by the program"

#: How long a scheduler task cancelled from outside mid-write still tries to append the call's
#: start or settle event (the SQLite store's default busy timeout: a write waiting out another writer).
WRITE_AFTER_CANCEL_TIMEOUT_S: Final = 5.0


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

    __slots__ = (
        "abort",
        "counted",
        "cut",
        "exclusive",
        "failure",
        "future",
        "logged",
        "name",
        "request",
        "settled",
        "staged",
        "start_lost",
        "sub_call_id",
        "watch",
    )

    def __init__(self, request: ToolExecutionInput, logged: JSON, future: asyncio.Future[JSON]) -> None:
        self.request = request
        self.logged = logged
        #: ``"<run_code call id>:code:<n>"``.
        self.sub_call_id = request.call_id
        #: The tool name the program called.
        self.name = request.name
        #: What the program's call resolves to: the plain result value, or :class:`SubCallError`.
        self.future = future
        self.staged: Staged | None = None
        self.exclusive = True
        self.settled = False
        #: A result for a call whose ``prepare`` itself raised (no staged execution exists).
        self.failure: ToolResult | None = None
        #: True while its body counts against the cap.
        self.counted = False
        #: Aborts the call's own signal (the request's) until its commit; None if it has none.
        self.abort: AbortController | None = None
        #: True once the task running its body was cancelled because the program cancelled the call.
        self.cut = False
        #: The done-callback on ``future`` that stops the call if the code runtime cancels it.
        self.watch: Callable[[asyncio.Future[JSON]], None] | None = None
        #: True if its start event was cancelled and given up on: its settle event is not written either.
        self.start_lost = False


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
        self._loop = asyncio.get_running_loop()
        self._pending: collections.deque[SubCall] = collections.deque()
        self._commits: collections.deque[SubCall] = collections.deque()
        self._in_flight = 0
        self._exclusive = False
        self._lane_held = False
        #: The task holding the lane, when it is one of ours mid-work (None between holders).
        self._holder: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        #: The task running each call's around-dispatch and body, while it runs them.
        self._dispatching: dict[SubCall, asyncio.Task[Any]] = {}
        #: A started call reclassified exclusive after its policy, waiting for the bodies in flight.
        self._parked: SubCall | None = None
        #: The call being committed (popped from ``_commits``; the run's abort still reaches it).
        self._committing: SubCall | None = None
        #: The lane's task while it runs a call's policy stages (``prepare``): a cancelled run cuts it.
        self._in_policy: asyncio.Task[Any] | None = None
        #: The code runtime's run control (set by the transport from the first binding call).
        self.run_control: object | None = None
        self._unlisten = signal.add_listener(self._on_abort)

    # -- submission -----------------------------------------------------------------------------------

    def submit(
        self, request: ToolExecutionInput, logged: JSON, abort: AbortController | None = None
    ) -> asyncio.Future[JSON]:
        """Queue a nested call; the future settles at its commit, with what the program sees.

        That is the tool's plain (unfrozen) result value, or :class:`SubCallError`
        carrying only the tool's error text. Plain code, no await: the binding that
        calls it runs in the code runtime's event-loop callback.

        ``abort`` is the controller of the request's signal: the scheduler fuses it with
        the run's signal (until the call commits) and aborts it with :data:`PROGRAM_CANCELLED`
        when the code runtime cancels the future while the run goes on.
        """
        future: asyncio.Future[JSON] = self._loop.create_future()
        call = SubCall(request, logged, future)
        if abort is not None:
            call.abort = abort
            if self._signal.aborted:  # a fresh controller: nothing listens to it yet
                abort.abort(self._signal.reason)
        call.watch = functools.partial(self._on_future_done, call)
        future.add_done_callback(call.watch)
        self._pending.append(call)
        if not self._lane_held:
            self._hand_lane()
        return call.future

    def _on_abort(self, reason: object) -> None:
        """The run aborted: abort every call not yet committed, and abandon the queued ones at once.

        One listener on the run's signal for all of them (not one per call: a gather queues
        a thousand calls, and each would add and then remove a listener of its own). Every
        call is aborted even if one's listeners raise; then that is raised, as a signal does.
        """
        errors: list[Exception] = []
        committing = self._committing
        for call in (*((committing,) if committing is not None else ()), *self._commits, *self._pending):
            abort = call.abort
            if abort is not None:
                try:
                    abort.abort(reason)
                except Exception as error:
                    errors.append(error)
        # Queued calls are abandoned at once, not when some body happens to end (nor does a parked one wait).
        if (self._pending or self._parked is not None) and not self._lane_held:
            self._hand_lane()
        if len(errors) == 1:
            raise errors[0]
        if errors:
            raise ExceptionGroup("abort listeners of nested calls failed", errors)

    def _on_future_done(self, call: SubCall, future: asyncio.Future[JSON]) -> None:
        """The program cancelled ``call`` (the code runtime cancelled its future): stop it.

        A done-callback, not a task; the commit removes it before it resolves the future.
        """
        if not future.cancelled() or self._run_over():
            return  # abandoned; or the run settled, and its own abort reaches the call
        if not call.settled:
            abort = call.abort
            if abort is not None:
                try:
                    abort.abort(PROGRAM_CANCELLED)
                except Exception as error:
                    log.warning(
                        "an abort listener of nested call %s failed (abort reason: %s)",
                        call.sub_call_id,
                        PROGRAM_CANCELLED,
                        exc_info=error,
                    )
            task = self._dispatching.get(call)
            if task is not None and not call.cut:
                # Its body may ignore the signal: cut it, as a cancelled native call's body is cut.
                call.cut = True
                task.cancel()
        if not self._lane_held and self._lane_work():
            self._hand_lane()  # a queued call to abandon, or a barrier that may lift

    def _run_over(self) -> bool:
        """True once the run is aborted or settled (the code runtime aborts its control's signal first)."""
        if self._signal.aborted:
            return True
        signal = getattr(self.run_control, "signal", None)
        return isinstance(signal, AbortSignal) and signal.aborted

    # -- the lane -------------------------------------------------------------------------------------

    def _hand_lane(self) -> None:
        """Give the lane to a new task (the caller holds it, or nobody does)."""
        self._lane_held = True
        self._holder = None
        task = self._spawn(self._hold_lane(), "dsh-code-lane", None)
        # The task names itself holder on its first step; until then (or if it is cancelled
        # before it), it is the holder. An eager task factory may have run that step already.
        if self._lane_held and self._holder is None and not task.done():
            self._holder = task

    def _spawn(self, work: Coroutine[Any, Any, None], name: str, call: SubCall | None) -> asyncio.Task[None]:
        task = self._loop.create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(functools.partial(self._task_done, call))
        return task

    def _task_done(self, call: SubCall | None, task: asyncio.Task[None]) -> None:
        """Repair what a task cancelled from outside left behind (loop teardown, a foreign task-killer).

        Whether it was cut before its first step or mid-work: its body ends (the call
        commits as aborted), the lane it held is let go, and the lane's work goes on.
        """
        self._tasks.discard(task)
        if not task.cancelled():
            error = task.exception()
            if error is None:
                return
            log.error("run_code scheduler task %s failed", task.get_name(), exc_info=error)
        if call is not None:
            call.settled = True
            self._uncount(call)
        if task is self._holder:
            self._release_lane()
        if not self._lane_held and not self._loop.is_closed() and self._lane_work():
            self._hand_lane()

    def _uncount(self, call: SubCall) -> None:
        if call.counted:
            call.counted = False
            self._in_flight -= 1

    def _release_lane(self) -> None:
        self._holder = None
        self._lane_held = False

    def _lane_work(self) -> bool:
        """True if the lane holder could do something now (its own tests, in its order)."""
        if self._commits and self._commits[0].settled:
            return True
        parked = self._parked
        if parked is not None and self._may_dispatch_parked(parked):
            return True
        if not self._pending:
            return False
        head = self._pending[0]
        if self._is_over(head):
            return True
        # With nothing in flight either kind may start: no need to classify the head yet.
        return not self._exclusive and (self._in_flight == 0 or self._may_start(self._is_exclusive(head)))

    def _is_over(self, call: SubCall) -> bool:
        """The run is over for a queued call, or the program cancelled it (the code runtime cancelled its future)."""
        return self._signal.aborted or call.future.cancelled()

    def _is_exclusive(self, call: SubCall) -> bool:
        """Classify ``call`` now: anything but an exact ``parallel`` runs alone."""
        return self._runtime.execution_mode(call.request) != "parallel"

    def _is_exclusive_now(self, call: SubCall) -> bool:
        """Classify a prepared ``call`` by the definition its policy judged (the one its body runs)."""
        assert call.staged is not None
        return self._runtime.staged_execution_mode(call.staged) != "parallel"

    def _may_dispatch_parked(self, call: SubCall) -> bool:
        """The call reclassified exclusive after its start may run once nothing is in flight;
        one that is over (aborted, the run gone) settles at once, with no body."""
        return self._in_flight == 0 or call.request.signal.aborted or self._run_over()

    def _may_start(self, exclusive: bool) -> bool:
        """A parallel call starts below the cap, an exclusive one when nothing is in flight,
        and neither while an exclusive call holds the barrier."""
        in_flight = self._in_flight
        return not self._exclusive and (in_flight == 0 if exclusive else in_flight < self._cap)

    async def _body(self, call: SubCall) -> None:
        """Run a parallel body in a task of its own, then take the lane if nobody holds it."""
        await self._dispatch(call)
        self._uncount(call)
        if not self._lane_held:
            self._lane_held = True
            await self._hold_lane()

    async def _hold_lane(self) -> None:
        """Do the lane's work while holding it (the caller took it); see the module docstring."""
        self._holder = asyncio.current_task()
        while True:
            commits = self._commits
            if commits and commits[0].settled:
                call = commits.popleft()
                try:
                    await self._commit(call)
                finally:
                    if call.exclusive:
                        self._exclusive = False
                continue
            parked = self._parked
            if parked is not None and self._may_dispatch_parked(parked):
                self._parked = None
                await self._dispatch(parked)
                continue
            pending = self._pending
            if pending:
                head = pending[0]
                if self._is_over(head):
                    pending.popleft()
                    self._abandon(head)
                    continue
                exclusive = self._is_exclusive(head)
                if self._may_start(exclusive):
                    pending.popleft()
                    head.exclusive = exclusive
                    if exclusive:
                        self._exclusive = True
                    commits.append(head)
                    await self._start(head)
                    if head.settled:
                        continue
                    if not exclusive and self._is_exclusive_now(head):
                        # Classified by the definition its policy judged, which its body runs: not the one
                        # it was planned with if the tool changed before the call was created, and its
                        # is_concurrency_safe may answer otherwise now (an approval may wait for long).
                        head.exclusive = exclusive = True
                        self._exclusive = True
                    if exclusive:
                        if self._in_flight:
                            # Reclassified with bodies in flight: it waits for them, its barrier up.
                            self._parked = head
                            continue
                        await self._dispatch(head)
                        continue
                    head.counted = True
                    self._in_flight += 1
                    if self._lane_work():
                        # More to start or commit now: the body gets a task, the lane goes on.
                        self._spawn(self._body(head), "dsh-code-body", head)
                        continue
                    # Nothing else to do: this task runs the body itself, off the lane.
                    self._release_lane()
                    try:
                        await self._dispatch(head)
                    finally:
                        self._uncount(head)
                    if self._lane_held:
                        return  # the holder commits it (it looks again before letting go)
                    self._lane_held = True
                    self._holder = asyncio.current_task()
                    continue
            self._release_lane()
            return

    def _abandon(self, call: SubCall) -> None:
        call.abort = None
        call.watch = None
        if call.future.done():  # cancelled by the code runtime: the program or its run is over, nobody waits
            return
        call.future.add_done_callback(_mark_retrieved)
        call.future.set_exception(
            SubCallError(f"run_code run is over ({self._signal.reason}); {call.name} tool call abandoned")
        )

    async def _start(self, call: SubCall) -> None:
        history = self._history
        if history.enabled:
            try:
                await history.started(call.sub_call_id, call.name, call.logged)
            except asyncio.CancelledError:
                # The lane's task was cancelled from outside mid-write: the write wrote nothing (a
                # sink's contract). The call commits as aborted, and its settle event needs its start.
                if not await self._write_after_cancel(
                    call,
                    "start",
                    functools.partial(history.started, call.sub_call_id, call.name, call.logged),
                    "the session shows nothing of the call",
                ):
                    call.start_lost = True
                call.failure = aborted_result()
                call.settled = True
                raise
        self._in_policy = asyncio.current_task()
        try:
            # A person answering an approval ask is not the program's doing: that wait (and only
            # it, not a slow pre-execute hook or guard) does not use up the run's wall clock.
            staged = await self._runtime.prepare(
                call.request, approval_wait=getattr(self.run_control, "pause_wall_clock", None)
            )
        except Exception as error:
            log.warning("prepare of nested call %s failed", call.sub_call_id, exc_info=True)
            call.failure = error_result(error)
            call.settled = True
            return
        except asyncio.CancelledError:
            # The lane's task was cancelled from outside: the call is over, and committed as aborted
            # before dispatch (as prepare emitted its result event).
            call.failure = ToolResult.failure(ErrorCode.ABORTED_BEFORE_DISPATCH, ABORTED_BEFORE_DISPATCH_MESSAGE)
            call.settled = True
            raise
        finally:
            self._in_policy = None
        call.staged = staged
        if staged.kind != "dispatch":
            call.settled = True

    async def _dispatch(self, call: SubCall) -> None:
        staged = call.staged
        assert staged is not None
        if self._run_over():
            # The program is gone (the code runtime settled its run, and is tearing it down
            # before run_code's own abort comes): a call that was still in policy then must
            # not start its body now, for nobody. Settled as a call aborted before dispatch.
            staged.settle(
                "final-result", ToolResult.failure(ErrorCode.ABORTED_BEFORE_DISPATCH, ABORTED_BEFORE_DISPATCH_MESSAGE)
            )
            call.settled = True
            return
        task = asyncio.current_task()
        if task is not None:
            self._dispatching[call] = task
        try:
            call.staged = await self._runtime.dispatch(staged)
        except Exception as error:
            staged.settle("final-result", error_result(error))
            if call.cut and task is not None:
                task.uncancel()  # the cut turned into an error by the body: this task goes on
        except asyncio.CancelledError:
            # Cut because the program cancelled the call (and by nothing else): the call is over,
            # committed as aborted, and this task goes on. Any other cancellation goes up.
            if not call.cut or task is None or task.uncancel() > 0:
                raise
        else:
            if call.cut and task is not None:
                task.uncancel()  # the body swallowed the cut and returned
        finally:
            self._dispatching.pop(call, None)
            call.settled = True

    async def _commit(self, call: SubCall) -> None:
        self._committing = call
        try:
            await self._commit_steps(call)
        finally:
            self._committing = None

    async def _commit_steps(self, call: SubCall) -> None:
        result: ToolResult | None = None
        history = self._history
        payload: Mapping[str, Any] | None = None
        try:
            result = await self._final_result(call)
            self._deliver(call, result)
            if history.enabled and not call.start_lost:
                payload = await history.settle_payload(call.sub_call_id, call.name, call.logged, result)
                await history.append_settle(call.sub_call_id, payload)
        except asyncio.CancelledError:
            # The lane's task was cancelled from outside mid-commit: the program still gets an
            # answer, the watchers their record and the log its one settle event. A settle write
            # the cancellation interrupted wrote nothing (a sink's cancelled append commits
            # nothing), so writing it here never doubles it.
            if result is None:
                result = await self._finish_after_cancel(call)
                self._deliver(call, result)
            if history.enabled and not call.start_lost:
                settled = result

                async def write() -> None:
                    # The durable record is computed once (the hook runs once per call): a redone
                    # write appends the same one. Only a hook run the cancellation cut is run again.
                    nonlocal payload
                    if payload is None:
                        payload = await history.settle_payload(call.sub_call_id, call.name, call.logged, settled)
                    await history.append_settle(call.sub_call_id, payload)

                await self._write_after_cancel(
                    call, "settle", write, "the session shows the call started, never settled"
                )
            raise

    async def _finish_after_cancel(self, call: SubCall) -> ToolResult:
        """The result of a call whose commit was cut before it finished (mid post-execute, say).

        It is still finished as aborted, so its one result event is emitted; waited for through
        further cancellations, for at most :data:`WRITE_AFTER_CANCEL_TIMEOUT_S` (then it goes on
        in its own task, and the program is answered with the aborted result meanwhile).
        """
        staged = call.staged
        if staged is None:
            return call.failure or aborted_result()
        finishing = self._runtime.finish_cancelled(staged)

        async def wait() -> None:
            await asyncio.shield(finishing)

        if not finishing.done():
            await self._write_after_cancel(call, "result", wait, "its result observers may hear of it late")
        if finishing.done() and not finishing.cancelled() and finishing.exception() is None:
            return finishing.result()
        assert staged.result is not None
        return staged.result

    async def _write_after_cancel(
        self, call: SubCall, event: str, write: Callable[[], Coroutine[Any, Any, None]], lost: str
    ) -> bool:
        """Append ``call``'s ``event`` from a task cancelled mid-write: shielded, and bounded.

        True once written; False (``lost`` says what the session shows then, in the warning)
        if given up on.

        Each cancellation of a write means it wrote nothing, so a further cancellation of this
        task restarts it rather than losing the event; a sink still not done after
        :data:`WRITE_AFTER_CANCEL_TIMEOUT_S` is given up on (cancelled, so it writes nothing),
        and the loss is logged: a cancelled run must end even on a stuck store.
        """
        loop = self._loop
        task = asyncio.current_task()
        assert task is not None
        deadline = loop.time() + WRITE_AFTER_CANCEL_TIMEOUT_S
        while True:
            requested = task.cancelling()
            try:
                async with asyncio.timeout_at(deadline):
                    await write()
                return True
            except (asyncio.CancelledError, TimeoutError):
                # Only a new cancellation of this task is retried: a sink raising CancelledError
                # of its own accord would do it again at once, and the loop would spin.
                timed_out = loop.time() >= deadline
                if timed_out or task.cancelling() == requested:
                    why = (
                        f"the session sink took over {WRITE_AFTER_CANCEL_TIMEOUT_S:g} s"
                        if timed_out
                        else "the session sink cancelled it"
                    )
                    log.warning(
                        "the %s event of nested call %s was not written after its task was cancelled (%s): %s",
                        event,
                        call.sub_call_id,
                        why,
                        lost,
                    )
                    return False

    def _deliver(self, call: SubCall, result: ToolResult) -> None:
        """Defer contexts, settle the program's call and tell the watcher (no awaits: one step)."""
        call.abort = None  # committed: the run's abort no longer reaches it
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
            watch, call.watch = call.watch, None
            if watch is not None:
                future.remove_done_callback(watch)
            error = result.error
            if error is None:
                # A plain copy: the value is frozen (dict/list subclasses), and the seam carries
                # plain JSON only (the worker wire refuses subclasses rather than guessing).
                future.set_result(thaw(result.value))
            else:
                future.add_done_callback(_mark_retrieved)
                # Only the tool's error text reaches the program: no "Error: " prefix, no code. An
                # empty text would reach it as no message at all (a bridge may even put a class name
                # of ours in its place): then it is told which tool failed, and how.
                text = error.message or f'tool "{call.name}" failed ({error.code}) with no error message'
                future.set_exception(SubCallError(text))
        if self._on_commit is not None:
            try:
                self._on_commit(call, result)
            except Exception:
                log.warning("on_commit observer failed for %s", call.sub_call_id, exc_info=True)

    async def _final_result(self, call: SubCall) -> ToolResult:
        staged = call.staged
        if staged is None:
            assert call.failure is not None
            return call.failure
        try:
            if staged.kind == "dispatch":
                # The body task ended without settling (cut, or cancelled from outside): aborted, and
                # before dispatch if its body was never invoked (cut in a middleware), as in execute().
                return await asyncio.shield(self._runtime.finish_cancelled(staged))
            if staged.kind == "post-result":
                return await self._runtime.finalize(staged)
            return await self._runtime.finish(staged)
        except Exception as error:
            log.warning("finishing nested call %s failed", call.sub_call_id, exc_info=True)
            return error_result(error)

    # -- settlement -------------------------------------------------------------------------------------

    def cancel_bodies(self) -> None:
        """Cancel the tasks running a body or a call's policy now, for a run cancelled rather than settled.

        The run's abort asks every body to stop; a body that ignores its signal would
        otherwise hold :meth:`drain` (and whoever cancelled the run) until it returns,
        and so would a pre-execute hook or guard that ignores it (a native call's policy
        is cut by its caller's cancel too). Only policy, around-dispatch and the body
        are cut: each such call commits as aborted (its task's done-callback hands the
        lane on), and commits and log writes run to their end as usual.
        """
        for task in list(self._dispatching.values()):
            task.cancel()
        policy = self._in_policy
        if policy is not None:
            # The lane's task itself: its call commits as aborted before dispatch (prepare emits
            # its one result event), and its done-callback hands the lane on to commit it.
            policy.cancel()

    async def drain(self) -> None:
        """Wait for quiescence after the run was aborted or settled.

        Queued calls are abandoned, started bodies are awaited, every commit
        (one already in progress included) finishes, and every log write ends.
        """
        if not self._lane_held and self._lane_work():
            self._hand_lane()
        cancelled = False
        while self._tasks:
            # asyncio.wait never cancels what it waits for; a cancellation of this task is
            # held back until everything is quiescent, then re-raised.
            try:
                await asyncio.wait(set(self._tasks))
            except asyncio.CancelledError:
                cancelled = True
        self._unlisten()
        # Nothing can be left by now; should a bug leave something, the program's call still ends.
        for call in (*self._pending, *self._commits):
            log.error("run_code scheduler left %s uncommitted", call.sub_call_id)
            self._abandon(call)
        if cancelled:
            raise asyncio.CancelledError
