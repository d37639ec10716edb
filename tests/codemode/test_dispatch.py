"""Nested dispatch (issue 4 item 3) and CODEMODE-TEST-POLICY-FAILURE: every nested call passes the pipeline."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from codemode_kit import Env, Recorder, tool

from dsh_core import ContextMessage, PostDecision, PreDecision, ToolError, hookimpl
from dsh_core.abort import AbortController, AbortSignal
from dsh_core.errors import ErrorCode
from dsh_core.lossless import FrozenDict
from dsh_core.model import ApprovalOutcome, ToolExecutionInput, ToolResult

# -- identity of nested calls ------------------------------------------------------------------------


async def test_nested_calls_carry_sub_call_ids_agent_root_and_the_opaque_parent_token(env: Env) -> None:
    seen: list[Any] = []

    async def body(args: Any, ctx: Any) -> Any:
        seen.append(ctx.execution)
        return args

    env.add(tool("echo", body))
    recorder = Recorder()
    env.plug(recorder)
    result = await env.run(
        "await tools.echo({'n': 1})\nawait tools.echo(n=2)", call_id="outer-7", root_call_id="root-3"
    )
    assert not result.is_error, result
    assert [e.call_id for e in seen] == ["outer-7:code:1", "outer-7:code:2"]
    assert [e.arguments for e in seen] == [{"n": 1}, {"n": 2}]
    outer = next(e for e, _ in recorder.results if e.name == "run_code")
    for execution in seen:
        assert execution.agent is env.agent
        assert execution.root_call_id == "root-3"
        assert execution.parent is outer.token
        assert execution.nested
    # tools/result observers of nested calls see only the opaque token: no call id, no execution.
    nested = [e for e, _ in recorder.results if e.nested]
    assert len(nested) == 2 and all(type(e.parent).__name__ == "ExecutionToken" for e in nested)
    assert not hasattr(nested[0].parent, "call_id") and repr(nested[0].parent) == "<ExecutionToken>"
    # Exactly one tools/result per execution, nested ones included; the outer one last.
    assert [e.call_id for e, _ in recorder.results] == ["outer-7:code:1", "outer-7:code:2", "outer-7"]


async def test_the_outer_result_holds_only_the_curated_output(env: Env) -> None:
    env.add(tool("secret", lambda a, c: _value({"token": "s3cr3t-payload"})))
    result = await env.run("r = await tools.secret({})\nprint('got', len(r['token']))")
    assert result.text == "got 14"
    assert "s3cr3t" not in result.text and "s3cr3t" not in str(result.value)
    assert result.additional_contexts == ()


async def _value(value: Any) -> Any:
    return value


async def test_namespace_is_a_snapshot_taken_when_the_program_starts(env: Env) -> None:
    ran: list[str] = []

    async def late_body(args: Any, ctx: Any) -> Any:
        ran.append("late")
        return "late"

    async def register_late(args: Any, ctx: Any) -> Any:
        env.add(tool("late", late_body))
        return "ok"

    env.add(tool("adder", register_late))
    program = """
await tools.adder({})
try:
    await tools.late({})
except AttributeError:
    print("late is not in this program's namespace")
"""
    result = await env.run(program)
    assert result.text == "late is not in this program's namespace"
    # The next run's snapshot has it.
    result = await env.run("return await tools.late({})", call_id="call-2")
    assert result.value == {"logs": [], "result": "late"} and ran == ["late"]


async def test_a_tool_unregistered_after_the_snapshot_fails_as_unknown_tool_and_never_runs(env: Env) -> None:
    ran: list[str] = []

    async def gone_body(args: Any, ctx: Any) -> Any:
        ran.append("gone")
        return None

    unregister = env.registry.register(tool("gone", gone_body))

    async def remove(args: Any, ctx: Any) -> Any:
        unregister()
        return None

    env.add(tool("remover", remove))
    program = """
await tools.remover({})
try:
    await tools.gone({})
except ToolCallError as error:
    print(error.tool_name, "|", error)
"""
    result = await env.run(program)
    assert result.text == 'gone | unknown tool "gone"'
    assert ran == []
    ends = [e for e in env.sink.events if e["kind"] == "tool/code-dispatch"]
    assert ends[1]["payload"]["error_code"] == ErrorCode.UNKNOWN_TOOL


async def test_run_code_is_never_a_binding_not_even_under_both() -> None:
    env = Env(mode="both")
    env.add(tool("echo"))
    result = await env.run("print(sorted(tools._functions))")
    assert result.text == "['echo']"


async def test_no_program_starts_another_program_not_even_through_a_tool_holding_its_token() -> None:
    """``run_code`` is no binding, and the executor itself refuses it as a nested call: a tool body
    that hands the program's parent token on (ctx.execution.parent) cannot start a second program."""
    env = Env(mode="both")
    inner: list[ToolResult] = []

    async def relay(args: Any, ctx: Any) -> Any:
        inner.append(
            await env.runtime.execute(
                ToolExecutionInput(
                    call_id="relay-1",
                    name="run_code",
                    arguments={"code": "print('inner ran')", "description": "Inner"},
                    signal=AbortSignal.never(),
                    agent=env.agent,
                    parent=ctx.execution.parent,
                )
            )
        )
        return "relayed"

    env.add(tool("relay", relay))
    program = (
        "await tools.relay({})\ntry:\n    await tools['run_code']({'code': '', 'description': 'd'})\n"
        "except KeyError:\n    print('no run_code binding')"
    )
    result = await env.run(program)
    assert result.text == "no run_code binding", result.text
    assert [r.code for r in inner] == [ErrorCode.UNKNOWN_TOOL]
    assert "cannot be called from inside a `run_code` program" in inner[0].text
    assert env.fake is not None and env.fake.runs == 1


@pytest.mark.parametrize("name", ["__proto__", "__class__", "constructor", "my-tool", "class"])
async def test_exotic_tool_names_are_ordinary_bindings(name: str) -> None:
    env = Env()
    env.add(tool(name, lambda a, c: _value(f"called {name}")))
    result = await env.run(f"return await tools[{name!r}]({{}})")
    assert result.value == {"logs": [], "result": f"called {name}"}


async def test_keyword_arguments_become_the_argument_object(env: Env) -> None:
    env.add(tool("echo"))
    result = await env.run("return await tools.echo(path='a', limit=3)")
    assert result.value["result"] == {"path": "a", "limit": 3}


# -- failures reaching the program ---------------------------------------------------------------------


async def test_a_tool_error_raises_tool_call_error_with_only_the_error_text(env: Env) -> None:
    async def fails(args: Any, ctx: Any) -> Any:
        raise ToolError("file not found: a.txt", code="NOT_FOUND")

    env.add(tool("read", fails))
    program = """
try:
    await tools.read({"path": "a.txt"})
except ToolCallError as error:
    print(type(error).__name__, error.tool_name, repr(str(error)))
"""
    result = await env.run(program)
    assert result.text == "ToolCallError read 'file not found: a.txt'"


async def test_a_tool_error_without_text_still_gives_the_program_a_message_naming_the_tool(env: Env) -> None:
    # An empty error text must not reach the program as an empty message (the worker's bridge then
    # fell back to the exception's class name, and the program read "SubCallError", an internal name).
    async def fails(args: Any, ctx: Any) -> Any:
        raise ToolError("")

    env.add(tool("read", fails))
    program = """
try:
    await tools.read({})
except ToolCallError as error:
    print(type(error).__name__, error.tool_name, repr(str(error)))
"""
    result = await env.run(program)
    assert result.text == "ToolCallError read 'tool \"read\" failed (TOOL_FAILED) with no error message'"


async def test_an_uncaught_tool_call_error_fails_the_run_with_code_run_failed(env: Env) -> None:
    async def fails(args: Any, ctx: Any) -> Any:
        raise RuntimeError("disk on fire")

    env.add(tool("read", fails))
    result = await env.run("print('before')\nawait tools.read({})")
    assert result.code == ErrorCode.CODE_RUN_FAILED
    assert result.error is not None
    assert result.error.message.startswith("code run failed (exception): ToolCallError: RuntimeError: disk on fire")
    assert result.error.message.endswith("\nCaptured output:\nbefore")


async def test_a_pre_execute_deny_reaches_the_program_as_tool_call_error(env: Env) -> None:
    ran: list[str] = []

    async def body(args: Any, ctx: Any) -> Any:
        ran.append("body")
        return None

    env.add(tool("rm", body))

    class Deny:
        @hookimpl
        def dsh_pre_execute(self, execution: Any) -> Any:
            return PreDecision.deny("rm is not allowed here") if execution.name == "rm" else None

    env.plug(Deny())
    result = await env.run("try:\n    await tools.rm({})\nexcept ToolCallError as e:\n    print(e)\nprint('went on')")
    assert result.text == "rm is not allowed here\nwent on"
    assert ran == []


async def test_a_throwing_pre_execute_listener_settles_the_sub_call_without_post_execute(env: Env) -> None:
    posts: list[str] = []

    class Broken:
        @hookimpl
        def dsh_pre_execute(self, execution: Any) -> Any:
            if execution.nested:
                raise ValueError("policy crashed")
            return None

        @hookimpl
        def dsh_post_execute(self, execution: Any, result: Any) -> Any:
            posts.append(execution.name)
            return None

    env.add(tool("echo"))
    env.plug(Broken())
    result = await env.run("try:\n    await tools.echo({})\nexcept ToolCallError as e:\n    print('failed:', e)")
    assert result.text == "failed: dsh_pre_execute of plugin 'test-plugin-1' failed: ValueError: policy crashed"
    assert posts == ["run_code"]  # the nested call skipped post-execute; the outer one did not


async def test_a_dsh_error_from_pre_execute_keeps_its_code(env: Env) -> None:
    class Typed:
        @hookimpl
        def dsh_pre_execute(self, execution: Any) -> Any:
            if execution.nested:
                raise ToolError("quota exceeded", code="QUOTA")
            return None

    env.add(tool("echo"))
    env.plug(Typed())
    await env.run("try:\n    await tools.echo({})\nexcept ToolCallError:\n    pass")
    end = next(e for e in env.sink.events if e["kind"] == "tool/code-dispatch")
    assert end["payload"]["error_code"] == "QUOTA"


async def test_guards_apply_to_nested_calls(env: Env) -> None:
    env.add(tool("write"))
    env.registry.guard(lambda execution: "writes are frozen" if execution.name == "write" else None)
    result = await env.run("try:\n    await tools.write({})\nexcept ToolCallError as e:\n    print(e)")
    assert result.text == "writes are frozen"


class _AgentPolicy:
    """An agent-scoped policy: denies ``write``, asks for ``bash`` and answers its own asks."""

    def __init__(self, answer: ApprovalOutcome) -> None:
        self.answer = answer
        self.seen: list[tuple[str, str, bool]] = []

    @hookimpl
    def dsh_pre_execute(self, execution: Any) -> Any:
        self.seen.append(("pre", execution.name, execution.nested))
        if execution.name == "write":
            return PreDecision.deny("this agent may not write")
        return PreDecision.ask("bash needs a yes") if execution.name == "bash" else None

    @hookimpl
    def dsh_approve(self, request: Any) -> Any:
        self.seen.append(("approve", request.execution.name, request.execution.nested))
        return self.answer


async def test_an_agent_scoped_policy_governs_its_agents_nested_calls_and_no_other_agents(env: Env) -> None:
    """Nested calls keep the program's agent: a policy plugin started in that agent's scope votes on
    and answers for each of them; one started in another agent's scope never sees them."""
    assert env.agent is not None
    ran: list[str] = []

    def body(name: str) -> Any:
        async def run(args: Any, ctx: Any) -> Any:
            ran.append(name)
            return name

        return run

    env.add(tool("read", body("read")), tool("write", body("write")), tool("bash", body("bash")))
    own, foreign = _AgentPolicy(ApprovalOutcome.REJECTED), _AgentPolicy(ApprovalOutcome.ALLOWED)
    env.plug(own, scope=env.agent)
    env.plug(foreign, scope=env.root.child("agent:other", layered=True))
    program = (
        "out = [await tools.read({})]\nfor name in ('write', 'bash'):\n    try:\n"
        "        out.append(await tools[name]({}))\n    except ToolCallError as e:\n        out.append(str(e))\n"
        "return out"
    )
    result = await env.run(program)
    assert result.value["result"] == ["read", "this agent may not write", 'the user rejected tool "bash"']
    assert ran == ["read"]
    assert [entry for entry in own.seen if entry[2]] == [
        ("pre", "read", True),
        ("pre", "write", True),
        ("pre", "bash", True),
        ("approve", "bash", True),
    ]
    assert foreign.seen == []


async def test_around_dispatch_wraps_nested_bodies_and_post_execute_reshapes_values(env: Env) -> None:
    order: list[str] = []

    class Policy:
        @hookimpl
        def dsh_around_dispatch(self, execution: Any) -> Any:
            async def middleware(call: Any, proceed: Any) -> ToolResult:
                order.append(f"enter {call.name}")
                result: ToolResult = await proceed(call)
                order.append(f"exit {call.name}")
                return result

            return middleware if execution.nested else None

        @hookimpl
        def dsh_post_execute(self, execution: Any, result: Any) -> Any:
            if execution.nested:
                return PostDecision.replace_value({"redacted": True})
            return None

    env.add(tool("echo"))
    env.plug(Policy())
    result = await env.run("return await tools.echo({'secret': 1})")
    assert result.value["result"] == {"redacted": True}
    assert order == ["enter echo", "exit echo"]


async def test_a_post_execute_block_fails_the_nested_call(env: Env) -> None:
    class Block:
        @hookimpl
        def dsh_post_execute(self, execution: Any, result: Any) -> Any:
            return PostDecision.block("output withheld by policy") if execution.nested else None

    env.add(tool("echo"))
    env.plug(Block())
    result = await env.run("try:\n    await tools.echo({})\nexcept ToolCallError as e:\n    print(e)")
    assert result.text == "output withheld by policy"


async def test_invalid_arguments_are_invalid_args_for_the_program(env: Env) -> None:
    env.add(
        tool("read", parameters={"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]})
    )
    result = await env.run("try:\n    await tools.read({'path': 3})\nexcept ToolCallError as e:\n    print(e)")
    assert result.text.startswith('invalid arguments for tool "read"')


async def test_model_direct_calls_under_code_are_collapsed_but_nested_ones_pass(env: Env) -> None:
    ran: list[str] = []

    async def body(args: Any, ctx: Any) -> Any:
        ran.append("read")
        return "content"

    env.add(tool("read", body))
    direct = await env.direct("read", {})
    assert direct.code == ErrorCode.UNKNOWN_TOOL
    assert direct.error is not None and "only `run_code` is callable directly" in direct.error.message
    assert ran == []
    nested = await env.run("return await tools.read({})")
    assert nested.value["result"] == "content" and ran == ["read"]


async def test_restrictions_apply_to_nested_calls_through_the_snapshot(env: Env) -> None:
    env.add(tool("read"), tool("bash"))
    assert env.agent is not None
    env.registry.restrict(env.agent, deny=["bash"])
    result = await env.run("print(sorted(tools._functions))")
    assert result.text == "['read']"


async def test_a_program_whose_agent_is_disposed_mid_run_cannot_call_past_its_policy(env: Env) -> None:
    # The agent's guard goes with its scope; the program's later calls must not run without it.
    gate = asyncio.Event()
    ran: list[Any] = []

    async def wait(args: Any, ctx: Any) -> Any:
        await gate.wait()
        return "waited"

    async def write(args: Any, ctx: Any) -> Any:
        ran.append(args)
        return "written"

    env.add(tool("wait", wait), tool("write", write))
    assert env.agent is not None
    env.registry.guard(lambda execution: "writes are frozen" if execution.name == "write" else None, scope=env.agent)
    program = "await tools.wait({})\ntry:\n    print(await tools.write({}))\nexcept ToolCallError as e:\n    print(e)"
    run = asyncio.ensure_future(env.run(program))
    while not env.sink.events:  # type: ignore[union-attr]
        await asyncio.sleep(0.01)
    await env.agent.dispose()
    gate.set()
    result = await run
    assert ran == []
    assert "disposed" in result.text
    settled = [e["payload"] for e in env.sink.events if e["kind"] == "tool/code-dispatch"]  # type: ignore[union-attr]
    assert [(p["name"], p["error_code"]) for p in settled] == [("wait", None), ("write", "ABORTED_BEFORE_DISPATCH")]


# -- approval inside a program ---------------------------------------------------------------------------


class AskFor:
    """Pre-execute asks for ``name``; the approval channel waits for the test's answer."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.asked = asyncio.Event()
        self.answer: asyncio.Future[ApprovalOutcome] | None = None
        self.requests: list[Any] = []

    @hookimpl
    def dsh_pre_execute(self, execution: Any) -> Any:
        return PreDecision.ask("dangerous") if execution.name == self.name else None

    @hookimpl
    def dsh_approve(self, request: Any) -> Any:
        self.requests.append(request)
        self.answer = asyncio.get_running_loop().create_future()
        self.asked.set()
        return self.answer


@pytest.mark.parametrize("outcome", [ApprovalOutcome.ALLOWED, ApprovalOutcome.REJECTED])
async def test_an_approval_ask_pauses_only_that_call_and_not_the_wall_clock(outcome: ApprovalOutcome) -> None:
    env = Env()
    env.add(tool("danger", lambda a, c: _value("done")), tool("echo"))
    ask = AskFor("danger")
    env.plug(ask)
    program = """
import asyncio
async def ticker():
    for i in range(3):
        print("tick", i)
        await asyncio.sleep(0)
async def risky():
    try:
        return await tools.danger({})
    except ToolCallError as error:
        print("denied:", error.tool_name, str(error))
        return "skipped"
results = await asyncio.gather(risky(), ticker())
print(await tools.echo({"after": results[0]}))
"""
    assert env.fake is not None
    run = asyncio.ensure_future(env.run(program))
    await asyncio.wait_for(ask.asked.wait(), 5)
    for _ in range(10):
        await asyncio.sleep(0)
    # The program kept running (the ticker printed) while the person decides, and the run's
    # wall clock is paused for exactly that wait.
    assert env.fake.paused == 1
    assert ask.requests[0].execution.call_id == "call-1:code:1"
    assert ask.answer is not None
    ask.answer.set_result(outcome)
    result = await run
    assert env.fake.paused == 0
    lines = result.text.splitlines()
    assert lines[:3] == ["tick 0", "tick 1", "tick 2"]
    if outcome is ApprovalOutcome.ALLOWED:
        assert lines[3:] == ["{'after': 'done'}"]
    else:
        assert lines[3:] == ['denied: danger the user rejected tool "danger"', "{'after': 'skipped'}"]


@pytest.mark.parametrize("stage", ["pre-execute", "guard"])
async def test_a_slow_policy_without_an_ask_does_not_pause_the_wall_clock(stage: str) -> None:
    """Only a person's approval wait is off the clock: a slow pre-execute hook or guard (a remote
    policy service, a classifier) is host work the run waits for, and a program calling in a loop
    would otherwise keep its wall clock stopped almost all the time."""
    env = Env()
    env.add(tool("echo"))
    seen: list[int] = []
    assert env.fake is not None
    fake = env.fake

    async def slow() -> None:
        await asyncio.sleep(0.01)
        seen.append(fake.paused)

    class SlowPolicy:
        @hookimpl
        def dsh_pre_execute(self, execution: Any) -> Any:
            return slow() if execution.nested and stage == "pre-execute" else None

        @hookimpl
        def dsh_guard(self, execution: Any) -> Any:
            return slow() if execution.nested and stage == "guard" else None

    env.plug(SlowPolicy())
    result = await env.run("await tools.echo({})\nawait tools.echo({})")
    assert not result.is_error, result.text
    assert seen == [0, 0] and fake.max_paused == 0


async def test_the_wall_clock_is_paused_for_the_approval_wait_only() -> None:
    env = Env()
    env.add(tool("danger", lambda a, c: _value("done")))
    ask = AskFor("danger")
    env.plug(ask)
    seen: list[tuple[str, int]] = []
    assert env.fake is not None
    fake = env.fake

    class After:
        @hookimpl
        def dsh_approval_resolved(self, request: Any, outcome: Any) -> None:
            seen.append(("resolved", fake.paused))

        @hookimpl
        def dsh_guard(self, execution: Any) -> None:
            if execution.nested:
                seen.append(("guard", fake.paused))

    env.plug(After())
    run = asyncio.ensure_future(env.run("return await tools.danger({})"))
    await asyncio.wait_for(ask.asked.wait(), 5)
    assert fake.paused == 1
    assert ask.answer is not None
    ask.answer.set_result(ApprovalOutcome.ALLOWED)
    result = await run
    assert result.value == {"logs": [], "result": "done"}
    assert seen == [("resolved", 0), ("guard", 0)] and fake.paused == 0


async def test_ask_without_an_approval_channel_is_a_denial_for_the_program(env: Env) -> None:
    class Ask:
        @hookimpl
        def dsh_pre_execute(self, execution: Any) -> Any:
            return PreDecision.ask() if execution.nested else None

    env.add(tool("echo"))
    env.plug(Ask())
    result = await env.run("try:\n    await tools.echo({})\nexcept ToolCallError as e:\n    print(e)")
    assert result.text == 'tool "echo" requires approval, but no approval channel is available'


async def test_aborting_the_outer_call_during_an_approval_cancels_it() -> None:
    env = Env()
    env.add(tool("danger"))
    ask = AskFor("danger")
    env.plug(ask)
    controller = AbortController()
    run = asyncio.ensure_future(env.run("await tools.danger({})", signal=controller.signal))
    await asyncio.wait_for(ask.asked.wait(), 5)
    controller.abort("user pressed stop")
    result = await run
    assert result.code in (ErrorCode.CODE_RUN_FAILED, ErrorCode.ABORTED)
    end = next(e for e in env.sink.events if e["kind"] == "tool/code-dispatch")
    assert end["payload"]["error_code"] == ErrorCode.ABORTED_BEFORE_DISPATCH


# -- arguments ---------------------------------------------------------------------------------------------


async def test_non_lossless_arguments_are_rejected_and_nothing_is_dispatched(env: Env) -> None:
    ran: list[str] = []

    async def body(args: Any, ctx: Any) -> Any:
        ran.append("x")
        return None

    env.add(tool("echo", body))
    program = """
class Exotic(dict):
    pass
for bad in ({"v": float("nan")}, {"v": (1, 2)}, {1: "int key"}, Exotic(a=1), {"v": b"bytes"}):
    try:
        await tools.echo(bad)
    except ToolCallError as error:
        print(str(error).split(":")[0])
"""
    result = await env.run(program)
    assert result.text.splitlines() == ["tool arguments must be lossless JSON"] * 5
    assert ran == [] and env.sink.events == []


async def test_none_arguments_are_rejected_with_a_hint(env: Env) -> None:
    env.add(tool("echo"))
    result = await env.run("try:\n    await tools.echo(None)\nexcept ToolCallError as e:\n    print(e)")
    assert result.text == "tool arguments must be a JSON object; pass {} to call echo without arguments"
    assert env.sink is not None and env.sink.events == []


async def test_deep_arguments_are_dispatched_and_logged_with_independent_immutable_snapshots(env: Env) -> None:
    received: list[Any] = []

    async def body(args: Any, ctx: Any) -> Any:
        received.append(args)
        with pytest.raises(TypeError):
            args["x"] = 1  # the dispatched value is frozen
        return "ok"

    env.add(tool("deep", body))
    program = """
value = {}
node = value
for _ in range(3000):
    node["d"] = {}
    node = node["d"]
await tools.deep({"v": value})
print("ok")
"""
    result = await env.run(program)
    assert result.text == "ok"
    start = next(e for e in env.sink.events if e["kind"] == "tool/code-dispatch-start")
    depth, node = 0, start["payload"]["arguments"]["v"]
    while node:
        node, depth = node["d"], depth + 1
    assert depth == 3000
    assert isinstance(received[0], FrozenDict)


async def test_dispatched_and_logged_arguments_are_different_objects(env: Env) -> None:
    captured: dict[str, Any] = {}

    class Capture:
        @hookimpl
        def dsh_code_dispatch_log(self, dispatch: Any) -> Any:
            captured["logged"] = dispatch.arguments
            return None

    async def body(args: Any, ctx: Any) -> Any:
        captured["dispatched"] = args
        return None

    env.add(tool("echo", body))
    env.plug(Capture())
    await env.run("await tools.echo({'a': [1, 2]})")
    assert captured["logged"] == captured["dispatched"] == {"a": [1, 2]}
    assert captured["logged"] is not captured["dispatched"]
    assert captured["logged"]["a"] is not captured["dispatched"]["a"]


# -- contexts and turn control ----------------------------------------------------------------------------


async def test_nested_contexts_are_deferred_onto_the_outer_result_in_order(env: Env) -> None:
    async def body(args: Any, ctx: Any) -> Any:
        ctx.defer_context(f"context from {args['n']}")
        return None

    class Post:
        @hookimpl
        def dsh_post_execute(self, execution: Any, result: Any) -> Any:
            if execution.nested:
                return PostDecision.accept([ContextMessage(f"post {execution.arguments['n']}")])
            return None

    env.add(tool("ctx", body, safe=True))
    env.plug(Post())
    result = await env.run("import asyncio\nawait asyncio.gather(*(tools.ctx({'n': i}) for i in range(3)))")
    assert [c.text for c in result.additional_contexts] == [
        "context from 0",
        "post 0",
        "context from 1",
        "post 1",
        "context from 2",
        "post 2",
    ]


async def test_contexts_survive_a_later_program_failure(env: Env) -> None:
    async def body(args: Any, ctx: Any) -> Any:
        ctx.defer_context("remember this")
        return None

    env.add(tool("ctx", body))
    result = await env.run("await tools.ctx({})\nraise ValueError('boom')")
    assert result.code == ErrorCode.CODE_RUN_FAILED
    assert [c.text for c in result.additional_contexts] == ["remember this"]


async def test_a_successful_nested_concludes_turn_concludes_the_outer_turn(env: Env) -> None:
    async def finish(args: Any, ctx: Any) -> Any:
        ctx.conclude_turn()
        return "bye"

    env.add(tool("finish", finish), tool("echo"))
    result = await env.run("await tools.finish({})")
    assert result.concludes_turn and not result.is_error
    plain = await env.run("await tools.echo({})", call_id="call-2")
    assert not plain.concludes_turn


async def test_a_failed_run_does_not_conclude_the_turn(env: Env) -> None:
    async def finish(args: Any, ctx: Any) -> Any:
        ctx.conclude_turn()
        return "bye"

    env.add(tool("finish", finish))
    result = await env.run("await tools.finish({})\nraise ValueError('x')")
    assert result.is_error and not result.concludes_turn


async def test_without_an_owning_agent_dispatch_works_and_nothing_is_logged() -> None:
    env = Env(agent=False)
    env.add(tool("echo"))
    result = await env.run("return await tools.echo({'a': 1})", agent=None)
    assert result.value == {"logs": [], "result": {"a": 1}}
    assert env.sink is not None and env.sink.events == []


async def test_a_denied_nested_call_reaches_the_program_unrewritten_by_post_execute(env: Env) -> None:
    posts: list[str] = []
    nested: list[Any] = []

    class Policy:
        @hookimpl
        def dsh_pre_execute(self, execution: Any) -> Any:
            return PreDecision.deny("writes are off today") if execution.nested else None

        @hookimpl
        def dsh_post_execute(self, execution: Any, result: Any) -> Any:
            posts.append(execution.name)
            return PostDecision.replace_content("ok: written") if result.is_error else None

        @hookimpl
        def dsh_tool_result(self, execution: Any, result: Any) -> None:
            if execution.nested:
                nested.append(result)

    env.add(tool("write"))
    env.plug(Policy())
    # The program prints the error text it caught; the run's result is what the model reads.
    result = await env.run("try:\n    await tools.write({})\nexcept ToolCallError as e:\n    print('denied:', e)")
    assert result.text == "denied: writes are off today"
    assert posts == ["run_code"]  # the denied nested call never reached post-execute
    # The error text alone would survive a content rewrite: check the nested result's content,
    # which observers and the session log (what a later turn replays) carry.
    assert [(r.code, r.text) for r in nested] == [("DENIED", "Error: writes are off today")]
    assert env.sink is not None
    settled = [e for e in env.sink.events if e["kind"] == "tool/code-dispatch"]
    assert [e["payload"]["error_code"] for e in settled] == ["DENIED"]
    assert [e["payload"]["content"] for e in settled] == [[{"text": "Error: writes are off today", "type": "text"}]]


async def test_a_program_reads_the_value_so_only_replace_value_or_block_hides_data_from_it(env: Env) -> None:
    """By design: a nested call answers the program with the result's value (or its error text);
    content is what observers and the session log keep. A post-execute hook that must keep data
    from the model under Code Mode replaces the value or blocks; replacing content is not enough."""

    class Redact:
        @hookimpl
        def dsh_post_execute(self, execution: Any, result: Any) -> Any:
            if not execution.nested:
                return None
            kind = execution.arguments["how"]
            if kind == "content":
                return PostDecision.replace_content("[redacted]")
            if kind == "value":
                return PostDecision.replace_value({"secret": "[redacted]"})
            return PostDecision.block("[redacted]")

    env.add(tool("peek", lambda a, c: _value({"secret": "hunter2"})))
    env.plug(Redact())
    program = (
        "out = []\nfor how in ['content', 'value', 'block']:\n    try:\n"
        "        out.append((await tools.peek(how=how))['secret'])\n"
        "    except ToolCallError as error:\n        out.append(str(error))\nreturn out"
    )
    result = await env.run(program)
    assert result.value["result"] == ["hunter2", "[redacted]", "[redacted]"]
    settled = [e["payload"]["content"] for e in env.sink.events if e["kind"] == "tool/code-dispatch"]  # type: ignore[union-attr]
    assert settled[0] == [{"text": "[redacted]", "type": "text"}]
