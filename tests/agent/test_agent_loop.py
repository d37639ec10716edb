"""The agent loop with the scripted provider: modes, scheduling, stop reasons, sessions, resume."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path
from typing import Any

import attrs
import pytest
from agent_kit import ToolsPlugin, call, calls, final, program, scripted, start, tool

from dsh_core import AbortController, ApprovalOutcome, PreDecision, define_tool, hookimpl
from dsh_core.agent.loop import StopReason, history_from_events, open_session_store, run_agent
from dsh_core.clirun import run_async
from dsh_core.sessions.events import SessionEvent

pytestmark = pytest.mark.anyio


async def add(args: Any, ctx: Any) -> Any:
    return {"sum": args["a"] + args["b"]}


ADD_PARAMS = {
    "type": "object",
    "required": ["a", "b"],
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
}


async def events_of(harness: Any, session_id: str) -> list[SessionEvent]:
    store = open_session_store(harness)
    try:
        return await store.load(session_id)
    finally:
        await store.close()


async def test_native_run_calls_a_tool_and_answers(tmp_path: Path) -> None:
    turns = [
        calls(call("add", {"a": 2, "b": 40}, "call_1"), expect={"last_role": "user", "tools_include": ["add"]}),
        final("The answer is 42.", expect={"last_role": "tool"}),
    ]
    harness = await start(tmp_path, tools=[tool("add", add, params=ADD_PARAMS)], turns=turns)
    try:
        result = await run_agent(harness, "what is 2+40?")
        assert result.reason is StopReason.FINAL_ANSWER and result.ok
        assert result.answer == "The answer is 42."
        assert result.turns == 2 and len(result.request_chars) == 2
        roles = [m["role"] for m in result.messages]
        assert roles == ["user", "assistant", "tool", "assistant"]
        assert result.messages[2] == {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"sum": 42})}
        request = scripted(harness).requests[0]
        assert request["messages"][0]["role"] == "system" and "main" in request["messages"][0]["content"]
        assert [t["name"] for t in request["tools"]] == ["add"]
        assert request["tools"][0]["parameters"] == ADD_PARAMS
        assert result.session_id is not None
        events = await events_of(harness, result.session_id)
        assert [e.kind for e in events] == [
            "run/start",
            "message/user",
            "message/assistant",
            "tool/call",
            "tool/result",
            "message/assistant",
            "run/end",
        ]
        assert [e.seq for e in events] == list(range(1, 8))
        call_event, result_event = events[3], events[4]
        assert call_event.root_call_id == result_event.root_call_id == "1.1"
        assert call_event.payload["execution_mode"] == "exclusive"
        assert result_event.payload["ok"] is True and result_event.payload["duration_ms"] >= 0
        assert events[-1].payload == {"reason": "final-answer", "turns": 2, "answer": "The answer is 42."}
    finally:
        await harness.aclose()


async def test_code_mode_collapses_a_direct_native_call_and_runs_programs(tmp_path: Path) -> None:
    ran: list[Any] = []

    async def counted(args: Any, ctx: Any) -> Any:
        ran.append((args, ctx.execution.nested))
        return await add(args, ctx)

    turns = [
        calls(
            call("add", {"a": 1, "b": 1}, "direct"), expect={"tools_include": ["run_code"], "tools_exclude": ["add"]}
        ),
        calls(call("run_code", {"code": program(("add", {"a": 2, "b": 3})), "description": "add"}, "prog")),
        final("5"),
    ]
    harness = await start(tmp_path, tools=[tool("add", counted, params=ADD_PARAMS)], turns=turns, mode="code")
    try:
        result = await run_agent(harness, "add")
        assert result.reason is StopReason.FINAL_ANSWER
        direct = result.messages[2]
        assert direct["tool_call_id"] == "direct"
        assert direct["content"].startswith('Error: unknown tool "add": only `run_code` is callable directly')
        assert ran == [({"a": 2, "b": 3}, True)]  # the direct call's body never ran; the nested one did
        assert "tools:code-only" not in json.dumps(result.messages)  # prompt sections stay in the system prompt
        assert result.session_id is not None
        events = await events_of(harness, result.session_id)
        results = [e for e in events if e.kind == "tool/result"]
        assert results[0].payload["error"]["code"] == "UNKNOWN_TOOL"
        nested = [e for e in events if e.kind.startswith("tool/code-dispatch")]
        assert [e.kind for e in nested] == ["tool/code-dispatch-start", "tool/code-dispatch"]
        assert {(e.root_call_id, e.parent_call_id, e.sub_call_id) for e in nested} == {("2.1", "2.1", "2.1:code:1")}
        # The nested events sit between the outer call and its result.
        seqs = {e.kind: e.seq for e in events if e.root_call_id == "2.1"}
        assert seqs["tool/call"] < seqs["tool/code-dispatch-start"] < seqs["tool/code-dispatch"] < seqs["tool/result"]
    finally:
        await harness.aclose()


async def test_both_mode_offers_native_tools_and_run_code(tmp_path: Path) -> None:
    turns = [
        calls(
            call("add", {"a": 1, "b": 2}, "d"),
            call("run_code", {"code": program(("add", {"a": 3, "b": 4})), "description": "x"}, "p"),
            expect={"tools_include": ["add", "run_code"]},
        ),
        final("ok"),
    ]
    harness = await start(tmp_path, tools=[tool("add", add, params=ADD_PARAMS)], turns=turns, mode="both")
    try:
        result = await run_agent(harness, "go")
        assert result.ok
        tool_messages = [m for m in result.messages if m["role"] == "tool"]
        assert [m["tool_call_id"] for m in tool_messages] == ["d", "p"]
        assert '"sum": 3' in tool_messages[0]["content"]
        assert '"sum": 7' in tool_messages[1]["content"].replace("\\", "")
    finally:
        await harness.aclose()


async def test_an_agent_row_mode_overrides_the_deployment(tmp_path: Path) -> None:
    harness = await start(
        tmp_path,
        tools=[tool("add", add, params=ADD_PARAMS)],
        turns=[final("hi", expect={"tools_include": ["run_code"], "tools_exclude": ["add"]})],
        agent={"mode": "code"},
    )
    try:
        assert (await run_agent(harness, "hi")).ok
    finally:
        await harness.aclose()


async def test_parallel_safe_calls_overlap_and_exclusive_ones_run_alone_in_order(tmp_path: Path) -> None:
    log: list[str] = []
    running = 0
    both_started = asyncio.Event()
    seen_max = 0

    def make(name: str) -> Any:
        async def body(args: Any, ctx: Any) -> Any:
            nonlocal running, seen_max
            running += 1
            seen_max = max(seen_max, running)
            log.append(f"start {name}")
            if running == 2:
                both_started.set()
            if name.startswith("safe"):
                # Each safe call waits until the other is running too: only overlap lets them finish.
                await asyncio.wait_for(both_started.wait(), 5)
            else:
                assert running == 1, "an exclusive call must run alone"
            await asyncio.sleep(0.01)
            log.append(f"end {name}")
            running -= 1
            return name

        return body

    tools = [
        tool("safe_a", make("safe_a"), safe=True),
        tool("safe_b", make("safe_b"), safe=True),
        tool("excl", make("excl")),
    ]
    turns = [
        calls(call("safe_a", {}, "1"), call("safe_b", {}, "2"), call("excl", {}, "3"), call("safe_a", {}, "4")),
        final("done"),
    ]
    harness = await start(tmp_path, tools=tools, turns=turns)
    try:
        result = await run_agent(harness, "go")
        assert result.ok
        assert log[:2] == ["start safe_a", "start safe_b"]
        assert log.index("start excl") > max(log.index("end safe_a"), log.index("end safe_b"))
        assert log.index("start excl") + 1 == log.index("end excl")
        assert [m["tool_call_id"] for m in result.messages if m["role"] == "tool"] == ["1", "2", "3", "4"]
        assert [m["content"] for m in result.messages if m["role"] == "tool"] == ["safe_a", "safe_b", "excl", "safe_a"]
        assert result.session_id is not None
        events = await events_of(harness, result.session_id)
        modes = [e.payload["execution_mode"] for e in events if e.kind == "tool/call"]
        assert modes == ["parallel", "parallel", "exclusive", "parallel"]
    finally:
        await harness.aclose()


async def test_the_turn_limit_stops_the_run_and_is_recorded(tmp_path: Path) -> None:
    turns = [calls(call("add", {"a": 1, "b": 1}, f"c{i}")) for i in range(3)] + [final("never")]
    harness = await start(tmp_path, tools=[tool("add", add, params=ADD_PARAMS)], turns=turns, max_turns=2)
    try:
        result = await run_agent(harness, "loop")
        assert result.reason is StopReason.TURN_LIMIT and not result.ok and result.answer is None
        assert result.turns == 2 and "turn limit (2)" in str(result.error)
        assert len(scripted(harness).requests) == 2
        assert result.session_id is not None
        end = (await events_of(harness, result.session_id))[-1]
        assert end.kind == "run/end" and end.payload["reason"] == "turn-limit"
    finally:
        await harness.aclose()


async def test_an_abort_mid_tool_stops_the_run(tmp_path: Path) -> None:
    controller = AbortController()
    started = asyncio.Event()
    later_ran: list[bool] = []

    async def slow(args: Any, ctx: Any) -> Any:
        started.set()
        await ctx.signal.wait()
        return "interrupted"

    async def later(args: Any, ctx: Any) -> Any:
        later_ran.append(True)
        return "ran"

    turns = [calls(call("slow", {}, "s"), call("later", {}, "l")), final("never")]
    harness = await start(tmp_path, tools=[tool("slow", slow), tool("later", later)], turns=turns)
    try:
        task = asyncio.ensure_future(run_agent(harness, "go", signal=controller.signal))
        await asyncio.wait_for(started.wait(), 5)
        controller.abort("test")
        result = await asyncio.wait_for(task, 5)
        assert result.reason is StopReason.ABORTED and result.error == "aborted: test"
        contents = [m["content"] for m in result.messages if m["role"] == "tool"]
        assert contents == ["Error: tool call aborted", "Error: tool call aborted before dispatch"]
        assert later_ran == [] and len(scripted(harness).requests) == 1
        assert result.session_id is not None
        events = await events_of(harness, result.session_id)
        assert [e.payload["error"]["code"] for e in events if e.kind == "tool/result"] == [
            "ABORTED",
            "ABORTED_BEFORE_DISPATCH",
        ]
        assert events[-1].payload["reason"] == "aborted"
    finally:
        await harness.aclose()


async def test_an_abort_while_the_model_thinks_cancels_the_request(tmp_path: Path) -> None:
    controller = AbortController()
    harness = await start(tmp_path, turns=[final("slow")])
    provider = scripted(harness)
    original = provider.complete
    entered = asyncio.Event()

    async def slow_complete(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        await asyncio.sleep(30)
        return await original(*args, **kwargs)

    provider.complete = slow_complete
    try:
        task = asyncio.ensure_future(run_agent(harness, "go", signal=controller.signal))
        await asyncio.wait_for(entered.wait(), 5)
        controller.abort("SIGINT")
        result = await asyncio.wait_for(task, 5)
        assert result.reason is StopReason.ABORTED and result.turns == 1
    finally:
        await harness.aclose()


def test_sigint_aborts_the_run_through_the_abort_controller(tmp_path: Path) -> None:
    controller = AbortController()

    async def main() -> Any:
        started = asyncio.Event()

        async def slow(args: Any, ctx: Any) -> Any:
            started.set()
            await ctx.signal.wait()
            return "stopped"

        harness = await start(tmp_path, tools=[tool("slow", slow)], turns=[calls(call("slow", {})), final("x")])
        try:
            task = asyncio.ensure_future(run_agent(harness, "go", signal=controller.signal))
            await asyncio.wait_for(started.wait(), 5)
            os.kill(os.getpid(), signal.SIGINT)
            return await asyncio.wait_for(task, 5)
        finally:
            await harness.aclose()

    result = run_async(main, on_signal=lambda: controller.abort("SIGINT"))
    assert result.reason is StopReason.ABORTED and result.error == "aborted: SIGINT"


async def test_a_cancelled_run_records_its_end_and_propagates_the_cancellation(tmp_path: Path) -> None:
    started = asyncio.Event()

    async def stubborn(args: Any, ctx: Any) -> Any:
        started.set()
        await asyncio.sleep(30)  # does not watch the abort signal: only a cancellation stops it
        return "late"

    turns = [calls(call("stubborn", {})), final("never")]
    harness = await start(tmp_path, tools=[tool("stubborn", stubborn)], turns=turns)
    try:
        task = asyncio.ensure_future(run_agent(harness, "go"))
        await asyncio.wait_for(started.wait(), 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        store = open_session_store(harness)
        try:
            (info,) = await store.list()
            events = await store.load(info.id)
        finally:
            await store.close()
        assert [e.kind for e in events][-2:] == ["tool/call", "run/end"]
        assert events[-1].payload == {"reason": "aborted", "turns": 1, "answer": None, "error": "cancelled"}
    finally:
        await harness.aclose()


async def test_a_cancelled_step_keeps_the_results_of_the_calls_that_finished(tmp_path: Path) -> None:
    """A cancel mid-step dropped every result: on resume the model was told finished calls were interrupted."""
    started = asyncio.Event()

    async def done(args: Any, ctx: Any) -> Any:
        return f"{args['n']} done"

    async def stubborn(args: Any, ctx: Any) -> Any:
        started.set()
        await asyncio.sleep(30)

    # One exclusive call, then a parallel batch of which one call finishes and one never does.
    turns = [
        calls(call("write_once", {"n": 1}, "w"), call("fast", {"n": 2}, "f"), call("stubborn", {}, "s")),
        final("never"),
    ]
    from dsh_core.agent.loop import LoopObserver

    fast_settled = asyncio.Event()

    class Watch(LoopObserver):
        def on_tool_end(self, record: Any) -> None:
            if record.name == "fast":
                fast_settled.set()

    harness = await start(
        tmp_path,
        tools=[tool("write_once", done), tool("fast", done, safe=True), tool("stubborn", stubborn, safe=True)],
        turns=turns,
    )
    try:
        task = asyncio.ensure_future(run_agent(harness, "go", observer=Watch()))
        await asyncio.wait_for(asyncio.gather(started.wait(), fast_settled.wait()), 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        store = open_session_store(harness)
        try:
            (info,) = await store.list()
            events = await store.load(info.id)
        finally:
            await store.close()
        assert [e.kind for e in events][-3:] == ["tool/result", "tool/result", "run/end"]
        assert [e.root_call_id for e in events if e.kind == "tool/result"] == ["1.1", "1.2"]
        tool_messages = [m for m in history_from_events(events) if m["role"] == "tool"]
        assert [(m["tool_call_id"], m["content"]) for m in tool_messages] == [
            ("w", "1 done"),
            ("f", "2 done"),
            ("s", "Error: the tool call was interrupted (the run ended before it returned a result)"),
        ]
    finally:
        await harness.aclose()


async def test_a_run_under_wait_for_times_out_with_timeout_error(tmp_path: Path) -> None:
    async def stubborn(args: Any, ctx: Any) -> Any:
        await asyncio.sleep(30)

    harness = await start(tmp_path, tools=[tool("stubborn", stubborn)], turns=[calls(call("stubborn", {}))])
    try:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(run_agent(harness, "go"), 0.5)
    finally:
        await harness.aclose()


class _ClashingSections(ToolsPlugin):
    @hookimpl
    def dsh_prompt_sections(self, context: Any) -> Any:
        from dsh_core.model import PromptSection

        return [PromptSection("notes", "a", order=1), PromptSection("notes", "b", order=2)]


class _BrokenSections(ToolsPlugin):
    @hookimpl
    def dsh_prompt_sections(self, context: Any) -> Any:
        raise KeyError("oops")


@pytest.mark.parametrize(
    ("plugin", "expected"),
    [
        (_ClashingSections([]), "prompt section 'notes' is contributed twice at one scope level"),
        (_BrokenSections([]), "dsh_prompt_sections of plugin 'tools' failed: KeyError: 'oops'"),
    ],
)
async def test_any_exception_ends_the_run_with_a_recorded_error(tmp_path: Path, plugin: Any, expected: str) -> None:
    harness = await start(tmp_path, plugin=plugin)
    try:
        result = await run_agent(harness, "go")
        assert result.reason is StopReason.ERROR and expected in str(result.error)
        assert result.session_id is not None
        end = (await events_of(harness, result.session_id))[-1]
        assert end.kind == "run/end" and end.payload["reason"] == "error" and expected in end.payload["error"]
    finally:
        await harness.aclose()


async def test_a_non_dsh_provider_exception_is_recorded_naming_its_type(tmp_path: Path) -> None:
    harness = await start(tmp_path, turns=[final("x")])
    provider = scripted(harness)

    async def broken(*args: Any, **kwargs: Any) -> Any:
        raise AttributeError("'list' object has no attribute 'get'")

    provider.complete = broken
    try:
        result = await run_agent(harness, "go")
        assert result.reason is StopReason.ERROR
        assert result.error == "AttributeError: 'list' object has no attribute 'get'"
        assert result.session_id is not None
        assert (await events_of(harness, result.session_id))[-1].payload["error"] == result.error
    finally:
        await harness.aclose()


async def test_invalid_json_arguments_become_an_invalid_args_message(tmp_path: Path) -> None:
    ran: list[Any] = []

    async def body(args: Any, ctx: Any) -> Any:
        ran.append(args)
        return "ran"

    turns = [calls(call("t", '{"a": 1,', "bad"), call("t", '{"x": NaN}', "nan"), call("t", "", "empty")), final("ok")]
    harness = await start(tmp_path, tools=[tool("t", body)], turns=turns)
    try:
        result = await run_agent(harness, "go")
        contents = [m["content"] for m in result.messages if m["role"] == "tool"]
        assert contents[0].startswith('Error: the arguments of tool call "t" are not valid JSON')
        assert "NaN is not valid JSON" in contents[1]
        assert contents[2] == "ran" and ran == [{}]  # "" means no arguments
        assert result.session_id is not None
        codes = [
            e.payload["error"] and e.payload["error"]["code"]
            for e in await events_of(harness, result.session_id)
            if e.kind == "tool/result"
        ]
        assert codes == ["INVALID_ARGS", "INVALID_ARGS", None]
    finally:
        await harness.aclose()


async def test_calls_that_share_an_id_get_distinct_ids_so_each_result_answers_one(tmp_path: Path) -> None:
    """Two calls with one id got two results under that id: ambiguous to the model, and a resume dropped one."""

    async def echo(args: Any, ctx: Any) -> Any:
        return f"n={args['n']}"

    harness = await start(tmp_path, tools=[tool("echo", echo)])
    replies = iter([calls(call("echo", {"n": 1}, "same"), call("echo", {"n": 2}, "same")), final("ok")])

    async def server(*args: Any, **kwargs: Any) -> Any:
        return next(replies)

    scripted(harness).complete = server
    try:
        result = await run_agent(harness, "go")
        assert result.ok
        ids = [c["id"] for c in result.messages[1]["tool_calls"]]
        assert ids[0] == "same" and len(set(ids)) == 2
        live = [(m["tool_call_id"], m["content"]) for m in result.messages if m["role"] == "tool"]
        assert live == [(ids[0], "n=1"), (ids[1], "n=2")]
        assert result.session_id is not None
        events = await events_of(harness, result.session_id)
        assert [(m["tool_call_id"], m["content"]) for m in history_from_events(events) if m["role"] == "tool"] == live
    finally:
        await harness.aclose()


async def test_concludes_turn_stops_and_contexts_become_user_messages(tmp_path: Path) -> None:
    async def note(args: Any, ctx: Any) -> Any:
        ctx.defer_context("remember: the build is green")
        return "noted"

    async def finish(args: Any, ctx: Any) -> Any:
        ctx.conclude_turn()
        return "all done"

    turns = [calls(call("note", {}, "n"), call("finish", {}, "f")), final("never asked")]
    harness = await start(tmp_path, tools=[tool("note", note), tool("finish", finish)], turns=turns)
    try:
        result = await run_agent(harness, "go")
        assert result.reason is StopReason.CONCLUDES_TURN and result.answer == "all done"
        assert [m["role"] for m in result.messages] == ["user", "assistant", "tool", "tool", "user"]
        assert result.messages[-1]["content"] == "remember: the build is green"
        assert len(scripted(harness).requests) == 1
    finally:
        await harness.aclose()


async def test_a_provider_failure_is_recorded_as_the_end_reason(tmp_path: Path) -> None:
    harness = await start(tmp_path, turns=[final("only one")])
    try:
        first = await run_agent(harness, "one")
        assert first.ok
        # Resuming asks for a second assistant turn the script does not have.
        second = await run_agent(harness, "two", session_id=first.session_id)
        assert second.reason is StopReason.PROVIDER_ERROR
        assert "script exhausted" in str(second.error) and "provider 'scripted'" in str(second.error)
        assert first.session_id is not None
        assert (await events_of(harness, first.session_id))[-1].payload["reason"] == "provider-error"
    finally:
        await harness.aclose()


async def test_a_provider_letting_out_a_stray_cancellation_is_a_provider_error_not_an_abort(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A provider that awaited something cancelled elsewhere let its CancelledError out: the run ended as
    # "aborted" (dsh -p exit 130), as if the user had interrupted it, when nobody had.
    harness = await start(tmp_path, turns=[final("never given")])

    async def stray(*args: Any, **kwargs: Any) -> Any:
        elsewhere = asyncio.get_running_loop().create_future()
        elsewhere.cancel()
        return await elsewhere

    monkeypatch.setattr(scripted(harness), "complete", stray)
    try:
        result = await run_agent(harness, "go")
        assert result.reason is StopReason.PROVIDER_ERROR
        assert result.error == (
            "provider 'scripted': the request was cancelled although the run was not aborted "
            "(the provider let out the cancellation of something it awaited)"
        )
        assert result.session_id is not None
        assert (await events_of(harness, result.session_id))[-1].payload["reason"] == "provider-error"
    finally:
        await harness.aclose()


async def test_resuming_a_session_rebuilds_the_history(tmp_path: Path) -> None:
    turns = [
        calls(call("add", {"a": 1, "b": 2}, "c1")),
        final("3"),
        final("still 3", expect={"last_content_contains": "and now?"}),
    ]
    harness = await start(tmp_path, tools=[tool("add", add, params=ADD_PARAMS)], turns=turns)
    try:
        first = await run_agent(harness, "1+2?")
        second = await run_agent(harness, "and now?", session_id=first.session_id)
        assert second.ok and second.answer == "still 3" and second.session_id == first.session_id
        assert [m["role"] for m in second.messages] == ["user", "assistant", "tool", "assistant", "user", "assistant"]
        request = scripted(harness).requests[-1]["messages"]
        assert [m["role"] for m in request] == ["system", "user", "assistant", "tool", "assistant", "user"]
        assert first.session_id is not None
        events = await events_of(harness, first.session_id)
        starts = [e.payload["resumed"] for e in events if e.kind == "run/start"]
        assert starts == [False, True]
    finally:
        await harness.aclose()


def test_history_repairs_a_step_interrupted_before_its_results() -> None:
    def event(seq: int, kind: str, message: dict[str, Any]) -> SessionEvent:
        return SessionEvent("s", seq, kind, {"message": message}, 0.0)

    assistant = {"role": "assistant", "content": None, "tool_calls": [call("a", {}, "x"), call("b", {}, "y")]}
    events = [
        event(1, "message/user", {"role": "user", "content": "go"}),
        event(2, "message/assistant", assistant),
        event(3, "tool/result", {"role": "tool", "tool_call_id": "x", "content": "fine"}),
    ]
    history = history_from_events(events)
    assert [m.get("tool_call_id") for m in history] == [None, None, "x", "y"]
    assert "interrupted" in history[-1]["content"]


def test_history_drops_tool_results_no_preceding_assistant_message_asked_for() -> None:
    # What two runs appending to one session at once left behind (before sessions were leased): their
    # messages interleaved, so results follow the other run's assistant message, or none at all.
    def event(seq: int, kind: str, message: dict[str, Any]) -> SessionEvent:
        return SessionEvent("s", seq, kind, {"message": message}, 0.0)

    def asks(call_id: str) -> dict[str, Any]:
        return {"role": "assistant", "content": None, "tool_calls": [call("slow", {}, call_id)]}

    def result(call_id: str) -> dict[str, Any]:
        return {"role": "tool", "tool_call_id": call_id, "content": "{}"}

    messages = [
        {"role": "user", "content": "start"},
        {"role": "assistant", "content": "first"},
        result("orphan"),
        {"role": "user", "content": "continue A"},
        {"role": "user", "content": "continue B"},
        asks("call_B"),
        result("call_B"),
        asks("call_A"),
        result("call_B"),
        result("call_A"),
        result("call_A"),
        {"role": "assistant", "content": "second"},
        result("call_A"),
        {"role": "assistant", "content": "second"},
    ]
    kinds = {"user": "message/user", "assistant": "message/assistant", "tool": "tool/result"}
    history = history_from_events([event(seq, kinds[m["role"]], m) for seq, m in enumerate(messages, start=1)])
    shape = [
        (m["role"], m.get("tool_call_id") or [c["id"] for c in m.get("tool_calls") or []] or m["content"])
        for m in history
    ]
    assert shape == [
        ("user", "start"),
        ("assistant", "first"),
        ("user", "continue A"),
        ("user", "continue B"),
        ("assistant", ["call_B"]),
        ("tool", "call_B"),
        ("assistant", ["call_A"]),
        ("tool", "call_A"),
        ("assistant", "second"),
        ("assistant", "second"),
    ]
    # Every tool message answers a call of the assistant message before it, once.
    for position, message in enumerate(history):
        if message["role"] == "tool":
            owner = next(m for m in reversed(history[:position]) if m["role"] != "tool")
            assert message["tool_call_id"] in [c["id"] for c in owner.get("tool_calls") or []]


class AskingPlugin(ToolsPlugin):
    """Asks a person before every call."""

    @hookimpl
    def dsh_pre_execute(self, execution: Any) -> PreDecision:
        return PreDecision.ask("writes files")


async def test_approvals_go_through_the_run_approver_and_are_recorded(tmp_path: Path) -> None:
    asked: list[str] = []

    async def approver(request: Any) -> ApprovalOutcome:
        asked.append(request.execution.name)
        return ApprovalOutcome.REJECTED

    turns = [calls(call("t", {}, "c")), final("ok")]
    harness = await start(tmp_path, tools=[tool("t", add)], turns=turns, plugin=AskingPlugin([]))
    try:
        result = await run_agent(harness, "go", approver=approver)
        assert asked == ["t"]
        assert result.messages[2]["content"] == 'Error: the user rejected tool "t"'
        assert result.session_id is not None
        events = await events_of(harness, result.session_id)
        approval = next(e for e in events if e.kind == "approval")
        assert approval.payload == {"name": "t", "call_id": "1.1", "reason": "writes files", "outcome": "rejected"}
        assert approval.root_call_id == "1.1"
        # Without an approver (headless, no terminal) nobody can allow the call, and that is recorded too.
        again = await run_agent(harness, "go")
        assert "no approval channel is available" in again.messages[2]["content"]
        assert again.session_id is not None
        unavailable = next(e for e in await events_of(harness, again.session_id) if e.kind == "approval")
        assert unavailable.payload["outcome"] == "unavailable"
    finally:
        await harness.aclose()


async def test_a_missing_provider_or_store_fails_with_a_clear_message(tmp_path: Path) -> None:
    from dsh_core.errors import ConfigError

    harness = await start(tmp_path, agent={"provider": "nope"})
    try:
        with pytest.raises(ConfigError, match=r"agents\[main\].provider: no provider named 'nope'.*known: scripted"):
            await run_agent(harness, "go")
    finally:
        await harness.aclose()


def test_the_console_observer_shows_calls_outcomes_and_the_end(tmp_path: Path) -> None:
    import io

    from rich.console import Console

    from dsh_core.agent.cli import ConsoleObserver
    from dsh_core.agent.loop import RunResult, ToolCallRecord
    from dsh_core.model import ToolResult

    out = io.StringIO()
    observer = ConsoleObserver(Console(file=out, width=200, color_system=None))
    observer.on_step(1)
    observer.on_assistant({"role": "assistant", "content": "Reading [bold]", "tool_calls": [call("read", {})]})
    record = ToolCallRecord(
        index=0,
        call_id="1.1",
        tool_call_id="c",
        name="read",
        raw_arguments='{"path": "a"}',
        mode="parallel",
        duration_ms=3.2,
    )
    observer.on_tool_start(record)
    record.result = ToolResult.failure("DENIED", "outside the workspace")
    observer.on_tool_end(record)
    observer.on_end(RunResult(StopReason.FINAL_ANSWER, "x", 1, (), "s-1"))
    assert out.getvalue().splitlines() == [
        "· step 1: asking the model…",
        "  Reading [bold]",
        '  → read {"path": "a"} (parallel)',
        "  ✗ read DENIED 3 ms outside the workspace",
        "· final-answer after 1 turn(s) · session s-1",
    ]


def test_the_console_observer_shows_escape_sequences_instead_of_obeying_them() -> None:
    import io

    from rich.console import Console

    from dsh_core.agent.cli import ConsoleObserver
    from dsh_core.agent.loop import ToolCallRecord
    from dsh_core.model import ToolResult

    out = io.StringIO()
    observer = ConsoleObserver(Console(file=out, width=200, force_terminal=True, color_system=None))
    observer.on_assistant({"role": "assistant", "content": "hi\x1b[2J", "tool_calls": [call("read", {})]})
    record = ToolCallRecord(
        index=0,
        call_id="1.1",
        tool_call_id="c",
        name="x\x1b]52;c;eA==\x07",
        raw_arguments='{"p": "\u202eexe.txt"}',
        mode="serial",
        duration_ms=1.0,
    )
    observer.on_tool_start(record)
    record.result = ToolResult.failure("UNKNOWN_TOOL", "no \x1b[31mtool")
    observer.on_tool_end(record)
    text = out.getvalue()
    assert not any(ch in text for ch in "\x1b\x07\u202e"), repr(text)
    assert "hi\\x1b[2J" in text and "x\\x1b]52;c;eA==\\x07" in text and "\\u202eexe.txt" in text


async def test_a_failing_observer_is_logged_and_the_run_goes_on(tmp_path: Path, caplog: Any) -> None:
    """An observer that raises in a parallel batch once ended the run and left the other call running."""
    from dsh_core.agent.loop import LoopObserver

    finished: list[str] = []

    def sleeper(name: str, seconds: float) -> Any:
        async def body(args: Any, ctx: Any) -> Any:
            await asyncio.sleep(seconds)
            finished.append(name)
            return "ok"

        return body

    class Broken(LoopObserver):
        async def on_text(self, fragment: str) -> None:
            raise RuntimeError("on_text bug")

        def on_step(self, step: int) -> None:
            raise RuntimeError("on_step bug")

        def on_tool_end(self, record: Any) -> None:
            if record.name == "fast":
                raise RuntimeError("observer bug")

        def on_end(self, result: Any) -> None:
            raise RuntimeError("on_end bug")

    harness = await start(
        tmp_path,
        tools=[tool("fast", sleeper("fast", 0.01), safe=True), tool("slow", sleeper("slow", 0.2), safe=True)],
        turns=[calls(call("fast", {}), call("slow", {})), final("both done")],
    )
    try:
        with caplog.at_level("WARNING", logger="dsh"):
            result = await run_agent(harness, "go", observer=Broken())
    finally:
        await harness.aclose()
    assert result.reason is StopReason.FINAL_ANSWER and result.answer == "both done"
    assert sorted(finished) == ["fast", "slow"]
    tool_messages = [m for m in result.messages if m["role"] == "tool"]
    assert [m["content"] for m in tool_messages] == ["ok", "ok"]
    assert "agent loop observer Broken.on_tool_end failed; the run goes on" in caplog.text
    assert "Broken.on_step failed" in caplog.text and "Broken.on_end failed" in caplog.text


async def test_a_parallel_batch_that_fails_leaves_nothing_running() -> None:
    from dsh_core.agent.loop import _all_or_none

    events: list[str] = []

    async def fails() -> None:
        await asyncio.sleep(0.01)
        raise ValueError("first failure")

    async def slow(name: str) -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            events.append(f"{name} cancelled")
            raise

    before = asyncio.all_tasks()
    with pytest.raises(ValueError, match="first failure"):
        await _all_or_none([slow("a"), fails(), slow("b")])
    assert sorted(events) == ["a cancelled", "b cancelled"]
    assert [t for t in asyncio.all_tasks() - before if not t.done()] == []
    # Cancelled from outside: the batch is cancelled and awaited too.
    events.clear()
    batch = asyncio.ensure_future(_all_or_none([slow("c"), slow("d")]))
    await asyncio.sleep(0.01)
    batch.cancel()
    with pytest.raises(asyncio.CancelledError):
        await batch
    assert sorted(events) == ["c cancelled", "d cancelled"]
    assert [t for t in asyncio.all_tasks() - before if not t.done()] == []


def test_the_console_observer_shows_a_plugins_odd_error_code_and_a_huge_name_cut() -> None:
    """An error code with rich markup in it lost the whole line; a 20,000-character tool name was printed whole."""
    import io

    from rich.console import Console

    from dsh_core.agent.cli import ConsoleObserver
    from dsh_core.agent.loop import ToolCallRecord
    from dsh_core.model import ToolResult

    out = io.StringIO()
    observer = ConsoleObserver(Console(file=out, width=400, color_system=None))
    record = ToolCallRecord(
        index=0, call_id="1.1", tool_call_id="c", name="n" * 20_000, raw_arguments="{}", mode="serial", duration_ms=1.0
    )
    observer.on_tool_start(record)
    record.result = ToolResult.failure("QUOTA[/]", "over")
    observer.on_tool_end(record)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and all(len(line) < 200 for line in lines), [line[:100] for line in lines]
    assert lines[1].endswith("QUOTA[/] 1 ms over"), lines[1][-60:]


async def test_a_cancellation_while_a_step_s_results_are_written_keeps_them(tmp_path: Path) -> None:
    """The calls had all run (a file written, say): a cancel cutting their results' write lost every one,
    and a resumed run told the model they had been interrupted, so it ran them again."""
    writing = asyncio.Event()

    async def done(args: Any, ctx: Any) -> Any:
        return f"{args['n']} done"

    class SlowResults:
        """The deployment's store, with a write of tool results that takes a while (a slow disk)."""

        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

        async def append(self, session_id: str, events: Any, *, lease: Any = None) -> Any:
            if any(event.kind == "tool/result" for event in events):
                writing.set()
                await asyncio.sleep(0.2)
            return await self.inner.append(session_id, events, lease=lease)

    harness = await start(
        tmp_path,
        tools=[tool("once", done)],
        turns=[calls(call("once", {"n": 1}, "o1"), call("once", {"n": 2}, "o2")), final("never")],
    )
    store = open_session_store(harness)
    try:
        task = asyncio.ensure_future(run_agent(harness, "go", store=SlowResults(store)))
        await asyncio.wait_for(writing.wait(), 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        (info,) = await store.list()
        events = await store.load(info.id)
    finally:
        await store.close()
        await harness.aclose()
    assert [e.kind for e in events][-3:] == ["tool/result", "tool/result", "run/end"]
    tool_messages = [m for m in history_from_events(events) if m["role"] == "tool"]
    assert [(m["tool_call_id"], m["content"]) for m in tool_messages] == [("o1", "1 done"), ("o2", "2 done")]


async def test_arguments_cut_off_at_the_output_limit_are_called_cut_off(tmp_path: Path) -> None:
    """A reply that hit max_tokens ends mid-arguments: told only "not valid JSON", the model sent the same
    too-long call again, and again, until the turn limit."""

    async def body(args: Any, ctx: Any) -> Any:
        return "ran"

    cut = calls(call("write", '{"path": "big.txt", "content": "aaaa', "w1"))
    cut["_meta"] = {"finish_reason": "length"}
    harness = await start(
        tmp_path, tools=[tool("write", body)], turns=[cut, calls(call("write", '{"a": 1,', "w2")), final("ok")]
    )
    try:
        result = await run_agent(harness, "go")
        first, second = [m["content"] for m in result.messages if m["role"] == "tool"]
        assert first.startswith('Error: the arguments of tool call "write" are not valid JSON')
        assert "cut off at the model's output limit" in first and "finish_reason 'length'" in first
        assert "cut off" not in second  # a reply that finished is not said to be cut off
    finally:
        await harness.aclose()


async def test_a_call_is_classified_when_its_turn_comes_not_when_its_step_began(tmp_path: Path) -> None:
    """An earlier call of the step replaces a tool by one that is not concurrency-safe: the later
    calls of that tool run one at a time, not as the parallel batch the step began with."""
    overlaps: list[bool] = []
    active = {"n": 0}

    async def careful(args: Any, ctx: Any) -> Any:
        active["n"] += 1
        overlaps.append(active["n"] > 1)
        await asyncio.sleep(0)  # the other call of the batch, if any, starts here
        active["n"] -= 1
        return "careful"

    async def swap(args: Any, ctx: Any) -> Any:
        # A tool that (re)defines tools, as a dynamic package would: "x" is no longer safe.
        registry = harness.registry
        registry.register(tool("x", careful), scope=ctx.execution.agent)
        return "swapped"

    async def sloppy(args: Any, ctx: Any) -> Any:
        return "sloppy"

    turns = [calls(call("swap", {}, "s"), call("x", {"i": 1}, "x1"), call("x", {"i": 2}, "x2")), final("done")]
    harness = await start(tmp_path, tools=[tool("swap", swap), tool("x", sloppy, safe=True)], turns=turns)
    try:
        result = await run_agent(harness, "go")
        assert result.ok
        assert [m["content"] for m in result.messages if m["role"] == "tool"] == ["swapped", "careful", "careful"]
        assert overlaps == [False, False]
    finally:
        await harness.aclose()


@attrs.define
class _Swap:
    """One parallel batch of two calls, ``a`` and ``b``: while a person decides on ``a``, ``b``'s body runs
    and ``a`` turns not concurrency-safe: a dynamic package redefines it (``replace``), or its own
    ``is_concurrency_safe`` answers differently now. ``b``'s body goes on only once ``a`` has
    passed its guards (the last stage before its body, in its own task), then runs ``b_after``: a body of
    ``a`` that ran straight on would find ``b``'s still running."""

    harness: Any
    approver: Any
    #: For each run of ``a``'s new body: whether ``b``'s body was running then.
    overlaps: list[bool]
    #: Each call's one result event, as the runtime emitted it: ``(name, error code or None)``.
    emitted: list[tuple[str, str | None]]
    #: The bodies of ``a`` (old or new definition) that ran.
    ran: list[str]


async def _swap_while_approval_waits(tmp_path: Path, b_after: Any = None, *, replace: bool = False) -> _Swap:
    b_running = {"now": False}
    turned = {"now": False}
    ran: list[str] = []
    b_started = asyncio.Event()
    release_b = asyncio.Event()
    overlaps: list[bool] = []
    emitted: list[tuple[str, str | None]] = []

    async def careful(args: Any, ctx: Any) -> Any:
        ran.append("careful")
        overlaps.append(b_running["now"])
        return "careful"

    async def sloppy(args: Any, ctx: Any) -> Any:
        ran.append("sloppy")
        overlaps.append(b_running["now"])
        return "sloppy"

    async def b_body(args: Any, ctx: Any) -> Any:
        b_running["now"] = True
        b_started.set()
        try:
            await release_b.wait()
            if b_after is not None:
                await b_after()
        finally:
            b_running["now"] = False
        return "b"

    class AskForA(ToolsPlugin):
        @hookimpl
        def dsh_pre_execute(self, execution: Any) -> PreDecision:
            return PreDecision.ask("replaces a") if execution.name == "a" else PreDecision.allow()

        @hookimpl
        def dsh_guard(self, execution: Any) -> None:
            if execution.name == "a":
                release_b.set()

        @hookimpl
        def dsh_tool_result(self, execution: Any, result: Any) -> None:
            emitted.append((execution.name, result.code))

    async def approver(request: Any) -> ApprovalOutcome:
        await b_started.wait()  # the person decides while b's body runs ...
        if replace:  # ... and meanwhile a dynamic package redefines "a" as not concurrency-safe,
            harness.registry.register(tool("a", careful), scope=request.execution.agent)
        else:  # ... or "a" is no longer safe to run beside others with these arguments.
            turned["now"] = True
        return ApprovalOutcome.ALLOWED

    a = define_tool(
        name="a",
        description="The a test tool.",
        parameters={"type": "object"},
        execute=sloppy if replace else careful,
        is_concurrency_safe=lambda args: not turned["now"],
    )
    turns = [calls(call("a", {}, "a"), call("b", {}, "b")), final("done")]
    harness = await start(tmp_path, tools=[a, tool("b", b_body, safe=True)], turns=turns, plugin=AskForA([]))
    return _Swap(harness, approver, overlaps, emitted, ran)


async def test_a_call_replaced_by_an_exclusive_tool_while_approval_waits_runs_no_body(tmp_path: Path) -> None:
    """The first call's tool is replaced while its approval waits: the person approved the old definition,
    so neither body runs; the call fails at once (it does not wait for the other body, as the new tool's
    exclusivity is nothing to it) under the mode its judged definition has, and may be made again."""
    swap = await _swap_while_approval_waits(tmp_path, replace=True)
    try:
        result = await asyncio.wait_for(run_agent(swap.harness, "go", approver=swap.approver), 5)
        assert result.ok
        contents = [m["content"] for m in result.messages if m["role"] == "tool"]
        assert contents == [
            'Error: tool call aborted before dispatch: tool "a" was replaced while the call waited, '
            "and its new definition was not judged by this call's policy; call it again",
            "b",
        ]
        assert swap.ran == []
        assert sorted(swap.emitted) == [("a", "ABORTED_BEFORE_DISPATCH"), ("b", None)]
        assert result.session_id is not None
        events = await events_of(swap.harness, result.session_id)
        assert [e.payload["execution_mode"] for e in events if e.kind == "tool/result"] == ["parallel", "parallel"]
    finally:
        await swap.harness.aclose()


async def test_a_call_turned_exclusive_while_approval_waits_runs_its_body_alone(tmp_path: Path) -> None:
    """The first call turns exclusive while its approval waits: classified again once its approval
    answered, its body waits for the second's to end. An exclusive body never runs beside another body."""
    swap = await _swap_while_approval_waits(tmp_path)
    try:
        result = await asyncio.wait_for(run_agent(swap.harness, "go", approver=swap.approver), 5)
        assert result.ok
        assert [m["content"] for m in result.messages if m["role"] == "tool"] == ["careful", "b"]
        assert swap.overlaps == [False]
        assert result.session_id is not None
        events = await events_of(swap.harness, result.session_id)
        # tool/call is written before anything runs, with the mode planned then; tool/result records the
        # mode each call ran under.
        assert [e.payload["execution_mode"] for e in events if e.kind == "tool/call"] == ["parallel", "parallel"]
        assert [e.payload["execution_mode"] for e in events if e.kind == "tool/result"] == ["exclusive", "parallel"]
    finally:
        await swap.harness.aclose()


async def test_a_call_waiting_for_the_bodies_in_flight_is_aborted_before_dispatch(tmp_path: Path) -> None:
    """The run aborts while the reclassified call waits for the other body: that one ends aborted, and
    the waiting one never runs its body (aborted before dispatch); results stay in call order."""
    controller = AbortController()

    async def abort() -> None:
        controller.abort("test")

    swap = await _swap_while_approval_waits(tmp_path, abort)
    try:
        result = await asyncio.wait_for(
            run_agent(swap.harness, "go", approver=swap.approver, signal=controller.signal), 5
        )
        assert result.reason is StopReason.ABORTED
        assert swap.overlaps == []
        contents = [m["content"] for m in result.messages if m["role"] == "tool"]
        assert contents == ["Error: tool call aborted before dispatch", "Error: tool call aborted"]
    finally:
        await swap.harness.aclose()


async def test_a_call_waiting_for_the_bodies_in_flight_still_emits_its_result_when_cancelled(tmp_path: Path) -> None:
    """The run is cancelled while the reclassified call waits for the other body: neither body outlives the
    run, the waiting one never starts, and each call still emits its one result."""
    waited = asyncio.Event()

    async def forever() -> None:
        waited.set()  # the reclassified call is waiting by now: it stopped at its place before b went on
        await asyncio.Event().wait()

    swap = await _swap_while_approval_waits(tmp_path, forever)
    try:
        task = asyncio.ensure_future(run_agent(swap.harness, "go", approver=swap.approver))
        await asyncio.wait_for(waited.wait(), 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 5)
        assert swap.overlaps == []
        assert sorted(swap.emitted) == [("a", "ABORTED_BEFORE_DISPATCH"), ("b", "ABORTED")]
    finally:
        await swap.harness.aclose()
