"""Quiescence (issue 4 item 7): nothing runs after run_code returns, whatever ends the program."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from codemode_kit import Env, FakeCodeRuntime, Recorder, tool

from dsh_core import hookimpl
from dsh_core.abort import AbortController
from dsh_core.errors import ErrorCode


class Bodies:
    def __init__(self) -> None:
        self.started: list[str] = []
        self.finished: list[str] = []
        self.saw_abort: list[str] = []

    def slow(self, name: str) -> Any:
        async def body(args: Any, ctx: Any) -> Any:
            self.started.append(name)
            try:
                await asyncio.wait_for(ctx.signal.wait(), 5)
                self.saw_abort.append(name)
                await asyncio.sleep(0.01)  # cleanup after the abort, still awaited
            finally:
                self.finished.append(name)
            return None

        return body


async def test_aborting_the_outer_call_aborts_in_flight_and_abandons_queued_calls() -> None:
    env = Env()
    bodies = Bodies()
    env.add(tool("slow", bodies.slow("slow"), safe=True), tool("after", bodies.slow("after")))
    controller = AbortController()
    program = """
import asyncio
results = await asyncio.gather(tools.slow({}), tools.slow({}), tools.after({}), return_exceptions=True)
"""
    run = asyncio.ensure_future(env.run(program, signal=controller.signal))
    while len(bodies.started) < 2:
        await asyncio.sleep(0.001)
    controller.abort("user pressed stop")
    result = await run
    assert result.is_error
    assert bodies.saw_abort == ["slow", "slow"] and bodies.finished == ["slow", "slow"]
    assert "after" not in bodies.started  # queued: abandoned, never started
    assert env.sink is not None
    assert env.sink.kinds() == [
        ("tool/code-dispatch-start", "call-1:code:1"),
        ("tool/code-dispatch-start", "call-1:code:2"),
        ("tool/code-dispatch", "call-1:code:1"),
        ("tool/code-dispatch", "call-1:code:2"),
    ]
    assert all(e["payload"]["error_code"] == "ABORTED" for e in env.sink.events if e["kind"] == "tool/code-dispatch")


async def test_nothing_keeps_running_after_run_code_returns(env: Env) -> None:
    bodies = Bodies()
    env.add(tool("slow", bodies.slow("slow")))
    program = "import asyncio\nasyncio.ensure_future(tools.slow({}))\nawait asyncio.sleep(0.01)\nreturn 'early'"
    tasks_before = asyncio.all_tasks()
    result = await env.run(program)
    assert result.value["result"] == "early"
    # The started body saw the settlement abort and finished before run_code resolved.
    assert bodies.finished == ["slow"] and bodies.saw_abort == ["slow"]
    await asyncio.sleep(0)
    leftover = [t for t in asyncio.all_tasks() - tasks_before if not t.done()]
    assert leftover == []


async def test_a_late_binding_call_is_rejected_without_dispatch(env: Env) -> None:
    ran: list[str] = []

    async def body(args: Any, ctx: Any) -> Any:
        ran.append("x")
        return None

    env.add(tool("echo", body))
    captured: dict[str, Any] = {}
    program = "import builtins\nbuiltins._dsh_test_tools = tools\nreturn 1"
    await env.run(program)
    import builtins

    late = builtins._dsh_test_tools  # type: ignore[attr-defined]
    del builtins._dsh_test_tools  # type: ignore[attr-defined]
    try:
        await late.echo({})
    except Exception as error:
        captured["error"] = error
    assert type(captured["error"]).__name__ == "ToolCallError"
    assert str(captured["error"]) == "run_code run is over (run_code settled); echo not dispatched"
    assert ran == []
    assert env.sink is not None and env.sink.events == []


async def test_a_runtime_that_starts_a_binding_and_then_rejects_still_reaches_quiescence() -> None:
    env = Env()
    assert env.fake is not None
    env.fake.raise_after_binding = True
    bodies = Bodies()
    env.add(tool("slow", bodies.slow("slow")))
    result = await env.run("pass")
    assert result.code == ErrorCode.TOOL_FAILED
    assert result.error is not None and "runtime broke after starting a binding" in result.error.message
    assert bodies.finished == ["slow"]  # the started body was awaited before run_code returned
    assert env.sink is not None and [k for k, _ in env.sink.kinds()] == [
        "tool/code-dispatch-start",
        "tool/code-dispatch",
    ]
    await asyncio.gather(*env.fake.binding_tasks, return_exceptions=True)


async def test_cancelling_the_outer_task_still_drains_before_propagating() -> None:
    env = Env()
    bodies = Bodies()
    env.add(tool("slow", bodies.slow("slow")))
    run = asyncio.ensure_future(env.run("await tools.slow({})"))
    while not bodies.started:
        await asyncio.sleep(0.001)
    run.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await run
    assert bodies.finished == ["slow"]
    assert env.sink is not None and [k for k, _ in env.sink.kinds()][-1] == "tool/code-dispatch"


class _CancelsItsCaller(FakeCodeRuntime):
    """A fake runtime whose run, as it returns, has the awaiting task cancelled ``hops`` loop callbacks later."""

    def __init__(self, hops: int) -> None:
        super().__init__()
        self.hops = hops

    async def run(self, program: str, bindings: Any, signal: Any = None) -> Any:
        result = await super().run(program, bindings, signal)
        loop = asyncio.get_running_loop()
        caller = asyncio.current_task()
        assert caller is not None

        def hop(left: int) -> None:
            if left:
                loop.call_soon(hop, left - 1)
            else:
                caller.cancel()

        loop.call_soon(hop, self.hops)
        return result


async def test_a_cancel_arriving_as_the_drain_ends_still_cancels_run_code() -> None:
    # The cancel lands while run_code awaits its (instantly quiescent) drain, which ends in that same
    # loop turn: the cancellation must still propagate, not be swallowed with run_code returning as
    # if nobody had cancelled it (the caller's task would run on, its asyncio.timeout never firing).
    for hops in range(3):
        run = asyncio.ensure_future(Env(code_runtime=_CancelsItsCaller(hops)).run("return 1"))
        outcome = await asyncio.gather(run, return_exceptions=True)
        assert run.cancelled(), (hops, outcome)


async def test_each_program_owns_its_scheduler() -> None:
    env = Env(cap=2)
    active = {"n": 0, "peak": 0}

    async def body(args: Any, ctx: Any) -> Any:
        active["n"] += 1
        active["peak"] = max(active["peak"], active["n"])
        await asyncio.sleep(0.01)
        active["n"] -= 1
        return None

    env.add(tool("safe", body, safe=True))
    program = "import asyncio\nawait asyncio.gather(*(tools.safe({}) for _ in range(4)))"
    # Two concurrent programs (e.g. two agents): the cap is per program, not process-wide.
    other = FakeCodeRuntime()
    assert other is not None
    await asyncio.gather(env.run(program, call_id="a"), env.run(program, call_id="b"))
    assert active["peak"] == 4


def _raising_listener_tool(state: dict[str, Any]) -> Any:
    """A body whose abort listener raises (closing what is already closed) and which ignores the abort."""

    async def body(args: Any, ctx: Any) -> Any:
        def close_connection(reason: object) -> None:
            raise RuntimeError("connection already closed")

        ctx.signal.add_listener(close_connection)
        state["running"] = True
        await asyncio.sleep(0.1)
        state["running"] = False
        return {"done": True}

    return body


async def test_a_raising_abort_listener_neither_cuts_the_drain_nor_replaces_the_outcome(caplog: Any) -> None:
    env = Env()
    state: dict[str, Any] = {}
    recorder = Recorder()
    env.add(tool("slow", _raising_listener_tool(state), safe=True))
    env.plug(recorder)
    outer = AbortController()
    program = "import asyncio\nt = asyncio.ensure_future(tools.slow({}))\nawait asyncio.sleep(0.02)\nreturn 'kept'"
    with caplog.at_level("WARNING", logger="dsh"):
        result = await env.run(program, signal=outer.signal)
    assert not result.is_error and result.text == "kept"  # the program's own outcome stands
    assert state["running"] is False  # the nested body finished before run_code returned
    assert env.sink is not None
    assert env.sink.kinds() == [("tool/code-dispatch-start", "call-1:code:1"), ("tool/code-dispatch", "call-1:code:1")]
    assert [e.call_id for e, _ in recorder.results] == ["call-1:code:1", "call-1"]
    assert not outer.signal._listeners  # the outer listener is removed too
    assert "abort listener" in caplog.text and "connection already closed" in caplog.text
    assert "close_connection" in caplog.text  # the culprit is named


async def test_a_raising_abort_listener_does_not_reach_whoever_aborts_the_outer_call(caplog: Any) -> None:
    env = Env()
    state: dict[str, Any] = {}
    env.add(tool("slow", _raising_listener_tool(state), safe=True))
    outer = AbortController()
    run = asyncio.ensure_future(env.run("await tools.slow({})", signal=outer.signal))
    while not state.get("running"):
        await asyncio.sleep(0.001)
    with caplog.at_level("WARNING", logger="dsh"):
        outer.abort("user pressed stop")  # must not raise the nested tool's error here
        result = await run
    assert result.code == ErrorCode.CODE_RUN_FAILED and "user pressed stop" in result.text
    assert state["running"] is False
    assert "connection already closed" in caplog.text


class Stubborn:
    """Bodies that ignore their abort signal: only a cancellation stops them."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.cancelled: list[str] = []

    def body(self, name: str) -> Any:
        async def body(args: Any, ctx: Any) -> Any:
            self.started.append(name)
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                self.cancelled.append(name)
                raise
            return None

        return body


async def test_cancelling_the_outer_task_cuts_bodies_that_ignore_their_signal() -> None:
    """As a native call's body is cut by a cancel, so are a program's: parallel ones in tasks and one on the lane."""
    for program, names in [
        ("import asyncio\nawait asyncio.gather(tools.safe({}), tools.safe({}))", ["safe", "safe"]),
        ("await tools.alone({})", ["alone"]),
    ]:
        env = Env()
        stubborn = Stubborn()
        env.add(tool("safe", stubborn.body("safe"), safe=True), tool("alone", stubborn.body("alone")))
        tasks_before = asyncio.all_tasks()
        run = asyncio.ensure_future(env.run(program))
        while len(stubborn.started) < len(names):
            await asyncio.sleep(0.001)
        run.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(run, 10)  # a hang guard: before the fix this waited out the 60 s bodies
        assert run.cancelled()
        assert stubborn.cancelled == names
        assert env.sink is not None
        settles = [e for e in env.sink.events if e["kind"] == "tool/code-dispatch"]
        assert [e["payload"]["error_code"] for e in settles] == ["ABORTED"] * len(names)
        await asyncio.sleep(0)
        assert [t for t in asyncio.all_tasks() - tasks_before if not t.done()] == []


async def test_a_cancel_during_the_drain_after_an_abort_cuts_the_bodies_still_running() -> None:
    """The CLI's second Ctrl-C: the first aborted the run, whose drain waits for a body that ignores it."""
    env = Env()
    stubborn = Stubborn()
    env.add(tool("safe", stubborn.body("safe"), safe=True))
    controller = AbortController()
    run = asyncio.ensure_future(env.run("await tools.safe({})", signal=controller.signal))
    while not stubborn.started:
        await asyncio.sleep(0.001)
    controller.abort("interrupted")
    await asyncio.sleep(0.05)
    assert not run.done() and not stubborn.cancelled  # the drain waits for the body
    run.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.wait_for(run, 10)
    assert run.cancelled() and stubborn.cancelled == ["safe"]
    assert env.sink is not None and [k for k, _ in env.sink.kinds()] == [
        "tool/code-dispatch-start",
        "tool/code-dispatch",
    ]


async def test_cancelling_the_outer_task_cuts_a_policy_hook_that_ignores_its_signal() -> None:
    """As a native call in a slow pre-execute hook is cut by a cancel, so is a program's call in one."""
    entered: list[str] = []
    cut: list[str] = []

    class SlowPolicy:
        @hookimpl
        def dsh_pre_execute(self, execution: Any) -> Any:
            if not execution.nested:
                return None

            async def remote_policy_service() -> None:
                entered.append(execution.call_id)
                try:
                    await asyncio.sleep(60)  # ignores the call's signal
                except asyncio.CancelledError:
                    cut.append(execution.call_id)
                    raise

            return remote_policy_service()

    env = Env()
    recorder = Recorder()
    env.plug(SlowPolicy())
    env.plug(recorder)
    env.add(tool("read"))
    tasks_before = asyncio.all_tasks()
    # The program catches its call's error: the fake runtime leaves a cancelled run's program task
    # behind, and nobody would retrieve that error.
    run = asyncio.ensure_future(env.run("try:\n    await tools.read({})\nexcept ToolCallError:\n    pass"))
    while not entered:
        await asyncio.sleep(0.001)
    run.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.wait_for(run, 10)  # a hang guard: before the fix this waited out the 60 s hook
    assert run.cancelled()
    assert cut == ["call-1:code:1"]
    assert env.sink is not None
    assert [(e["kind"], e["payload"].get("error_code")) for e in env.sink.events] == [
        ("tool/code-dispatch-start", None),
        ("tool/code-dispatch", "ABORTED_BEFORE_DISPATCH"),
    ]
    nested = [result.code for execution, result in recorder.results if execution.call_id == "call-1:code:1"]
    assert nested == [ErrorCode.ABORTED_BEFORE_DISPATCH]  # its one result event
    await asyncio.sleep(0)
    assert [t for t in asyncio.all_tasks() - tasks_before if not t.done()] == []
