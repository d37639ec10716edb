"""The reserved ``run_code`` transport: one tool whose body runs a program that calls the others.

``run_code`` takes two required strings, ``code`` (the body of an async
function in the runtime's language) and ``description`` (the UI title; must
be non-empty after trimming), and returns ``{"logs": [str], "result"?: json}``.
The model sees the logs joined by newlines, then the result (a string raw,
anything else pretty-printed iteratively, so deep values render), or the
fixed placeholder :data:`NO_OUTPUT` when both are empty. A failed run is an
error result with code ``CODE_RUN_FAILED`` carrying the kind, the message and
the captured logs. It declares no ``is_concurrency_safe``: it is exclusive.

Every call the program makes goes back through the same
:class:`~dsh_core.runtime.ToolRuntime` (see :meth:`RunCodeTransport._execute`
and :mod:`dsh_core.codemode.scheduler`): same agent, the outer
``root_call_id``, the outer execution's opaque token as ``parent`` (which only
lets the call past the model-direct collapse) and an abort signal of its own,
aborted with the run's or when the program cancels the call. The
program's namespace is a fixed snapshot of the scope's visible tools
(``run_code`` excluded) taken when the program starts.

The transport depends only on the :mod:`dsh_core.coderuntime.seam` names, so
any :class:`~dsh_core.coderuntime.seam.CodeRuntime` works (the worker-process
backend, or an in-process fake in tests).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any, Final

import attrs

from dsh_core.abort import AbortController, AbortSignal
from dsh_core.codemode.history import DispatchHistory
from dsh_core.codemode.scheduler import (
    DEFAULT_MAX_PARALLEL_SUB_CALLS,
    ProgramScheduler,
    SubCall,
    SubCallError,
    check_max_parallel,
)
from dsh_core.coderuntime import (
    BindingNamespace,
    CodeRunResult,
    CodeRuntime,
    ErrorClassSpec,
    current_run,
)
from dsh_core.define import define_tool
from dsh_core.errors import CodeRunFailedError, InvalidArgsError, ToolError
from dsh_core.lossless import JSON, NotLosslessError, dumps, freeze, thaw
from dsh_core.model import TextBlock, ToolContext, ToolDefinition, ToolExecutionInput, ToolResult
from dsh_core.registry import TRANSPORT_NAME
from dsh_core.runtime import ToolRuntime

log = logging.getLogger("dsh")
__all__ = [
    "NO_OUTPUT",
    "FLAVORS",
    "RunCodeTransport",
    "RunRecord",
    "CallRecord",
    "CodeRuntimeRef",
    "resolve_code_runtime",
    "render_run_output",
    "pretty_json",
    "present_call",
    "RUN_CODE_PARAMETERS",
    "RUN_CODE_OUTPUT",
]

#: What the model reads when a program printed nothing and returned nothing.
NO_OUTPUT: Final = "(run_code completed with no output)"

#: A code runtime, a zero-argument function returning one (or ``None``), or ``None``.
CodeRuntimeRef = CodeRuntime | Callable[[], "CodeRuntime | None"] | None

_DESCRIPTION_TEXT: Final = (
    "A short active-voice summary of what the program does, 5-10 words, shown to the user as the "
    'title of this step (e.g. "Count TODO comments in the source tree", "Read both configs and compare them").'
)

#: Language-dependent wording of the schema, keyed by ``CodeRuntime.language`` (own keys only).
FLAVORS: Final[Mapping[str, Mapping[str, str]]] = {
    "python": {
        "description": (
            "Execute a Python program that calls the available tools. The code is the body of an "
            "`async def` (top-level `await` and `return` work). Call tools as `await tools.name({...})` "
            "or `await tools.name(key=value)`; see the SDK in the system prompt. Independent calls may "
            "run together with `asyncio.gather`. A failed call raises `ToolCallError`. Only what you "
            "`print(...)` and/or `return` is program output: curate it; intermediate tool results stay "
            "out of the conversation."
        ),
        "code": (
            "The body of an async Python function: statements, with top-level `await` and `return`. "
            "Runs in a fresh sandboxed worker; `tools` and `ToolCallError` are predefined."
        ),
    },
    "typescript": {
        "description": (
            "Execute a TypeScript program that calls the available tools. The code is the body of an "
            "async function (erasable syntax only; top-level await and return work). Call tools as "
            "`await tools.name(args)`; see the SDK in the system prompt. Independent calls may run "
            "together with `Promise.all`. A failed call rejects with `ToolCallError`. Only what you "
            "`console.log` and/or `return` is program output: curate it; intermediate tool results "
            "stay out of the conversation."
        ),
        "code": (
            "The body of an async TypeScript function (erasable syntax only); `tools` and "
            "`ToolCallError` are predefined."
        ),
    },
}

#: The static parameter schema used to validate arguments (wording aside, it never changes).
RUN_CODE_PARAMETERS: Final[Mapping[str, Any]] = {
    "type": "object",
    "properties": {
        "code": {"type": "string"},
        "description": {"type": "string"},
    },
    "required": ["code", "description"],
    "additionalProperties": False,
}

#: The output schema: ``{logs: [str], result?: json}``, closed.
RUN_CODE_OUTPUT: Final[Mapping[str, Any]] = {
    "type": "object",
    "properties": {"logs": {"type": "array", "items": {"type": "string"}}, "result": {}},
    "required": ["logs"],
    "additionalProperties": False,
}

#: Indentation of pretty-printed results stops growing at this many characters; deeper
#: levels are printed compact, so a deep value cannot blow up the model's context with spaces.
_MAX_INDENT: Final = 10


def resolve_code_runtime(ref: CodeRuntimeRef) -> CodeRuntime | None:
    """The runtime ``ref`` names now: itself, what its factory returns, or ``None``."""
    if ref is None:
        return None
    # Not isinstance(ref, CodeRuntime): a runtime-checkable protocol probes its properties, and
    # reading ``isolation`` may start a worker just to describe it.
    if callable(getattr(type(ref), "run", None)):
        return ref  # type: ignore[return-value]
    return ref()  # type: ignore[operator]


def flavor_for(runtime: CodeRuntime | None) -> Mapping[str, str]:
    """The schema wording for ``runtime``'s language; Python without a runtime; unknown languages raise."""
    language = "python" if runtime is None else runtime.language
    flavor = FLAVORS.get(language) if isinstance(language, str) else None
    if flavor is None:
        known = ", ".join(f'"{name}"' for name in FLAVORS)
        raise ValueError(f'dsh: no run_code schema flavor for code runtime language "{language}" (known: {known})')
    return flavor


# -- rendering --------------------------------------------------------------------------------------


def pretty_json(value: JSON) -> str:
    """Indented JSON, iteratively (no recursion limit); indentation stops growing at 10 characters.

    Keys keep their order; non-ASCII text is kept as is. Deeper levels than the
    indentation cap are still broken into lines, just without more indentation.
    """
    return dumps(value, indent=2, max_indent=_MAX_INDENT)


def render_run_output(args: JSON, value: JSON) -> list[TextBlock]:
    """The model-facing text of a completed run: logs, then the result, or :data:`NO_OUTPUT`."""
    parts: list[str] = []
    logs = value.get("logs", []) if isinstance(value, dict) else []
    if logs:
        parts.append("\n".join(logs))
    if isinstance(value, dict) and "result" in value:
        result = value["result"]
        parts.append(result if isinstance(result, str) else pretty_json(result))
    text = "\n".join(part for part in parts if part)
    return [TextBlock(text or NO_OUTPUT)]


def present_call(args: Mapping[str, Any]) -> dict[str, Any]:
    """How a UI shows a ``run_code`` call: a generic card titled by the description, input the code."""
    return {
        "card": "generic",
        "title": args.get("description", ""),
        "kind": "execute",
        "raw_input": args.get("code", ""),
    }


# -- observation (the CLI's view of a run) ----------------------------------------------------------


@attrs.define
class CallRecord:
    """One committed nested call: what ``dsh run-code --json`` lists under ``calls``."""

    sub_call_id: str
    name: str
    args: JSON
    ok: bool
    error_code: str | None


@attrs.define
class RunRecord:
    """What a watcher learns about one ``run_code`` execution: its run result and its nested calls."""

    run: CodeRunResult | None = None
    calls: list[CallRecord] = attrs.field(factory=list)


# -- the transport ------------------------------------------------------------------------------------


class RunCodeTransport:
    """Builds the ``run_code`` definition and executes it against one tool runtime.

    ``tools`` is the :class:`ToolRuntime` nested calls re-enter (or a
    zero-argument function returning it, since the registry that the runtime
    wraps is built with this transport); ``code_runtime`` is the
    :class:`CodeRuntime` (or a factory, resolved at each projection and each
    run). ``max_parallel_sub_calls`` is validated positive.
    """

    def __init__(
        self,
        tools: ToolRuntime | Callable[[], ToolRuntime],
        code_runtime: CodeRuntimeRef,
        *,
        max_parallel_sub_calls: int = DEFAULT_MAX_PARALLEL_SUB_CALLS,
    ) -> None:
        self._tools = tools
        self._code_runtime = code_runtime
        self.max_parallel_sub_calls = check_max_parallel(max_parallel_sub_calls)
        self._watches: dict[str, RunRecord] = {}

    @property
    def tools(self) -> ToolRuntime:
        """The tool runtime nested calls re-enter."""
        return self._tools if isinstance(self._tools, ToolRuntime) else self._tools()

    def code_runtime(self) -> CodeRuntime | None:
        """The code runtime, resolved now."""
        return resolve_code_runtime(self._code_runtime)

    def definition(self) -> ToolDefinition:
        """The ``run_code`` definition, worded for the code runtime's language as it is now.

        The registry asks for it on first need (its first projection) and keeps
        it. A language with no flavor raises, so the projection fails loudly;
        with no runtime the Python wording is used and execution reports the
        missing runtime as an error result.
        """
        flavor = flavor_for(self.code_runtime())
        parameters = {
            **RUN_CODE_PARAMETERS,
            "properties": {
                "code": {"type": "string", "description": flavor["code"]},
                "description": {"type": "string", "description": _DESCRIPTION_TEXT},
            },
        }
        return define_tool(
            name=TRANSPORT_NAME,
            description=flavor["description"],
            parameters=parameters,
            execute=self._execute,
            output_schema=RUN_CODE_OUTPUT,
            render=render_run_output,
        )

    @contextlib.contextmanager
    def watch(self, call_id: str) -> Iterator[RunRecord]:
        """Record the run result and nested calls of the ``run_code`` call ``call_id`` while held."""
        record = RunRecord()
        self._watches[call_id] = record
        try:
            yield record
        finally:
            self._watches.pop(call_id, None)

    # -- execution --------------------------------------------------------------------------------------

    async def _execute(self, args: JSON, ctx: ToolContext) -> JSON:
        description = args.get("description")
        if not isinstance(description, str) or not description.strip():
            raise InvalidArgsError("invalid description: expected a non-empty string")
        execution = ctx.execution
        tools = self.tools
        code_runtime = self.code_runtime()
        if code_runtime is None:
            mode = tools.registry.mode_for(execution.agent)
            raise ToolError(
                f'mode "{mode}" requires a code runtime, but none is available: configure '
                '[code_runtime] or set the tools mode to "native"'
            )
        record = self._watches.get(execution.call_id)

        # The run gets its own controller: the outer signal aborts it with the same reason, and
        # settlement aborts it ("run_code settled") so late or queued calls are refused.
        run = AbortController()
        call_id = execution.call_id

        def abort_run(reason: object) -> None:
            _abort_run(run, reason, call_id)

        unlisten = execution.signal.add_listener(abort_run)
        history = DispatchHistory(
            tools.hooks, execution.agent, root_call_id=execution.root_call_id, parent_call_id=execution.call_id
        )
        on_commit = None
        if record is not None:
            calls = record.calls

            def on_commit(call: SubCall, result: ToolResult) -> None:
                calls.append(
                    CallRecord(call.sub_call_id, call.name, thaw(call.logged), not result.is_error, result.code)
                )

        scheduler = ProgramScheduler(
            tools,
            signal=run.signal,
            history=history,
            context=ctx,
            max_parallel_sub_calls=self.max_parallel_sub_calls,
            on_commit=on_commit,
        )
        # The namespace is fixed now: a tool registered later is not added; a tool removed later keeps
        # its name and fails as UNKNOWN_TOOL when dispatch re-resolves the live registry.
        names = [definition.name for definition in tools.registry.definitions(execution.agent)]
        counter = itertools.count(1)
        keeps_records = history.enabled or record is not None
        functions = {name: _binding(name, execution, run.signal, scheduler, counter, keeps_records) for name in names}
        namespace = BindingNamespace("tools", functions, ErrorClassSpec(name="ToolCallError", member="tool_name"))
        cancelled = False
        try:
            outcome = await code_runtime.run(args["code"], [namespace], signal=run.signal)
        except asyncio.CancelledError:
            cancelled = True
            raise
        finally:
            try:
                abort_run("run_code cancelled" if cancelled else "run_code settled")
                if cancelled:  # as a native call's body would be: cut, not waited for
                    scheduler.cancel_bodies()
                await _quiesce(scheduler.drain(), on_cancel=scheduler.cancel_bodies)
            finally:
                unlisten()
        if record is not None:
            record.run = outcome
        if outcome.error is not None:
            raise CodeRunFailedError(outcome.error.kind, outcome.error.message, outcome.logs)
        value: dict[str, JSON] = {"logs": list(outcome.logs)}
        if outcome.has_value:
            value["result"] = outcome.value
        return value


def _binding(
    name: str,
    execution: Any,
    signal: AbortSignal,
    scheduler: ProgramScheduler,
    counter: Iterator[int],
    keeps_records: bool,
) -> Callable[[JSON], asyncio.Future[JSON]]:
    """The host function behind ``tools.<name>``: snapshot, number, queue; the future settles at commit.

    A plain function: the code runtime calls it as the program's call arrives and
    awaits the scheduler's future, with no task per call (the scheduler owns the tasks).
    The code runtime cancels that future when the program cancels the call: the
    scheduler then stops the call (see :mod:`dsh_core.codemode.scheduler`).
    """
    call_id = execution.call_id

    def call(args: JSON) -> asyncio.Future[JSON]:
        if signal.aborted:
            raise SubCallError(f"run_code run is over ({signal.reason}); {name} not dispatched")
        if args is None:
            raise SubCallError(f"tool arguments must be a JSON object; pass {{}} to call {name} without arguments")
        try:
            # Two independent snapshots: one is dispatched, the other is what the log keeps, so a
            # tool that mutates what it received cannot change the durable record. Nothing keeps
            # a record without a sink or a watcher, so then the second walk is skipped.
            dispatched = freeze(args)
            logged = freeze(args) if keeps_records else dispatched
        except NotLosslessError as error:
            raise SubCallError(f"tool arguments must be lossless JSON: {error}") from None
        if scheduler.run_control is None:
            scheduler.run_control = current_run()
        # The call's own signal: the scheduler aborts it with the run's, and also
        # alone when the program cancels the call.
        abort = AbortController()
        request = ToolExecutionInput(
            call_id=f"{call_id}:code:{next(counter)}",
            name=name,
            arguments=dispatched,
            signal=abort.signal,
            agent=execution.agent,
            parent=execution.token,
            root_call_id=execution.root_call_id,
        )
        return scheduler.submit(request, logged, abort)

    call.__name__ = call.__qualname__ = f"tools.{name}" if name.isidentifier() else f"tools[{name!r}]"
    return call


def _abort_run(run: AbortController, reason: object, call_id: str) -> None:
    """Abort the run; an abort listener's error is logged, never the run's outcome.

    The run's signal reaches the scheduler's listener, which aborts each call's own
    signal (and so the nested tools' listeners): one that raises must not stop the
    settlement's drain, replace what the program produced, or reach whoever aborted
    the outer call.
    """
    try:
        run.abort(reason)
    except Exception as error:
        log.warning(
            "run_code %r: an abort listener of a nested call failed (abort reason: %s); the run settles as usual",
            call_id,
            reason,
            exc_info=error,
        )


async def _quiesce(work: Awaitable[None], on_cancel: Callable[[], None]) -> None:
    """Await ``work`` to completion even if this task is cancelled meanwhile; then re-raise the cancel.

    ``on_cancel`` runs at each cancellation (it cuts the nested bodies ``work`` waits for),
    so cancelling a run that is draining, after its abort, ends it without waiting for a
    body that ignores its signal.
    """
    task = asyncio.ensure_future(work)
    cancelled = False
    while True:
        try:
            await asyncio.shield(task)
            break
        except asyncio.CancelledError:
            # Held back even if ``work`` ended meanwhile (it may end in the same loop turn as the
            # cancel arrives): a swallowed cancellation would leave the caller's task running on.
            cancelled = True
            if task.done():
                break
            on_cancel()
    if cancelled:
        raise asyncio.CancelledError
