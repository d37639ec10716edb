"""The per-call pipeline: pre-execute, approval, guards, around-dispatch, post-execute, observers.

The core runs the stages in a fixed order::

    create -> pre-execute -> approval (on ask) -> guards -> around-dispatch -> body
           -> post-execute -> finalize -> materialize -> emit (tool result observers)

Plugins add behaviour inside a stage; they cannot reorder or skip stages.
Materialize checks the content of every result before it is emitted: a
result whose blocks are not well-formed (a ``TextBlock`` whose ``text`` is
not a ``str``) is replaced by an ``INVALID_TOOL_OUTPUT`` error naming the
tool, so no observer or caller ever receives content it cannot read.
Every hook here is scope-filtered (see the package docstring). Where a
raising implementation becomes an error result (pre-execute, guard,
around-dispatch, post-execute), the message reads ``<hook> of plugin
'<name>' failed: <Type>: <text>`` and the traceback is logged as a
warning. A ``DshError`` raised by pre-execute, around-dispatch or
post-execute keeps its own code and message; a guard is the exception: it
fails closed, so whatever it raises (a ``DshError`` too) denies the call
(``DENIED``) with that wrapped message.
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from typing import TYPE_CHECKING

from dsh_hookspecs import hookspec

if TYPE_CHECKING:
    from dsh_core.codemode.history import CodeDispatchLog
    from dsh_core.model import (
        ApprovalOutcome,
        ApprovalRequest,
        ContentBlock,
        Middleware,
        PostDecision,
        PreDecision,
        ToolExecution,
        ToolResult,
    )


@hookspec
def dsh_pre_execute(execution: ToolExecution) -> PreDecision | Awaitable[PreDecision | None] | None:
    """Vote on a call before it runs: allow, deny (with a reason) or ask a person.

    Called for every call that passed creation (valid lossless arguments,
    not collapsed), including calls of names no layer registers (they fail
    later, at dispatch). ``None`` abstains.

    Aggregation: implementations are consulted in call order until one
    denies; the first ``deny`` wins at once and later implementations are not
    called (to see every call, observe ``dsh_tool_result``). Without a deny,
    any ``ask`` asks, else the call is allowed. Raising an exception settles
    the call as a ``TOOL_FAILED`` error result (a ``DshError`` keeps its
    code) without post-execute. So does returning anything the core does
    not recognise (not a ``PreDecision``, or one whose kind is not exactly
    ``allow``, ``deny`` or ``ask``, or whose reason is not a ``str``): the
    call fails closed, naming the plugin, and is never allowed.

    An awaitable vote is awaited to its end, not raced against the call's
    abort signal (as approval is): a hook that waits on anything slow (a
    remote policy service) should honour ``execution.signal`` itself, or an
    aborted call waits for it. A call aborted meanwhile is never dispatched:
    it settles after the policy stages, as ``ABORTED_BEFORE_DISPATCH`` unless
    one of them denied it first.
    """


@hookspec(firstresult=True)
def dsh_approve(request: ApprovalRequest) -> ApprovalOutcome | Awaitable[ApprovalOutcome | None] | None:
    """Resolve an ``ask``: return ``allowed``, ``rejected``, ``cancelled`` or ``unavailable``.

    First result wins: an approval channel that does not handle the request
    returns ``None`` and the next channel is tried; with no answer the outcome
    is ``unavailable``. A channel that needs to wait (a person at a terminal)
    returns an awaitable from a *plain* function: the conformance kit refuses
    ``async def`` on a first-result hook, since pluggy's own first-result call
    would take its coroutine (never ``None``) as the answer. (dsh calls this
    hook itself and awaits before it tests for ``None``, so an ``async def``
    channel still abstains correctly at run time.)
    ``request.signal`` aborts with the call: stop asking and return
    ``cancelled``.

    ``allowed`` continues to the guards; ``rejected``, ``cancelled`` and
    ``unavailable`` deny (``DENIED``) with a message naming the tool; only
    ``unavailable``'s quotes the ask's reason (a cancelled approval of an
    aborted call gives ``ABORTED_BEFORE_DISPATCH``). Raising counts as
    ``unavailable``, and so does an answer that is not an outcome (``True``,
    ``"ALLOWED"``): it is logged with the plugin's name and never allows.
    """


@hookspec
def dsh_approval_resolved(request: ApprovalRequest, outcome: ApprovalOutcome) -> None:
    """Observe how an approval request was resolved, whichever channel answered (or none).

    Called once per ``ask``, after the outcome is known and before the call
    goes on (``allowed``) or is denied; ``unavailable`` is reported too. Use it
    to record approvals (the agent loop writes them to the session). Return
    value ignored; exceptions are contained and logged, never changing the
    outcome. Cancelled while awaiting one observer, the later ones are still
    notified (as for ``dsh_tool_result``).
    """


@hookspec
def dsh_guard(execution: ToolExecution) -> str | Awaitable[str | None] | None:
    """A monotonic guard: return a denial reason (``str``) to deny, ``None`` to pass.

    Guards run after an allow, registry guards first (global layer, then the
    agent's scope chain), then these implementations in call order. The first
    denial wins and nothing later can allow. Raising denies (fail closed):
    the result is ``DENIED`` whatever was raised (a ``DshError``'s own code is
    not kept), and the reason names the plugin and the exception. Returning
    anything else that is not ``None`` (``False``, a dict) denies too, with a
    reason naming the plugin and what it returned; a blank reason (``""``)
    denies, and the reason given names the plugin.

    As with ``dsh_pre_execute``, an awaitable verdict is awaited to its end,
    not raced against the call's abort signal: honour ``execution.signal``
    in a guard that may wait.
    """


@hookspec
def dsh_around_dispatch(execution: ToolExecution) -> Middleware | None:
    """Return middleware ``async (execution, proceed) -> ToolResult`` to wrap the body.

    The core composes the middleware of all implementations: the first one
    in call order is the outermost. ``await proceed(execution)`` runs the rest
    of the chain and then the body; a middleware may pass
    ``attrs.evolve(execution, signal=...)`` to add a tighter abort signal (it
    is fused with the caller's, which can never be detached) but cannot change
    the tool, its arguments or identity: the body always runs the call that
    passed policy, at most once: ``proceed`` raises if called again or after
    the call settled. It runs the definition the call was created with, the
    one policy judged (:attr:`dsh_core.runtime.Staged.definition`): a tool
    replaced under its name since (while an approval or a middleware waited)
    runs no body; ``proceed`` returns ``ABORTED_BEFORE_DISPATCH`` (the call
    may be made again, and is not post-executed), or ``UNKNOWN_TOOL`` for a
    tool removed. A middleware may also return a result without proceeding.
    A successful result it built itself (not the one ``proceed`` returned) is
    treated like a body's value: its ``value`` is checked against the tool's
    output schema (``INVALID_TOOL_OUTPUT`` if it fails) and its content is
    rendered anew from that value, so the ``content`` it carried is dropped
    (to change what the model reads, use ``dsh_post_execute``
    ``replace_content``). Returning anything but a ``ToolResult`` gives
    ``TOOL_FAILED``.
    A call whose signal is already aborted when it is dispatched gets no
    middleware: it settles as ``ABORTED_BEFORE_DISPATCH`` without post-execute.
    A middleware that raises settles the call as ``TOOL_FAILED`` (a
    ``DshError`` keeps its code; an ``AbortedError`` gives ``ABORTED``)
    without post-execute. Returning ``None`` adds no middleware.
    """


@hookspec
def dsh_post_execute(
    execution: ToolExecution, result: ToolResult
) -> PostDecision | Awaitable[PostDecision | None] | None:
    """Decide about a result: accept, replace its value or content, or block it.

    Called for every dispatched call, failed ones included (an unknown name,
    a raising body, a middleware's own result). Never called for a call
    settled before dispatch (denied by pre-execute, approval or a guard,
    aborted before dispatch, collapsed, invalid arguments): a post-execute
    plugin cannot rewrite a denial the model reads. ``None`` accepts. Aggregation: any ``block``
    wins (the first block in call order: the result becomes a ``BLOCKED``
    error whose content is its feedback; only the contexts of block decisions
    survive); otherwise at most one replacement may be made (two are an error
    result naming the conflict); ``replace-value`` on a failed result, or a
    replaced value that fails the output schema, is an error result; the
    contexts of all decisions are appended in call order. Raising gives a
    ``TOOL_FAILED`` error result (a ``DshError`` keeps its code), and so does
    returning anything the core does not recognise (not a ``PostDecision``,
    or one whose kind is not exactly ``accept``, ``replace-value``,
    ``replace-content`` or ``block``): the message names the plugin.
    Replacement content or block feedback that is not well-formed content
    blocks (altered after it was built, around the block checks) gives an
    ``INVALID_TOOL_OUTPUT`` error result naming the plugin and the tool.
    """


@hookspec
def dsh_tool_result(execution: ToolExecution, result: ToolResult) -> None:
    """Observe the final result of every execution, nested ones included, exactly once.

    ``execution`` is frozen; for a nested call ``execution.parent`` is only an
    opaque token. Return value ignored; exceptions are contained and logged as
    warnings, never affecting the result or other observers. An awaitable
    returned is awaited before the next observer is called; if the caller is
    cancelled meanwhile, that awaitable is cancelled, every later observer is
    still notified, and the cancellation goes on after the last one.
    """


@hookspec
def dsh_code_dispatch_log(dispatch: CodeDispatchLog) -> Sequence[ContentBlock] | None:
    """Reshape the *durable* copy of one nested ``run_code`` sub-result before it is logged.

    Only the session's ``tool/code-dispatch`` event sees the returned blocks;
    the program and the model are unaffected. The first non-``None`` return in
    call order is used. A raising implementation is contained and the original
    content is logged.
    """
