"""ToolRuntime: the fixed-order execution pipeline, and the only place that orders its stages.

::

    create ──> pre-execute ──> approval (on ask) ──> guards ──> around-dispatch ──> body ──> post-execute
      │             │                 │                │              │                          │
      └─────────────┴─────────────────┴────────────────┴──────────────┴──> finish <──────────────┘
        final-result, no post-execute: invalid args, collapsed,             finalize_content,
        denied, a hook failed, aborted before dispatch                      materialize, emit
                                                                            (dsh_tool_result)

A call aborted before its body is invoked (even after :meth:`ToolRuntime.prepare`,
at dispatch) is a final result too: only a dispatched result reaches post-execute.

The tool's definition is resolved once, at create (:attr:`Staged.definition`):
policy judges the call with it, callers classify the prepared call by it
(:meth:`ToolRuntime.staged_execution_mode`), and the body runs it or nothing. A
definition replaced or removed under the name while the call waited fails the
call at dispatch without any body: ``ABORTED_BEFORE_DISPATCH`` if replaced (a
final result: call it again), ``UNKNOWN_TOOL`` if removed.

Staged interface (used by the agent loop and the ``run_code`` scheduler, which
must interleave stages of several calls): :meth:`ToolRuntime.prepare` →
:meth:`ToolRuntime.dispatch` → :meth:`ToolRuntime.finalize` (post-execute then
finish) or :meth:`ToolRuntime.finish` (finish only). :meth:`ToolRuntime.execute`
runs them in order for one call.

Where a call is denied: :meth:`ToolRuntime._create` (collapse, invalid
arguments, pre-aborted, a disposed calling scope: before any hook) and :meth:`ToolRuntime.prepare`
(pre-execute, approval, guards). A call settled before dispatch is finished
without post-execute: no plugin may rewrite a denial the model reads (the
upstream harness runs post-execute on policy denials; dsh deliberately does not).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Literal

import attrs

from dsh_core.abort import AbortedError, AbortSignal
from dsh_core.bounds import is_positive_seconds
from dsh_core.errors import (
    DshError,
    ErrorCode,
    InvalidToolOutputError,
    ToolError,
    UnknownToolError,
    describe_callable,
    describe_exception,
)
from dsh_core.hooks import HookFailure, Hooks, cancellation_requested, guard_verdict_error, own_cancellation
from dsh_core.lossless import JSON, NotLosslessError, freeze
from dsh_core.model import (
    ApprovalOutcome,
    ApprovalRequest,
    ContentBlock,
    ExecutionMode,
    ExecutionToken,
    Middleware,
    PostDecision,
    Proceed,
    TextBlock,
    ToolContext,
    ToolDefinition,
    ToolExecution,
    ToolExecutionInput,
    ToolResult,
    content_problem,
    text_of,
)
from dsh_core.registry import TRANSPORT_NAME, ToolRegistry, definition_mode
from dsh_core.schema import format_violations, violations
from dsh_core.scope import Scope, one_shot

__all__ = [
    "ToolRuntime",
    "Staged",
    "ABORTED_BEFORE_DISPATCH_MESSAGE",
    "ABORTED_MESSAGE",
    "aborted_result",
    "error_result",
    "check_approval_timeout",
    "APPROVAL_GRACE_S",
]

log = logging.getLogger("dsh")

ABORTED_BEFORE_DISPATCH_MESSAGE = "tool call aborted before dispatch"
ABORTED_MESSAGE = "tool call aborted"
#: Seconds a withdrawn approval ask waits for its channel to end before leaving it running (and naming it).
APPROVAL_GRACE_S = 5.0

StageKind = Literal["dispatch", "post-result", "final-result"]
Finalizer = Callable[[ToolExecution, ToolResult], "Sequence[ContentBlock] | None"]


def collapsed_message(name: str, *, nested: bool = False) -> str:
    """The ``UNKNOWN_TOOL`` message of a collapsed call: it tells the model where the tool went.

    Nested, the collapsed name is the transport itself, which no program may call.
    """
    if nested:
        return (
            f'unknown tool "{name}": `{TRANSPORT_NAME}` cannot be called from inside a `{TRANSPORT_NAME}` '
            "program: call the tools from this program instead"
        )
    return (
        f'unknown tool "{name}": only `{TRANSPORT_NAME}` is callable directly — '
        f"call `{name}` from inside a `{TRANSPORT_NAME}` program instead"
    )


class Staged:
    """One execution between stages: its kind says which stage comes next."""

    __slots__ = (
        "_body_invoked",
        "_dispatching",
        "_finalizer",
        "_finalizing",
        "_finished",
        "_proceeded",
        "execution",
        "kind",
        "result",
    )

    def __init__(self, execution: ToolExecution, finalizer: Finalizer | None) -> None:
        self.kind: StageKind = "dispatch"
        self.execution = execution
        self.result: ToolResult | None = None
        self._finalizer = finalizer
        self._body_invoked = False
        self._dispatching = False
        self._proceeded = False
        self._finalizing = False
        self._finished = False

    @property
    def definition(self) -> ToolDefinition | None:
        """The definition resolved when the call was created (``None``: no such tool then).

        The only one the call's policy judges (``execution.definition``), its caller
        classifies and its body runs: a body never runs a definition registered under
        the name meanwhile.
        """
        return self.execution.definition

    def settle(self, kind: StageKind, result: ToolResult) -> Staged:
        self.kind = kind
        self.result = result
        return self


def _aborted_before_dispatch(contexts: Sequence[object] = ()) -> ToolResult:
    return ToolResult.failure(
        ErrorCode.ABORTED_BEFORE_DISPATCH,
        ABORTED_BEFORE_DISPATCH_MESSAGE,
        additional_contexts=tuple(contexts),  # type: ignore[arg-type]
    )


def _agent_label(agent: Scope | None) -> str:
    return "no agent" if agent is None else f"scope {agent.path!r}"


def _agent_gone(agent: Scope) -> ToolResult:
    # A disposed scope's layer (restrictions, guards, mode) and scoped hooks are gone: its calls
    # would run with none of its policy, so they never reach a body.
    return ToolResult.failure(
        ErrorCode.ABORTED_BEFORE_DISPATCH,
        f"{ABORTED_BEFORE_DISPATCH_MESSAGE}: the calling scope {agent.path!r} is disposed",
    )


def aborted_result(contexts: Sequence[object] = ()) -> ToolResult:
    """The result of a call aborted once it had started (``ABORTED``), with ``contexts`` kept."""
    return ToolResult.failure(ErrorCode.ABORTED, ABORTED_MESSAGE, additional_contexts=tuple(contexts))  # type: ignore[arg-type]


def error_result(error: BaseException) -> ToolResult:
    """The standard error result of a thrown value: typed code kept, anything else ``TOOL_FAILED``."""
    if isinstance(error, DshError):
        # str(): a body may raise ToolError(some_exception); its text, not a TypeError, is the message.
        return ToolResult.failure(str(error.code), str(error.message))
    if isinstance(error, AbortedError):
        return aborted_result()
    return ToolResult.failure(ErrorCode.TOOL_FAILED, describe_exception(error))


class ToolRuntime:
    """Runs tool calls through the fixed pipeline against one registry and one hook facade.

    ``approval_timeout_s`` bounds how long an approval ask waits for its answer
    (``None``, the default: for as long as it takes). An ask unanswered by then is
    withdrawn (its channel's task is cancelled, so a late answer reaches nobody) and
    the call is denied, saying the request timed out: fail closed.

    ``approval_grace_s`` (default :data:`APPROVAL_GRACE_S`) bounds how long a withdrawn
    ask (timed out, aborted, or its caller cancelled) waits for its channel to end: a
    channel that ignores the withdrawal longer is left running and named in a warning,
    and the call goes on without it. A caller cancelled meanwhile (again, maybe) stops
    that wait at once: the channel still running is named all the same.
    """

    def __init__(
        self,
        registry: ToolRegistry,
        hooks: Hooks,
        *,
        approval_timeout_s: float | None = None,
        approval_grace_s: float = APPROVAL_GRACE_S,
    ) -> None:
        self.registry = registry
        self.hooks = hooks
        self.approval_timeout_s = check_approval_timeout(approval_timeout_s)
        if not is_positive_seconds(approval_grace_s):
            raise ValueError(f"approval_grace_s must be a positive, finite number of seconds, got {approval_grace_s!r}")
        self.approval_grace_s = float(approval_grace_s)
        # Tokens of executions whose transport body is running now: the only valid parents, each with
        # the agent of the execution it belongs to (the only agent it nests) and how many openers hold it.
        self._live_parents: dict[ExecutionToken, tuple[Scope | None, int]] = {}

    def open_nesting(self, token: ExecutionToken, agent: Scope | None) -> Callable[[], None]:
        """Accept ``token`` as the parent of ``agent``'s nested calls until the returned function is called.

        ``token`` and ``agent`` are those of the execution whose body sends the nested calls
        (``execution.token`` and ``execution.agent``). The runtime does this itself for the
        reserved ``run_code`` transport, for exactly as long as its body runs; a custom
        transport built on the staged interface must do the same. A parent that is not open
        (forged, or from a run that has ended), or that is presented with any other agent
        (another scope object, or ``None`` for one opened for a scope, and the reverse), is
        ignored: the call is treated as model-direct, so that agent's Code Mode collapse
        still applies to it.

        Opening a token again for the same agent is counted (it stays open until every
        opener has closed it). Opening a token that is open for a different agent raises
        ``ValueError``: a token belongs to one execution, so that is a bug in the caller.
        """
        held = self._live_parents.get(token)
        if held is not None and held[0] is not agent:
            raise ValueError(
                f"open_nesting: this parent token is already open for another agent "
                f"({_agent_label(held[0])}, not {_agent_label(agent)}); a token belongs to one "
                "execution and nests only that execution's agent"
            )
        self._live_parents[token] = (agent, (held[1] if held is not None else 0) + 1)

        @one_shot
        def close() -> None:
            current = self._live_parents.get(token)
            if current is None:
                return
            if current[1] > 1:
                self._live_parents[token] = (current[0], current[1] - 1)
            else:
                del self._live_parents[token]

        return close

    def _parent_of(self, request: ToolExecutionInput) -> ExecutionToken | None:
        """The request's parent if it makes the call nested: open now, and for the request's own agent."""
        parent = request.parent
        if parent is None:
            return None
        held = self._live_parents.get(parent)
        return parent if held is not None and held[0] is request.agent else None

    # -- whole calls -----------------------------------------------------------------------------------

    async def execute(self, request: ToolExecutionInput) -> ToolResult:
        """Run one call through every stage and return its final result (exactly one result event)."""
        staged = self._create(request)
        try:
            if staged.kind == "dispatch":
                await self._policy(staged)
            if staged.kind == "dispatch":
                staged = await self.dispatch(staged)
            if staged.kind == "post-result":
                return await self.finalize(staged)
            return await self.finish(staged)
        except asyncio.CancelledError:
            await asyncio.shield(self.finish_cancelled(staged))
            raise

    def execution_mode(self, request: ToolExecutionInput) -> ExecutionMode:
        """How a scheduler may run the call: ``parallel`` only for an exact ``True`` from the tool.

        The tool the registry holds now: a plan, made before the call is created. Once it
        is (after :meth:`prepare`), classify it with :meth:`staged_execution_mode`.
        """
        try:
            arguments = freeze(request.arguments)
        except NotLosslessError:
            return "exclusive"
        nested = self._parent_of(request) is not None
        return self.registry.execution_mode(request.name, arguments, request.agent, nested)

    @staticmethod
    def staged_execution_mode(staged: Staged) -> ExecutionMode:
        """How a scheduler may run a prepared call's body: by the definition its policy judged.

        That is the definition its body runs (:attr:`Staged.definition`), whatever the
        registry holds under the name now, so the classification and the body never
        disagree: a tool replaced meanwhile fails the call at dispatch instead.
        """
        arguments = staged.execution.arguments
        return definition_mode(staged.definition, arguments) if arguments is not None else "exclusive"

    # -- create -----------------------------------------------------------------------------------------

    def _create(self, request: ToolExecutionInput) -> Staged:
        agent = request.agent
        parent = self._parent_of(request)
        nested = parent is not None
        name = request.name
        visible = self.registry.get(name, agent)
        collapsed = visible is not None and self.registry.collapses(name, agent, nested)
        # Captured before the arguments are materialized: the registry may change meanwhile. The definition
        # is pinned here too (execution.definition, below): policy, classification and body use it.
        finalizer = visible.finalize_content if visible is not None else None
        token = ExecutionToken()
        try:
            arguments = freeze(request.arguments)
            loss: NotLosslessError | None = None
        except NotLosslessError as error:
            arguments, loss = None, error
        execution = ToolExecution(
            call_id=request.call_id,
            root_call_id=request.root_call_id if request.root_call_id is not None else request.call_id,
            name=name,
            arguments=arguments,
            signal=request.signal,
            agent=agent,
            parent=parent,
            token=token,
            definition=visible,
        )
        staged = Staged(execution, finalizer)
        if loss is not None:
            return staged.settle(
                "final-result",
                ToolResult.failure(
                    ErrorCode.INVALID_ARGS, f"tool execution arguments must be losslessly JSON-serializable: {loss}"
                ),
            )
        if agent is not None and not agent.active:
            return staged.settle("final-result", _agent_gone(agent))
        if collapsed:
            if request.signal.aborted:
                return staged.settle("final-result", _aborted_before_dispatch())
            staged._finalizer = None
            return staged.settle(
                "final-result", ToolResult.failure(ErrorCode.UNKNOWN_TOOL, collapsed_message(name, nested=nested))
            )
        if visible is not None:
            invalid = self._argument_violations(visible, arguments)
            if invalid is not None:
                return staged.settle("final-result", invalid)
        return staged

    @staticmethod
    def _argument_violations(definition: ToolDefinition, arguments: JSON) -> ToolResult | None:
        check = definition.parameters_check
        if check is not None and check(arguments):
            return None
        found = violations(definition.parameters_validator, arguments)
        if not found:
            return None
        return ToolResult.failure(
            ErrorCode.INVALID_ARGS, f'invalid arguments for tool "{definition.name}": {format_violations(found)}'
        )

    # -- prepare: pre-execute, approval, guards ---------------------------------------------------------

    async def prepare(
        self, request: ToolExecutionInput, *, approval_wait: Callable[[], AbstractContextManager[None]] | None = None
    ) -> Staged:
        """Create the execution and run the policy stages; the result says what comes next.

        ``approval_wait()``, if given, is held while the call waits for the answer to an
        approval ask, and only then (the Code Mode scheduler stops its run's wall clock
        with it: a person deciding is not the program's time, a slow policy hook is).
        """
        staged = self._create(request)
        if staged.kind == "dispatch":
            try:
                await self._policy(staged, approval_wait)
            except asyncio.CancelledError:
                # The caller never gets this execution to finish, but its pre-execute hooks saw it:
                # its one result event is emitted here (aborted before dispatch), then the cancellation goes on.
                await asyncio.shield(self.finish_cancelled(staged))
                raise
        return staged

    async def _policy(
        self, staged: Staged, approval_wait: Callable[[], AbstractContextManager[None]] | None = None
    ) -> Staged:
        """Pre-execute, approval, guards: settle ``staged`` if the call may not be dispatched.

        Never raises (but for cancellation): an unexpected error settles the call as a
        final result, so its caller can always finish it and emit its one result event.
        """
        try:
            return await self._policy_stages(staged, approval_wait)
        except Exception as error:
            return staged.settle("final-result", error_result(error))

    async def _policy_stages(
        self, staged: Staged, approval_wait: Callable[[], AbstractContextManager[None]] | None
    ) -> Staged:
        execution = staged.execution
        signal = execution.signal
        if signal.aborted:
            return staged.settle("final-result", _aborted_before_dispatch())
        try:
            decision = await self.hooks.pre_execute(execution)
        except HookFailure as failure:
            return staged.settle("final-result", _hook_failed(failure, execution))
        kind = decision.kind
        if kind == "deny":
            return staged.settle("final-result", self._denied(decision.reason or f'tool "{execution.name}" denied'))
        if kind == "ask":
            outcome, timed_out = await self._ask(execution, decision.reason, approval_wait)
            if timed_out:
                return staged.settle(
                    "final-result",
                    self._denied(
                        f'the approval request for tool "{execution.name}" timed out after '
                        f"{self.approval_timeout_s:g} s; the call is denied"
                    ),
                )
            if outcome is not ApprovalOutcome.ALLOWED:
                if outcome is ApprovalOutcome.CANCELLED and signal.aborted:
                    return staged.settle("final-result", _aborted_before_dispatch())
                return staged.settle(
                    "final-result", self._denied(_approval_denial(execution.name, outcome, decision.reason))
                )
        elif kind != "allow":  # fail closed: only an exact allow goes on (the facade names the plugin)
            return staged.settle(
                "final-result",
                ToolResult.failure(ErrorCode.TOOL_FAILED, f"pre-execute returned a decision of unknown kind {kind!r}"),
            )
        reason = await self._guard(execution)
        if reason is not None:
            return staged.settle("final-result", self._denied(reason))
        if signal.aborted:
            return staged.settle("final-result", _aborted_before_dispatch())
        return staged

    @staticmethod
    def _denied(reason: str) -> ToolResult:
        return ToolResult.failure(ErrorCode.DENIED, reason)

    async def _ask(
        self,
        execution: ToolExecution,
        reason: str | None,
        approval_wait: Callable[[], AbstractContextManager[None]] | None,
    ) -> tuple[ApprovalOutcome, bool]:
        """The ask's outcome, and whether it timed out (then the call is denied, whatever came of it).

        An ask withdrawn before it was answered (timed out, aborted, or the caller cancelled)
        is ``cancelled``, whatever its channel answers afterwards: its channel's task is
        cancelled and waited for at most :attr:`approval_grace_s` (less if the caller is
        cancelled meanwhile), then left running, named in a warning.
        """
        signal = execution.signal
        request = ApprovalRequest(execution, reason, signal)
        channel: str | None = None

        def answering(plugin: str) -> None:
            nonlocal channel
            channel = plugin

        approval = asyncio.ensure_future(self.hooks.approve(request, on_channel=answering))
        # Resolved by the answer or by the timeout: the wait must not depend on the channel
        # obeying its cancellation.
        settled: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def settle(_: object = None) -> None:
            if not settled.done():
                settled.set_result(None)

        approval.add_done_callback(settle)
        timed_out = withdrawn = False

        def withdraw() -> None:
            nonlocal withdrawn
            # Withdrawn, not just stopped waiting for: the person's prompt goes away, and an
            # answer the channel still manages to give (it swallowed the cancellation) is ignored.
            withdrawn = True
            approval.cancel()

        def expire() -> None:
            nonlocal timed_out
            if not approval.done():
                timed_out = True
                withdraw()
                settle()

        timeout = self.approval_timeout_s
        timer = None if timeout is None else asyncio.get_running_loop().call_later(timeout, expire)
        try:
            try:
                if approval_wait is None:
                    await signal.until(settled)
                else:
                    with approval_wait():
                        await signal.until(settled)
            finally:
                if timer is not None:
                    timer.cancel()
                approval.remove_done_callback(settle)
                if not approval.done():
                    if not withdrawn:  # aborted, or the caller was cancelled: the prompt must not outlive the call
                        withdraw()
                    await self._let_go(approval, channel, execution)
        except asyncio.CancelledError:
            # The caller gave up on the call: the observers still hear how the ask ended (once per
            # ask: the session would otherwise hold an ask never resolved), then the cancellation goes on.
            answered = not withdrawn and approval.done() and not approval.cancelled() and approval.exception() is None
            outcome = approval.result() if answered else ApprovalOutcome.CANCELLED
            await asyncio.shield(self.hooks.approval_resolved(request, outcome))
            raise
        outcome = ApprovalOutcome.CANCELLED if withdrawn or approval.cancelled() else approval.result()
        await self.hooks.approval_resolved(request, outcome)
        return outcome, timed_out

    async def _let_go(
        self, approval: asyncio.Future[ApprovalOutcome], channel: str | None, execution: ToolExecution
    ) -> None:
        """Wait at most the grace for a withdrawn ask's channel to end; leave it running, named, if it does not.

        The caller cancelled (again) meanwhile stops the wait at once, and the cancellation goes on;
        a channel still running then is named all the same: it is left running just as surely.
        """
        grace = self.approval_grace_s
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            await asyncio.wait((approval,), timeout=grace)
        except asyncio.CancelledError:
            # asyncio.wait never raises for the channel's own cancellation: this is the caller's.
            if not approval.done():
                log.warning(
                    "approval channel of plugin %r ignored its withdrawal for %.3g s, until its call was "
                    'cancelled again (tool "%s", call %r); it is left running',
                    channel,
                    loop.time() - started,
                    execution.name,
                    execution.call_id,
                )
            raise
        if not approval.done():
            # A channel that ignores its cancellation must not hold the call (or a run's scheduler lane)
            # forever; whatever it answers later reaches nobody.
            log.warning(
                'approval channel of plugin %r ignored its withdrawal for %g s (tool "%s", call %r); '
                "it is left running and the call goes on without it",
                channel,
                grace,
                execution.name,
                execution.call_id,
            )

    async def _guard(self, execution: ToolExecution) -> str | None:
        for guard in self.registry.guards_for(execution.agent):
            try:
                verdict = guard(execution)
                if inspect.isawaitable(verdict):
                    verdict = await verdict
            except (Exception, asyncio.CancelledError) as error:
                if own_cancellation(error):
                    raise
                # Fail closed, naming the guard: registry guards carry no plugin name, their function does.
                name = describe_callable(guard)
                log.warning("guard %s failed on call %r; the call is denied", name, execution.call_id, exc_info=True)
                return f"guard {name} failed: {describe_exception(error)}"
            if verdict is not None:
                if isinstance(verdict, str) and verdict.strip():
                    return str(verdict)
                name = describe_callable(guard)
                if isinstance(verdict, str):  # a blank reason still denies; the model is told whose guard it was
                    return f'guard {name} denied tool "{execution.name}" (it gave no reason)'
                log.warning(
                    "guard %s returned %s on call %r; the call is denied",
                    name,
                    type(verdict).__name__,
                    execution.call_id,
                )
                return f"guard {name} failed: {describe_exception(guard_verdict_error(verdict))}"
        return await self.hooks.guard(execution)

    # -- dispatch: around-dispatch middleware and the body ------------------------------------------------

    async def dispatch(self, staged: Staged) -> Staged:
        """Run the around-dispatch middleware and the body; the result goes to post-execute.

        A call whose signal aborted after :meth:`prepare` (a scheduler may dispatch it
        later) is settled here as a final ``ABORTED_BEFORE_DISPATCH`` result, without
        middleware, body or post-execute: like any call settled before dispatch. A call
        that is not waiting for dispatch (settled by policy, or dispatched already) is
        returned as it is: no caller of the staged interface can run a denied body.
        A second dispatch while the first is still running raises :class:`RuntimeError`
        (a body must never run twice). However it ends (cancelled included), dispatch
        returns only once the body ended, even one a middleware runs in a task of its
        own: a cancellation of the dispatch is passed on to that task, then waited out.
        """
        if staged.kind != "dispatch":
            return staged
        if staged._dispatching:
            raise RuntimeError(f"call {staged.execution.call_id!r} is already being dispatched")
        staged._dispatching = True
        execution = staged.execution
        caller = execution.signal
        if caller.aborted:
            return staged.settle("final-result", _aborted_before_dispatch())
        try:
            chain = self.hooks.around_dispatch(execution)
        except HookFailure as failure:
            return staged.settle("final-result", _hook_failed(failure, execution))
        body_results: list[ToolResult] = []
        # Whether the body runs now, and what a dispatch that settled meanwhile waits on: a
        # middleware may run ``proceed`` in a task of its own and answer before the body ends.
        body_running = False
        body_ended: asyncio.Future[None] | None = None
        body_task: asyncio.Task[object] | None = None

        async def body(call: ToolExecution) -> ToolResult:
            nonlocal body_running, body_task
            # One body per policy decision: a middleware that proceeds twice, or keeps ``proceed``
            # and calls it once the call has settled, must not run the tool again or after its result.
            if staged._proceeded or staged.kind != "dispatch":
                raise RuntimeError(
                    f"call {execution.call_id!r}: proceed() may be called once, while the call is being dispatched"
                )
            staged._proceeded = True
            body_running = True
            body_task = asyncio.current_task()
            try:
                signal = call.signal
                if signal is caller:
                    result = await self._body(staged, caller)
                else:
                    # A middleware's tighter signal is fused with the caller's for this body only:
                    # the fused signal's listeners leave the caller's (a whole run's) signal after it.
                    fused, release = AbortSignal.fuse((caller, signal))
                    try:
                        result = await self._body(staged, fused)
                    finally:
                        release()
            finally:
                body_running = False
                if body_ended is not None and not body_ended.done():
                    body_ended.set_result(None)
            body_results.append(result)
            return result

        proceed: Proceed = body
        for plugin, middleware in reversed(chain):
            proceed = _link(plugin, middleware, proceed)
        failed: ToolResult | None = None
        cancelled: asyncio.CancelledError | None = None
        try:
            result = await proceed(execution)
        except HookFailure as failure:
            failed = _hook_failed(failure, execution)
        except Exception as error:
            failed = error_result(error)
        except asyncio.CancelledError as error:
            cancelled = error  # raised once a body a middleware detached has ended (below)
        finally:
            # ``proceed`` closes with the dispatch, however it ends: cancelled mid-middleware, the
            # call is settled by its caller without a kind change, and a kept ``proceed`` must not
            # run the body after that result.
            staged._proceeded = True
        if body_running:
            # A middleware detached the body (ran ``proceed`` in a task of its own) and settled, or
            # was cut, first: the body is never abandoned. The dispatch ends when the body does
            # (its transport nesting closed), as a body must be quiescent before its call is, and
            # a scheduler frees the call's slot or barrier only then. This call cancelled, the
            # cancellation reaches the body as it would in the dispatch's own task; a second one
            # while waiting is raised after the body ended too.
            body_ended = asyncio.get_running_loop().create_future()
            cut = False
            while not body_ended.done():
                if cancelled is not None and not cut:
                    cut = True
                    if body_task is not None and body_task is not asyncio.current_task():
                        body_task.cancel()
                try:
                    await asyncio.shield(body_ended)
                except asyncio.CancelledError as error:
                    cancelled = cancelled or error
        if cancelled is not None:
            raise cancelled
        if failed is not None:
            return staged.settle("final-result", failed)
        if not isinstance(result, ToolResult):
            return staged.settle(
                "final-result",
                ToolResult.failure(
                    ErrorCode.TOOL_FAILED,
                    f"around-dispatch middleware returned {type(result).__name__}, expected ToolResult",
                ),
            )
        if not body_results or result is not body_results[-1]:
            result = self._normalize_authored(staged, result)
        if caller.aborted and not result.is_error:
            result = (aborted_result if staged._body_invoked else _aborted_before_dispatch)(result.additional_contexts)
        if not staged._body_invoked and result.code == ErrorCode.ABORTED_BEFORE_DISPATCH:
            # Aborted before the body was invoked (the caller's or a middleware's signal): the
            # call never dispatched, so post-execute must not see or rewrite it.
            return staged.settle("final-result", result)
        return staged.settle("post-result", result)

    def _normalize_authored(self, staged: Staged, result: ToolResult) -> ToolResult:
        if result.is_error:
            return result
        execution = staged.execution
        # Checked against the definition the call was judged by, as a body's value would be.
        definition = staged.definition
        if definition is None:
            return ToolResult.failure(ErrorCode.UNKNOWN_TOOL, f'unknown tool "{execution.name}"')
        rebuilt = self._success(definition, execution.arguments, result.value)
        return attrs.evolve(
            rebuilt,
            additional_contexts=result.additional_contexts,
            concludes_turn=result.concludes_turn and not rebuilt.is_error,
        )

    async def _body(self, staged: Staged, fused: AbortSignal) -> ToolResult:
        """Run the body under ``fused``: the caller's signal, or it fused with a middleware's."""
        execution = staged.execution
        caller = execution.signal
        if fused.aborted:
            return _aborted_before_dispatch()
        agent = execution.agent
        if agent is not None and not agent.active:
            return _agent_gone(agent)
        definition = staged.definition
        current = self.registry.resolve_execution(execution.name, execution.agent, execution.nested)
        if current is not definition:
            # Replaced or removed while the call waited (an approval, a pausing middleware): policy judged,
            # and the caller classified, the definition pinned at creation; no other body may run for them.
            return _changed_while_waiting(execution.name, definition, current)
        if definition is None:
            return error_result(UnknownToolError(f'unknown tool "{execution.name}"'))
        context = ToolContext(execution if fused is caller else attrs.evolve(execution, signal=fused))
        staged._body_invoked = True
        # While the transport's body runs, its agent's calls naming this execution as parent are nested.
        close = self.open_nesting(execution.token, agent) if definition is self.registry.transport else None
        try:
            pending = definition.execute(execution.arguments, context)
            if not inspect.isawaitable(pending):
                # A synchronous body (``def``, not ``async def``) has run already; its value cannot be awaited.
                raise ToolError(
                    f'tool "{execution.name}": its execute returned {type(pending).__name__}, not an '
                    "awaitable: define it with async def (or return an awaitable)"
                )
            value = await pending
        except Exception as error:
            result = error_result(error)
        except asyncio.CancelledError:
            if cancellation_requested():
                raise  # this call is being cancelled: its caller settles it
            # Nobody cancelled this call: the body let out the cancellation of something it awaited
            # (a task or future another owner cancelled, or its own subtask on abort). Propagated, it
            # would read as the whole run being interrupted; it is this call's failure (or abort).
            result = (
                aborted_result()
                if fused.aborted
                else ToolResult.failure(
                    ErrorCode.TOOL_FAILED,
                    f'tool "{execution.name}" raised CancelledError, but its call was not '
                    "cancelled (something it awaited was cancelled elsewhere)",
                )
            )
        else:
            result = self._success(definition, execution.arguments, value)
            if context.concludes_turn and not result.is_error:
                result = attrs.evolve(result, concludes_turn=True)
        finally:
            if close is not None:
                close()
        if fused.aborted and not result.is_error:
            result = aborted_result()
        deferred = context.deferred_contexts
        if deferred:
            result = attrs.evolve(result, additional_contexts=deferred + result.additional_contexts)
        return result

    @staticmethod
    def _success(definition: ToolDefinition, arguments: JSON, value: object) -> ToolResult:
        """Normalize a body's value: snapshot, validate against the output schema, render."""
        name = definition.name
        try:
            frozen_value = freeze(value)
        except NotLosslessError as error:
            return error_result(InvalidToolOutputError(f'tool "{name}" returned invalid output: {error}'))
        check = definition.output_check
        found = (
            [] if check is not None and check(frozen_value) else violations(definition.output_validator, frozen_value)
        )
        if found:
            return error_result(
                InvalidToolOutputError(f'tool "{name}" returned invalid output: {format_violations(found)}', found)
            )
        try:
            content = definition.output.render(arguments, frozen_value)
            return ToolResult(content=content, value=frozen_value)
        except Exception as error:
            return error_result(InvalidToolOutputError(f'tool "{name}": output.render failed: {error}'))

    # -- post-execute and finish ----------------------------------------------------------------------------

    async def finalize(self, staged: Staged) -> ToolResult:
        """Run post-execute on a dispatched result, then :meth:`finish`.

        Only a ``post-result`` is post-executed: handed anything else (a denial,
        an abort before dispatch), this is :meth:`finish`, so no caller of the
        staged interface can let a plugin rewrite a result the core settled.
        A second finalize (while the first runs, or once the call is finished) raises
        :class:`RuntimeError` before post-execute: no result is post-executed twice,
        and none is changed after it was emitted.
        """
        assert staged.result is not None
        if staged._finalizing or staged._finished:
            state = "finished" if staged._finished else "being finalized"
            raise RuntimeError(f"execution {staged.execution.call_id!r} was already {state}")
        if staged.kind != "post-result":
            return await self.finish(staged)
        staged._finalizing = True
        execution = staged.execution
        result = staged.result
        try:
            decisions = await self.hooks.post_execute(execution, result)
        except HookFailure as failure:
            staged.result = _hook_failed(failure, execution)
            return await self.finish(staged)
        if decisions:
            result = self._apply_post(staged, result, decisions)
        if execution.signal.aborted and not result.is_error:
            result = (aborted_result if staged._body_invoked else _aborted_before_dispatch)(result.additional_contexts)
        staged.result = result
        return await self.finish(staged)

    def _apply_post(self, staged: Staged, result: ToolResult, decisions: list[tuple[str, PostDecision]]) -> ToolResult:
        blocks = [d for _, d in decisions if d.kind == "block"]
        if blocks:
            feedback = blocks[0].content
            message = text_of(feedback) or "tool result blocked by post-execute policy"
            contexts = tuple(c for d in blocks for c in d.additional_contexts)
            return ToolResult.failure(
                ErrorCode.BLOCKED, message, content=feedback or message, additional_contexts=contexts
            )
        replacements = [(p, d) for p, d in decisions if d.kind != "accept"]
        if len(replacements) > 1:
            plugins = " and ".join(repr(p) for p, _ in replacements)
            return ToolResult.failure(
                ErrorCode.TOOL_FAILED, f"post-execute: conflicting replacements from plugins {plugins}"
            )
        if replacements:
            _, replacement = replacements[0]
            if replacement.kind == "replace-content":
                result = attrs.evolve(result, content=replacement.content)
            elif replacement.kind != "replace-value":  # fail closed: never read an unknown kind as a new value
                return ToolResult.failure(
                    ErrorCode.TOOL_FAILED,
                    f"post-execute: plugin {replacements[0][0]!r} "
                    f"returned a decision of unknown kind "
                    f"{replacement.kind!r}",
                )
            elif result.is_error:
                return ToolResult.failure(
                    ErrorCode.TOOL_FAILED, "post-execute cannot replace the value of a failed result"
                )
            else:
                # The definition whose body produced the result (a successful result had one).
                execution = staged.execution
                definition = staged.definition
                if definition is None:
                    return ToolResult.failure(ErrorCode.UNKNOWN_TOOL, f'unknown tool "{execution.name}"')
                rebuilt = self._success(definition, execution.arguments, replacement.value)
                if rebuilt.is_error:
                    return rebuilt
                result = attrs.evolve(
                    rebuilt, additional_contexts=result.additional_contexts, concludes_turn=result.concludes_turn
                )
        contexts = tuple(c for _, d in decisions for c in d.additional_contexts)
        if contexts:
            result = attrs.evolve(result, additional_contexts=result.additional_contexts + contexts)
        return result

    def finish_cancelled(self, staged: Staged) -> asyncio.Future[ToolResult]:
        """Finish a call whose caller was cancelled before it finished it; the future of its result.

        Its result becomes ``ABORTED`` if its body was invoked, else ``ABORTED_BEFORE_DISPATCH``,
        and :meth:`finish` emits it in a task of its own, which a further cancellation of the
        caller cannot cut: the call still has its one result event. A call already finished
        (or being finished) keeps its result, and the future is done already.
        """
        if staged._finished:
            assert staged.result is not None
            done: asyncio.Future[ToolResult] = asyncio.get_running_loop().create_future()
            done.set_result(staged.result)
            return done
        staged.result = aborted_result() if staged._body_invoked else _aborted_before_dispatch()
        return asyncio.ensure_future(self.finish(staged))

    async def finish(self, staged: Staged) -> ToolResult:
        """Apply the captured finalizer, materialize, and emit the one result event."""
        if staged._finished:
            raise RuntimeError(f"execution {staged.execution.call_id!r} was already finished")
        staged._finished = True
        assert staged.result is not None
        result = staged.result
        name = staged.execution.name
        # Materialize: no result whose content cannot be read (a block altered around its checks) is
        # emitted; checked before the finalizer too, so that it never sees such content.
        problem = content_problem(result.content)
        if problem is not None:
            result = _invalid_content(f'tool "{name}" produced invalid content: {problem}')
        finalizer = staged._finalizer
        if finalizer is not None:
            try:
                replaced = finalizer(staged.execution, result)
            except Exception as error:
                result = ToolResult.failure(ErrorCode.TOOL_FAILED, f"finalize_content failed: {error}")
            else:
                if replaced is not None:
                    result = _finalized(name, result, replaced)
        staged.result = result
        await self.hooks.tool_result(staged.execution, result)
        return result


def _changed_while_waiting(name: str, judged: ToolDefinition | None, current: ToolDefinition | None) -> ToolResult:
    """The result of a call whose tool changed under its name after it was created: no body runs.

    Removed (or hidden from the caller), it is ``UNKNOWN_TOOL``, as a call made now would be.
    Replaced (or registered where there was none), the new definition was judged by no policy
    and classified by no caller: ``ABORTED_BEFORE_DISPATCH``, as the call may simply be made again.
    """
    if current is None:
        return error_result(UnknownToolError(f'unknown tool "{name}": it was removed while the call waited'))
    change = "replaced" if judged is not None else "registered"
    return ToolResult.failure(
        ErrorCode.ABORTED_BEFORE_DISPATCH,
        f'{ABORTED_BEFORE_DISPATCH_MESSAGE}: tool "{name}" was {change} while the call '
        "waited, and its new definition was not judged by this call's policy; call it again",
    )


def _invalid_content(message: str) -> ToolResult:
    return error_result(InvalidToolOutputError(message))


def _finalized(name: str, result: ToolResult, replaced: object) -> ToolResult:
    """``result`` with the content a finalizer returned, or ``INVALID_TOOL_OUTPUT`` if it is not content."""
    try:
        result = attrs.evolve(result, content=_blocks(replaced))
    except Exception as error:
        problem: str | None = describe_exception(error)
    else:
        problem = content_problem(result.content)
    if problem is None:
        return result
    return _invalid_content(f'tool "{name}": finalize_content returned invalid content: {problem}')


def _blocks(value: object) -> tuple[ContentBlock, ...]:
    if isinstance(value, str):
        return (TextBlock(value),)
    return tuple(value)  # type: ignore[arg-type]


def check_approval_timeout(value: object) -> float | None:
    """``value`` as the approval timeout in seconds: ``None`` (no timeout) or a positive, finite number."""
    if value is None:
        return None
    if not is_positive_seconds(value):
        raise ValueError(f"approval_timeout_s must be a positive, finite number of seconds, got {value!r}")
    return float(value)  # type: ignore[arg-type]  # a number: is_positive_seconds said so


def _approval_denial(name: str, outcome: ApprovalOutcome, reason: str | None) -> str:
    if outcome is ApprovalOutcome.REJECTED:
        return f'the user rejected tool "{name}"'
    if outcome is ApprovalOutcome.CANCELLED:
        return f'approval for tool "{name}" was cancelled'
    text = f'tool "{name}" requires approval, but no approval channel is available'
    return f"{text} ({reason})" if reason else text


def _link(plugin: str, middleware: Middleware, proceed: Proceed) -> Proceed:
    async def step(call: ToolExecution) -> ToolResult:
        try:
            return await middleware(call, proceed)
        except (HookFailure, AbortedError):
            raise  # an inner middleware's failure, already named; an abort keeps its meaning
        except (Exception, asyncio.CancelledError) as error:
            if own_cancellation(error):
                raise  # this call is being cancelled: its caller settles it
            # Otherwise the middleware let out the cancellation of something it awaited: its failure.
            raise HookFailure("dsh_around_dispatch", plugin, error) from error

    return step


def _hook_failed(failure: HookFailure, execution: ToolExecution) -> ToolResult:
    """The error result of a raising hook implementation, logged with the plugin and its traceback."""
    log.warning(
        "%s of plugin %r failed on call %r (tool %r)",
        failure.hook,
        failure.plugin,
        execution.call_id,
        execution.name,
        exc_info=failure.original,
    )
    return error_result(failure)
