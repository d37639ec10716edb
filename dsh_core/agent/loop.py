"""The agent loop: model turn → tool calls through the runtime → model turn … until it stops.

One step: assemble the system prompt (:class:`~dsh_core.prompt.PromptAssembler`),
send the agent's wire schemas (:meth:`~dsh_core.registry.ToolRegistry.wire_schemas`)
with the history to the provider, and run the assistant's tool calls
model-direct (no parent token) through :class:`~dsh_core.runtime.ToolRuntime`.
Calls the runtime classifies ``parallel`` overlap with their parallel
neighbours; an ``exclusive`` call waits for the running ones and runs alone
(each call is classified when its turn comes, after the calls before it ended).
The calls of a parallel batch run their policy (pre-execute, approval, guards)
side by side, and each is classified again once its policy answered, as the
Code Mode scheduler does, by the definition its policy judged (the runtime pins
it when the call is created; a tool replaced after that runs no body, see
:attr:`~dsh_core.runtime.Staged.definition`): one that is exclusive now waits
for the bodies in flight and runs its body and post-execute alone. Results go back to
the model in call order as ``tool`` messages, followed by the results'
additional contexts as user messages. A call's result text and
its context messages share one budget, the agent's ``max_tool_result_chars``:
what does not fit reaches the model as its head and tail around a marker
(:func:`~dsh_core.agent.resultcap.cap_call_texts`); the ``tool/result`` and
context ``message/user`` events keep the whole text as ``content`` and what the
model saw as ``message``, which is what a resumed run replays.

The loop stops on a final answer (no tool calls), a result that
``concludes_turn``, the turn limit, an abort, a provider error or any other
exception (reason ``error``, the message naming its type unless it is a
:class:`~dsh_core.errors.DshError`), and always records why (a ``run/end``
event and :attr:`RunResult.reason`). Cancelled from outside, it records
``run/end`` (``aborted``, error ``cancelled``) and lets the cancellation
propagate.

Every run gets its own scope, a child of the agent's scope: model-direct
executions carry it as ``agent`` (so tools, modes, restrictions and scoped
hooks are the agent's), and it provides the run's
:class:`~dsh_core.sessions.recorder.SessionRecorder` as the ``session``
service for the Code Mode transport's nested-dispatch events.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping, Sequence
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Final, TypeVar, cast

from attrs import define, frozen

import dsh_core
from dsh_core.abort import AbortSignal
from dsh_core.agent.provider import Message, OnText, Provider, ProviderError, normalize_assistant
from dsh_core.agent.resultcap import DEFAULT_MAX_TOOL_RESULT_CHARS, cap_call_texts
from dsh_core.errors import ConfigError, DshError, ErrorCode
from dsh_core.hooks import Hooks
from dsh_core.lossless import JSON, NotLosslessError, freeze
from dsh_core.model import (
    ApprovalOutcome,
    ApprovalRequest,
    ExecutionMode,
    PromptContext,
    PromptSection,
    ToolExecutionInput,
    ToolResult,
)
from dsh_core.prompt import CoreSection, PromptAssembler
from dsh_core.registry import ToolRegistry
from dsh_core.runtime import ToolRuntime
from dsh_core.scope import Scope
from dsh_core.sessions.events import EventKind, NewEvent, SessionEvent
from dsh_core.sessions.lease import SessionLease
from dsh_core.sessions.recorder import SESSION_SERVICE, SessionRecorder
from dsh_core.sessions.store import SessionStore, check_lease_aware, dsh_home, open_store

if TYPE_CHECKING:
    from dsh_core.harness import Harness

__all__ = [
    "StopReason",
    "RunResult",
    "ToolCallRecord",
    "LoopObserver",
    "Approver",
    "AgentLoop",
    "run_agent",
    "history_from_events",
    "DEFAULT_MAX_TURNS",
    "DEFAULT_MAX_TOOL_RESULT_CHARS",
    "PROMPT_SERVICE",
    "open_session_store",
    "core_sections_of",
]

_F = TypeVar("_F", bound=Callable[..., Any])

log = logging.getLogger("dsh")
# The marker is typed for mypy here, so decorated methods keep their signatures.
_hookimpl = cast(Callable[[_F], _F], dsh_core.hookimpl)

#: The turn limit of an agent whose row sets no ``max_turns``.
DEFAULT_MAX_TURNS: Final = 50
#: Root-scope service key of the deployment's :class:`PromptAssembler` (``dsh_core.boot`` provides one whose
#: core sections are Code Mode's ``tools:code-only`` and ``tools:sdk``); the loop reuses its core sections.
PROMPT_SERVICE: Final = "prompt"

#: Answers an approval request for a call of this run; ``None`` lets the next channel answer.
Approver = Callable[[ApprovalRequest], Awaitable[ApprovalOutcome | None]]


class StopReason(StrEnum):
    """Why a run stopped."""

    FINAL_ANSWER = "final-answer"
    CONCLUDES_TURN = "concludes-turn"
    TURN_LIMIT = "turn-limit"
    ABORTED = "aborted"
    PROVIDER_ERROR = "provider-error"
    ERROR = "error"


@frozen
class RunResult:
    """The outcome of one run: why it stopped, the answer (if any) and the full history."""

    reason: StopReason
    answer: str | None
    turns: int
    messages: tuple[Message, ...]
    session_id: str | None = None
    error: str | None = None
    #: Characters of each model request (system prompt, history and tool schemas as JSON), in order.
    request_chars: tuple[int, ...] = ()
    #: The ``finish_reason`` of the last reply, as the provider reported it (``length``: cut off at the
    #: output limit, ``content_filter``: stopped by a filter); ``None`` if it reported none.
    finish_reason: str | None = None
    #: The last reply was the model's refusal (``_meta`` ``refusal``, from OpenAI's ``refusal`` field):
    #: the answer is the refusal's text, not what was asked for.
    refusal: bool = False

    @property
    def ok(self) -> bool:
        """True when the run ended with an answer (a final message or a concluding tool)."""
        return self.reason in (StopReason.FINAL_ANSWER, StopReason.CONCLUDES_TURN)


@define
class ToolCallRecord:
    """One model-direct call of a step, as the loop tracks it."""

    index: int
    call_id: str
    tool_call_id: str
    name: str
    raw_arguments: str
    arguments: JSON = None
    parse_error: str | None = None
    #: The reply carrying the call stopped at the model's output limit (``finish_reason`` ``length``).
    cut_off: bool = False
    #: How the call runs: planned at the step's start, then the mode it ran under (``exclusive`` if it ran
    #: alone, or if its body did: the definition its policy judged was not concurrency-safe once that answered).
    mode: ExecutionMode = "exclusive"
    result: ToolResult | None = None
    duration_ms: float = 0.0


class LoopObserver:
    """Progress callbacks (the CLI renders them on stderr). Every method is optional; all are no-ops here."""

    async def on_text(self, fragment: str) -> None:
        """A streamed fragment of assistant text."""

    def on_step(self, step: int) -> None:
        """A model request for step ``step`` (1-based within the run) is about to be sent."""

    def on_assistant(self, message: Message) -> None:
        """The assistant's message of the current step."""

    def on_tool_start(self, call: ToolCallRecord) -> None:
        """A tool call starts (parallel calls start together)."""

    def on_tool_end(self, call: ToolCallRecord) -> None:
        """A tool call settled (``call.result`` is set)."""

    def on_end(self, result: RunResult) -> None:
        """The run ended."""


class _GuardedObserver(LoopObserver):
    """An observer whose failures are logged, never the run's: progress display is not the run."""

    def __init__(self, inner: LoopObserver) -> None:
        self._inner = inner

    def _failed(self, callback: str) -> None:
        log.warning(
            "agent loop observer %s.%s failed; the run goes on", type(self._inner).__name__, callback, exc_info=True
        )

    async def on_text(self, fragment: str) -> None:
        try:
            await self._inner.on_text(fragment)
        except Exception:
            self._failed("on_text")

    def on_step(self, step: int) -> None:
        try:
            self._inner.on_step(step)
        except Exception:
            self._failed("on_step")

    def on_assistant(self, message: Message) -> None:
        try:
            self._inner.on_assistant(message)
        except Exception:
            self._failed("on_assistant")

    def on_tool_start(self, call: ToolCallRecord) -> None:
        try:
            self._inner.on_tool_start(call)
        except Exception:
            self._failed("on_tool_start")

    def on_tool_end(self, call: ToolCallRecord) -> None:
        try:
            self._inner.on_tool_end(call)
        except Exception:
            self._failed("on_tool_end")

    def on_end(self, result: RunResult) -> None:
        try:
            self._inner.on_end(result)
        except Exception:
            self._failed("on_end")


def _default_system_prompt(agent_id: str) -> str:
    return (
        f"You are {agent_id}, an agent running in dsh. Use the tools to complete the user's task, "
        "then reply with a final answer."
    )


def _repair_interrupted(messages: list[Message]) -> list[Message]:
    """Make a rebuilt history valid for OpenAI-compatible servers, which reject it otherwise.

    A tool call that never got a result (a run killed mid-step) gets a synthetic
    "interrupted" one. A ``tool`` message that answers no call of the assistant
    message right before it (two runs that once appended to one session at the
    same time left results out of place, or twice) is dropped.
    """
    repaired: list[Message] = []
    index = 0
    while index < len(messages):
        message = messages[index]
        index += 1
        if message.get("role") == "tool":
            continue  # no assistant message asked for this result here
        repaired.append(message)
        calls = (message.get("tool_calls") or []) if message.get("role") == "assistant" else []
        if not calls:
            continue
        asked = {str(call["id"]) for call in calls}
        answered: set[str] = set()
        while index < len(messages) and messages[index].get("role") == "tool":
            call_id = str(messages[index].get("tool_call_id"))
            if call_id in asked and call_id not in answered:
                answered.add(call_id)
                repaired.append(messages[index])
            index += 1
        for call in calls:
            if call["id"] not in answered:
                repaired.append(
                    {
                        "role": "tool",
                        "tool_call_id": call["id"],
                        "content": "Error: the tool call was interrupted (the run ended before it returned a result)",
                    }
                )
    return repaired


def history_from_events(events: Sequence[SessionEvent]) -> list[Message]:
    """The conversation of a session, rebuilt from its message events (for resuming)."""
    messages: list[Message] = []
    for event in events:
        if event.parent_call_id is not None or event.sub_call_id is not None:
            continue
        payload = event.payload
        if event.kind in (EventKind.USER_MESSAGE, EventKind.ASSISTANT_MESSAGE, EventKind.TOOL_RESULT):
            message = payload.get("message") if isinstance(payload, Mapping) else None
            if isinstance(message, Mapping):
                messages.append(dict(message))
    return _repair_interrupted(messages)


def _parse_arguments(raw: str) -> tuple[JSON, str | None]:
    """Decode a tool call's JSON text strictly (no NaN/Infinity); ``(value, None)`` or ``(None, why)``."""
    if raw.strip() == "":
        return {}, None  # some servers send "" for a call without arguments

    def refuse(constant: str) -> object:
        raise ValueError(f"{constant} is not valid JSON")

    try:
        return freeze(json.loads(raw, parse_constant=refuse)), None
    except (ValueError, NotLosslessError, RecursionError) as error:
        return None, str(error)


class _ApprovalChannel:
    """A ``dsh_approve`` channel for the calls of one run, answered by the run's approver."""

    def __init__(self, run_scope: Scope, approver: Approver) -> None:
        self.run_scope = run_scope
        self.approver = approver

    @_hookimpl
    def dsh_approve(self, request: ApprovalRequest) -> Awaitable[ApprovalOutcome | None] | None:
        agent = request.execution.agent
        if agent is None or not agent.is_within(self.run_scope):
            return None
        return self.approver(request)


class _ApprovalRecorder:
    """Records every approval outcome of one run's calls, whichever channel answered."""

    def __init__(self, run_scope: Scope, recorder: SessionRecorder) -> None:
        self.run_scope = run_scope
        self.recorder = recorder

    @_hookimpl
    def dsh_approval_resolved(self, request: ApprovalRequest, outcome: ApprovalOutcome) -> Awaitable[object] | None:
        execution = request.execution
        if execution.agent is None or not execution.agent.is_within(self.run_scope):
            return None
        return self.recorder.append(
            EventKind.APPROVAL,
            {
                "name": execution.name,
                "call_id": execution.call_id,
                "reason": request.reason,
                "outcome": str(ApprovalOutcome(outcome)),
            },
            root_call_id=execution.root_call_id,
        )


class AgentLoop:
    """Runs one agent's turns against a provider. Usually built by :func:`run_agent`."""

    def __init__(
        self,
        *,
        agent_id: str,
        scope: Scope,
        registry: ToolRegistry,
        runtime: ToolRuntime,
        hooks: Hooks,
        provider: Provider,
        provider_name: str = "provider",
        model: str | None = None,
        max_turns: int = DEFAULT_MAX_TURNS,
        max_tool_result_chars: int = DEFAULT_MAX_TOOL_RESULT_CHARS,
        system_prompt: str | None = None,
        core_sections: Sequence[CoreSection] = (),
        recorder: SessionRecorder | None = None,
        observer: LoopObserver | None = None,
    ) -> None:
        if max_turns < 1:
            raise ValueError(f"agent {agent_id!r}: max_turns must be at least 1, got {max_turns}")
        if max_tool_result_chars < 1:
            raise ValueError(
                f"agent {agent_id!r}: max_tool_result_chars must be at least 1, got {max_tool_result_chars}"
            )
        self.agent_id = agent_id
        self.scope = scope
        self.registry = registry
        self.runtime = runtime
        self.provider = provider
        self.provider_name = provider_name
        self.model = model
        self.max_turns = max_turns
        self.max_tool_result_chars = max_tool_result_chars
        self.recorder = recorder
        self.observer: LoopObserver = _GuardedObserver(observer) if observer is not None else LoopObserver()
        self._request_chars: list[int] = []
        prompt = system_prompt if system_prompt is not None else _default_system_prompt(agent_id)

        def agent_section(_: PromptContext) -> PromptSection:
            return PromptSection("agent:system", prompt, order=0)

        self.assembler = PromptAssembler(hooks, registry, core=[agent_section, *core_sections])

    # -- recording --------------------------------------------------------------------------------------

    async def _record(self, events: Sequence[NewEvent]) -> None:
        if self.recorder is not None and events:
            await self.recorder.append_many(events)

    # -- one run ------------------------------------------------------------------------------------------

    async def run(
        self,
        task: str,
        *,
        history: Sequence[Message] = (),
        signal: AbortSignal | None = None,
        first_step: int | None = None,
    ) -> RunResult:
        """Add ``task`` as a user message to ``history`` and run until the loop stops.

        ``first_step`` numbers this run's steps after earlier ones (call ids
        ``<step>.<n>`` stay unique in a resumed session); by default it
        continues after the assistant messages in ``history``.
        """
        signal = signal or AbortSignal.never()
        self._request_chars = []
        messages: list[Message] = [dict(m) for m in history]
        step = first_step if first_step is not None else sum(1 for m in messages if m.get("role") == "assistant")
        user = {"role": "user", "content": task}
        messages.append(user)
        await self._record([NewEvent(EventKind.USER_MESSAGE, {"message": user})])
        turns = 0
        answer: str | None = None
        finish_reason: str | None = None
        refusal = False
        reason: StopReason
        error: str | None = None
        failure: Exception | None = None
        try:
            while True:
                if signal.aborted:
                    reason = StopReason.ABORTED
                    break
                if turns >= self.max_turns:
                    reason = StopReason.TURN_LIMIT
                    error = f"the turn limit ({self.max_turns}) was reached before a final answer"
                    break
                turns += 1
                step += 1
                assistant = await self._complete(messages, signal, step)
                if assistant is None:
                    reason = StopReason.ABORTED
                    break
                meta = assistant.pop("_meta", None)
                finish = meta.get("finish_reason") if isinstance(meta, Mapping) else None
                finish_reason = finish if isinstance(finish, str) else None
                refusal = isinstance(meta, Mapping) and meta.get("refusal") is True
                messages.append(assistant)
                payload: dict[str, Any] = {"message": assistant, "step": step}
                if meta is not None:
                    payload["meta"] = meta
                await self._record([NewEvent(EventKind.ASSISTANT_MESSAGE, payload)])
                self.observer.on_assistant(assistant)
                calls = assistant.get("tool_calls") or []
                if not calls:
                    reason, answer = StopReason.FINAL_ANSWER, assistant.get("content") or ""
                    break
                records = await self._run_calls(calls, step, signal, cut_off=finish_reason == "length")
                contexts: list[NewEvent] = []
                results: list[NewEvent] = []
                notes: list[Message] = []
                for record in records:
                    settled = _settled(record, self.max_tool_result_chars)
                    messages.append(settled.message)
                    results.append(settled.event)
                    notes.extend(note for note, _ in settled.contexts if note is not None)
                    contexts.extend(event for _, event in settled.contexts)
                messages.extend(notes)
                # Shielded: the calls have run. A cancellation cutting this write lost their results, and a
                # resumed run told the model they had been interrupted, so it ran them again.
                await asyncio.shield(self._record(results + contexts))
                concluding = [r for r in records if r.result is not None and r.result.concludes_turn]
                if concluding:
                    reason = StopReason.CONCLUDES_TURN
                    assert concluding[0].result is not None
                    answer = assistant.get("content") or concluding[0].result.text
                    break
        except asyncio.CancelledError:
            # Cancelled from outside (a second interrupt, a timeout): still leave the session saying why,
            # but never let a failing store hide the cancellation itself.
            with contextlib.suppress(Exception):
                await asyncio.shield(
                    self._record(
                        [
                            NewEvent(
                                EventKind.RUN_END,
                                {
                                    "reason": str(StopReason.ABORTED),
                                    "turns": turns,
                                    "answer": None,
                                    "error": "cancelled",
                                },
                            )
                        ]
                    )
                )
            raise
        except ProviderError as caught:
            failure = caught
            reason, error = StopReason.PROVIDER_ERROR, f"provider {self.provider_name!r}: {caught.message}"
        except DshError as caught:
            failure = caught
            reason, error = StopReason.ERROR, caught.message
        except Exception as caught:
            # A plugin hook, a provider or the store raised something that is not a DshError: the run
            # still ends with a recorded reason instead of a traceback with no run/end.
            failure = caught
            reason, error = StopReason.ERROR, f"{type(caught).__name__}: {caught}"
        if reason is StopReason.ABORTED and error is None:
            error = f"aborted: {signal.reason}" if signal.aborted else "aborted"
        end: dict[str, Any] = {"reason": str(reason), "turns": turns, "answer": answer}
        if error is not None:
            end["error"] = error
        try:
            await self._record([NewEvent(EventKind.RUN_END, end)])
        except Exception:
            if failure is None:
                raise
            # The store that could not record the run/end most likely caused the failure: report that.
            raise failure from None
        result = RunResult(
            reason,
            answer,
            turns,
            tuple(messages),
            self.recorder.session_id if self.recorder else None,
            error,
            tuple(self._request_chars),
            finish_reason,
            refusal,
        )
        self.observer.on_end(result)
        return result

    # -- the model request ---------------------------------------------------------------------------------

    async def _complete(self, messages: list[Message], signal: AbortSignal, step: int) -> Message | None:
        """The provider's next message (checked), or ``None`` if the run was aborted meanwhile."""
        system = self.assembler.assemble(self.scope)
        tools = [schema.to_json() for schema in self.registry.wire_schemas(self.scope)]
        request = [{"role": "system", "content": system}, *messages]
        self._request_chars.append(len(json.dumps({"messages": request, "tools": tools}, ensure_ascii=False)))
        self.observer.on_step(step)
        on_text: OnText = self.observer.on_text
        pending = asyncio.ensure_future(self.provider.complete(request, tools, on_text=on_text, model=self.model))
        try:
            await signal.until(pending)
        finally:
            if not pending.done():
                pending.cancel()
                await asyncio.gather(pending, return_exceptions=True)
        if pending.cancelled():
            if signal.aborted:
                return None
            # Nobody cancelled it: the provider let out the cancellation of something it awaited. An abort would
            # tell the user they had interrupted the run (dsh -p: exit 130); it is the provider's failure.
            raise ProviderError(
                "cancelled",
                "the request was cancelled although the run was not aborted "
                "(the provider let out the cancellation of something it awaited)",
            )
        raw = pending.result()
        return normalize_assistant(
            raw, who=f"provider {self.provider_name!r}", fallback_ids=lambda index: f"call_{step}_{index + 1}"
        )

    # -- tool calls ------------------------------------------------------------------------------------------

    def _records(
        self, calls: Sequence[Mapping[str, Any]], step: int, signal: AbortSignal, cut_off: bool
    ) -> list[ToolCallRecord]:
        records: list[ToolCallRecord] = []
        for index, call in enumerate(calls):
            function = call["function"]
            record = ToolCallRecord(
                index=index,
                call_id=f"{step}.{index + 1}",
                tool_call_id=call["id"],
                name=function["name"],
                raw_arguments=function["arguments"],
                cut_off=cut_off,
            )
            record.arguments, record.parse_error = _parse_arguments(record.raw_arguments)
            self._classify(record, signal)
            records.append(record)
        return records

    def _classify(self, record: ToolCallRecord, signal: AbortSignal) -> ExecutionMode:
        """Set and return ``record.mode`` as the registry answers now (unparsed arguments: exclusive)."""
        if record.parse_error is None:
            record.mode = self.runtime.execution_mode(self._request(record, signal))
        return record.mode

    def _request(self, record: ToolCallRecord, signal: AbortSignal) -> ToolExecutionInput:
        # Model-direct: no parent token, so the registry's Code Mode collapse applies.
        return ToolExecutionInput(
            call_id=record.call_id, name=record.name, arguments=record.arguments, signal=signal, agent=self.scope
        )

    async def _run_calls(
        self, calls: Sequence[Mapping[str, Any]], step: int, signal: AbortSignal, *, cut_off: bool = False
    ) -> list[ToolCallRecord]:
        records = self._records(calls, step, signal, cut_off)
        # Written before anything runs: a crash mid-tool still shows what was being called. So the mode is
        # the one planned now; the tool/result event records the one the call ran under.
        await self._record(
            [
                NewEvent(
                    EventKind.TOOL_CALL,
                    {
                        "name": r.name,
                        "tool_call_id": r.tool_call_id,
                        "arguments": r.raw_arguments,
                        "execution_mode": r.mode,
                    },
                    root_call_id=r.call_id,
                )
                for r in records
            ]
        )
        bodies = _Bodies()
        index = 0
        try:
            while index < len(records):
                # Classified again when its turn comes (the event above keeps the mode planned at the
                # step's start): a call earlier in the step may have replaced the tool by one that is
                # not concurrency-safe, and it must not run in a batch then.
                if self._classify(records[index], signal) == "parallel":
                    end = index + 1
                    while end < len(records) and self._classify(records[end], signal) == "parallel":
                        end += 1
                    await _all_or_none([self._run_one(r, signal, bodies) for r in records[index:end]])
                    index = end
                else:
                    await self._run_one(records[index], signal, bodies, alone=True)
                    index += 1
        except BaseException:
            # Cancelled or failed mid-step: the calls that did finish (a file written, a command run)
            # keep their results, in call order. Dropped, a resumed run told the model they had been
            # interrupted, and it ran them again; the unfinished ones are repaired as interrupted.
            # Their context messages are not kept, so each result has the whole budget to itself.
            settled = [
                _settled(r, self.max_tool_result_chars, with_contexts=False).event
                for r in records
                if r.result is not None
            ]
            with contextlib.suppress(Exception):
                await asyncio.shield(self._record(settled))
            raise
        return records

    async def _run_one(
        self, record: ToolCallRecord, signal: AbortSignal, bodies: _Bodies, *, alone: bool = False
    ) -> None:
        self.observer.on_tool_start(record)
        started = time.perf_counter()
        if record.parse_error is not None:
            # Told only "not valid JSON", a model whose reply hit its output limit sent the same call again.
            remedy = (
                "your reply was cut off at the model's output limit (finish_reason 'length') before they "
                "were complete; send a shorter call, e.g. split a large content into several calls"
                if record.cut_off
                else "send one JSON object"
            )
            record.result = ToolResult.failure(
                ErrorCode.INVALID_ARGS,
                f'the arguments of tool call "{record.name}" are not valid JSON ({record.parse_error}); {remedy}',
            )
        else:
            record.result = await self._execute(record, signal, bodies, alone)
        record.duration_ms = (time.perf_counter() - started) * 1000
        self.observer.on_tool_end(record)

    async def _execute(self, record: ToolCallRecord, signal: AbortSignal, bodies: _Bodies, alone: bool) -> ToolResult:
        """:meth:`ToolRuntime.execute`, but the body runs under the classification made once policy answered.

        A call of a batch is classified again when its policy has answered, in the same step as it
        takes its place among the bodies (``bodies``), by the definition its policy judged (the one its
        body runs, pinned when the call was created): that may not be the one its turn was planned
        with, and ``is_concurrency_safe`` may answer differently now. A tool replaced after the call
        was created runs no body at all (the runtime fails the call at dispatch).
        A call ``alone`` (exclusive when its turn came) runs by itself, its policy included.
        """
        runtime = self.runtime
        staged = await runtime.prepare(self._request(record, signal))  # cancelled, it emits its own result
        try:
            if staged.kind == "dispatch":

                def mode() -> ExecutionMode:
                    return "exclusive" if alone else runtime.staged_execution_mode(staged)

                async with bodies.slot(mode) as ran_under:
                    record.mode = ran_under
                    staged = await runtime.dispatch(staged)
                    if ran_under != "parallel":
                        # Alone through its post-execute too (as a call exclusive from its turn is, and
                        # as the scheduler's barrier is): post-execute may read what the body changed.
                        return await runtime.finalize(staged)
            return await runtime.finalize(staged)  # a result settled before dispatch is only finished
        except asyncio.CancelledError:
            # As in execute(): the call still emits its one result (aborted), then the cancellation goes on.
            await asyncio.shield(runtime.finish_cancelled(staged))
            raise


class _Bodies:
    """The bodies of one step's calls that run now: parallel ones together, an exclusive one alone.

    An exclusive call waiting for the bodies in flight holds back bodies that would start after it:
    otherwise a stream of parallel bodies could keep it waiting for ever.
    """

    def __init__(self) -> None:
        self._running = 0
        self._alone = False
        self._waiting = 0  # exclusive calls waiting for the bodies in flight
        self._changed = asyncio.Event()

    def _change(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    @contextlib.asynccontextmanager
    async def slot(self, classify: Callable[[], ExecutionMode]) -> AsyncIterator[ExecutionMode]:
        """Hold a body's place while it runs; the mode it runs under, as ``classify`` answers on entry.

        ``classify`` is asked again after every wait, and the place is taken in the same step as its
        last answer: no other body can start between the classification and the entry.
        """
        waiting = False
        try:
            while True:
                if waiting:
                    self._waiting -= 1
                    waiting = False
                mode = classify()
                if mode == "parallel":
                    if not self._alone and not self._waiting:
                        break
                elif not self._running:
                    self._alone = True
                    break
                else:
                    self._waiting += 1
                    waiting = True
                await self._changed.wait()
        finally:
            if waiting:  # cancelled while waiting: a parallel body it held back may start now
                self._waiting -= 1
                self._change()
        self._running += 1
        try:
            yield mode
        finally:
            self._running -= 1
            if mode != "parallel":
                self._alone = False
            self._change()


async def _all_or_none(work: list[Coroutine[Any, Any, None]]) -> None:
    """Run ``work`` concurrently; if one raises (or this is cancelled), cancel and await the rest, then raise.

    Unlike a bare ``gather``, nothing is left running once this returns or raises: a
    parallel batch never outlives the run that started it.
    """
    tasks = [asyncio.ensure_future(item) for item in work]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for task in tasks:
        error = None if task.cancelled() else task.exception()
        if error is not None:
            raise error
    if any(task.cancelled() for task in tasks):
        raise asyncio.CancelledError  # as gather would: a call cancelled from within cancels the batch


@frozen
class _Settled:
    """What a settled call adds to the conversation: its ``tool`` message and ``tool/result`` event, and
    each of its context messages (a ``user`` message, or ``None`` when the cap left nothing of it to send)
    with its ``message/user`` event."""

    message: Message
    event: NewEvent
    contexts: list[tuple[Message | None, NewEvent]]


def _cut_record(text: str, left_out: int, max_chars: int) -> dict[str, Any]:
    return {"chars": len(text), "left_out": left_out, "max_tool_result_chars": max_chars}


def _settled(record: ToolCallRecord, max_chars: int, *, with_contexts: bool = True) -> _Settled:
    """The messages of a settled call, its text and its context messages cut to ``max_chars`` together.

    One budget for the call, not one per message (:func:`~dsh_core.agent.resultcap.cap_call_texts`): a
    result deferring many contexts still adds at most ``max_chars`` characters to the conversation. Each
    event keeps the whole text as ``content`` and what the model saw as ``message`` (replayed on resume),
    and a ``cut`` record when it was cut. Without ``with_contexts`` (an interrupted step, which keeps no
    context messages) the text has the budget to itself and no context messages are returned.
    """
    assert record.result is not None
    text = record.result.text
    additional = record.result.additional_contexts if with_contexts else ()
    shown, shown_contexts = cap_call_texts(text, [c.text for c in additional], max_chars)
    message: Message = {"role": "tool", "tool_call_id": record.tool_call_id, "content": shown.text}
    payload = _result_payload(record, text, message)
    if shown.cut:
        payload["cut"] = _cut_record(text, shown.left_out, max_chars)
    contexts: list[tuple[Message | None, NewEvent]] = []
    for context, seen in zip(additional, shown_contexts, strict=True):
        # Nothing left of it (a share of 0: more texts than the cap has characters), it is recorded but not
        # sent: an empty user message is refused by some providers, and says nothing to the model anyway.
        note: Message | None = {"role": "user", "content": seen.text} if seen.text else None
        noted: dict[str, Any] = {"message": note, "context_source": context.source, "content": context.text}
        if seen.cut:
            noted["cut"] = _cut_record(context.text, seen.left_out, max_chars)
        contexts.append((note, NewEvent(EventKind.USER_MESSAGE, noted, root_call_id=record.call_id)))
    return _Settled(message, NewEvent(EventKind.TOOL_RESULT, payload, root_call_id=record.call_id), contexts)


def _result_payload(record: ToolCallRecord, text: str, message: Message) -> dict[str, Any]:
    """``content`` is the whole result; ``message`` what the model saw (resuming replays it as it was)."""
    result = record.result
    assert result is not None
    return {
        "name": record.name,
        "tool_call_id": record.tool_call_id,
        "ok": not result.is_error,
        "error": None if result.error is None else {"code": result.error.code, "message": result.error.message},
        "content": text,
        "concludes_turn": result.concludes_turn,
        "execution_mode": record.mode,
        "duration_ms": round(record.duration_ms, 3),
        "message": message,
    }


# -- running an agent of a harness ---------------------------------------------------------------------------


def _blamed(harness: Harness, path: str) -> str:
    """``"FILE: "`` naming the file (or ``env:NAME``) that set ``path``, as every config error starts.

    Empty for a built-in default: there is no file to name.
    """
    source = harness.deployment.origin_of(path)
    return "" if source is None else f"{source}: "


def open_session_store(harness: Harness, *, create: bool = True) -> SessionStore:
    """Open the deployment's session store (``[sessions] store`` under ``[sessions] home``/``DSH_HOME``).

    ``create=False`` for a command that must create no state (:func:`~dsh_core.sessions.store.open_store`).
    """
    name = harness.deployment.sessions.store
    factory = harness.session_stores.get(name)
    if factory is None:
        known = ", ".join(harness.session_stores.names()) or "none"
        raise ConfigError(
            f"{_blamed(harness, 'sessions.store')}sessions.store: no session store named {name!r} "
            f"is registered (known: {known}); "
            'add a plugin row that provides it, e.g. use = "sqlite-sessions"'
        )
    return open_store(factory, dsh_home(harness.deployment.sessions.home), create=create)


def core_sections_of(harness: Harness) -> list[CoreSection]:
    """The deployment's core prompt sections (from the root's ``prompt`` assembler, if any)."""
    assembler = harness.root.lookup(PROMPT_SERVICE)
    return list(assembler.core) if isinstance(assembler, PromptAssembler) else []


def _provider_for(harness: Harness, agent_id: str, name: str | None) -> Provider:
    if name is None:
        # Not set: blame the file that declared the agent.
        raise ConfigError(
            f"{_blamed(harness, f'agents[{agent_id}].id')}agents[{agent_id}].provider is not set: "
            "name a registered provider "
            f"(known: {', '.join(harness.providers.names()) or 'none'})"
        )
    provider = harness.providers.get(name)
    if provider is None:
        known = ", ".join(harness.providers.names()) or "none"
        raise ConfigError(
            f"{_blamed(harness, f'agents[{agent_id}].provider')}agents[{agent_id}].provider: "
            f"no provider named {name!r} is registered "
            f'(known: {known}); add a plugin row that provides it (use = "scripted" or "openai")'
        )
    return provider  # type: ignore[no-any-return]


async def run_agent(
    harness: Harness,
    task: str,
    *,
    agent_id: str | None = None,
    session_id: str | None = None,
    signal: AbortSignal | None = None,
    observer: LoopObserver | None = None,
    approver: Approver | None = None,
    store: SessionStore | None = None,
    record: bool = True,
) -> RunResult:
    """Run one agent turn of ``harness`` on ``task``, recorded in a session.

    A new session is created unless ``session_id`` names one to continue (its
    history is rebuilt from the events). The run leases its session first and
    releases it when it ends, however it ends: while another run that is still
    running holds it, this one fails with
    :class:`~dsh_core.sessions.store.SessionBusyError` before touching it.
    ``store`` defaults to the
    deployment's store, opened and closed here; with ``record=False`` nothing
    is persisted. ``approver`` becomes an approval channel for this run's
    calls (answers are recorded).
    """
    agent_scope = harness.agent(agent_id)
    resolved_id = next(i for i, s in harness.agents.items() if s is agent_scope)
    row = harness.deployment.agent(resolved_id)
    provider_name = row.provider if row is not None else None
    provider = _provider_for(harness, resolved_id, provider_name)
    own_store = False
    if record and store is None:
        store = open_session_store(harness)
        own_store = True
    run_scope = agent_scope.child(f"run:{session_id or 'new'}")
    lease: SessionLease | None = None
    try:
        recorder: SessionRecorder | None = None
        history: list[Message] = []
        if record:
            assert store is not None
            check_lease_aware(store)  # before the session is created or claimed, naming the store
            # Made before the claim, so the finally releases it even if the claim fails or is cut short
            # (releasing a lease that does not hold the session does nothing).
            lease = SessionLease.for_this_run()
            if session_id is not None:
                await store.acquire(session_id, lease)  # before loading: no other run appends meanwhile
                events = await store.load(session_id)
                history = history_from_events(events)
            else:
                info = await store.create(meta={"agent": resolved_id, "task": task}, lease=lease)
                session_id = info.known_id
            # Checked against the lease: once another run has taken the session over, this one stops.
            recorder = SessionRecorder(store, session_id, lease=lease)
            run_scope.provide(SESSION_SERVICE, recorder)
        if recorder is not None:
            harness.hooks.register(
                _ApprovalRecorder(run_scope, recorder),
                name=f"dsh-agent-approval-record:{run_scope.serial}",
                scope=run_scope,
            )
        if approver is not None:
            harness.hooks.register(
                _ApprovalChannel(run_scope, approver), name=f"dsh-agent-approval:{run_scope.serial}", scope=run_scope
            )
        loop = AgentLoop(
            agent_id=resolved_id,
            scope=run_scope,
            registry=harness.registry,
            runtime=harness.runtime,
            hooks=harness.hooks,
            provider=provider,
            provider_name=str(provider_name),
            model=row.model if row is not None else None,
            max_turns=(row.max_turns if row is not None and row.max_turns else DEFAULT_MAX_TURNS),
            max_tool_result_chars=(
                row.max_tool_result_chars
                if row is not None and row.max_tool_result_chars
                else DEFAULT_MAX_TOOL_RESULT_CHARS
            ),
            system_prompt=row.system_prompt if row is not None else None,
            core_sections=core_sections_of(harness),
            recorder=recorder,
            observer=observer,
        )
        if recorder is not None:
            await recorder.append(
                EventKind.RUN_START,
                {
                    "task": task,
                    "agent": resolved_id,
                    "provider": provider_name,
                    "model": row.model if row is not None else None,
                    "mode": harness.registry.mode_for(run_scope),
                    "resumed": bool(history),
                },
            )
        return await loop.run(task, history=history, signal=signal)
    finally:
        try:
            await run_scope.dispose()
        finally:
            try:
                if lease is not None and session_id is not None:
                    assert store is not None
                    # Quietly while the run (or the disposal) is failing: that failure is the one to report.
                    await _release(store, session_id, lease, quietly=sys.exc_info()[1] is not None)
            finally:
                if own_store and store is not None:
                    await store.close()


async def _release(store: SessionStore, session_id: str, lease: SessionLease, *, quietly: bool) -> None:
    """Release a run's lease; shielded, so a second cancellation cannot leave the session held.

    ``quietly`` (the run is already failing): a store error here does not replace that failure; a
    lease left behind is taken over once this process has ended.
    """
    try:
        await asyncio.shield(store.release(session_id, lease))
    except Exception:
        if not quietly:
            raise
