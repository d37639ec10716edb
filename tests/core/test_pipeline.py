"""The pipeline's contracts: order, cancellation, invalid args, modes, policy outcomes, post-execute."""

from __future__ import annotations

import asyncio
from typing import Any

import attrs
import pytest

from dsh_core import ToolError, define_tool, hookimpl
from dsh_core.abort import AbortController, AbortSignal
from dsh_core.errors import ErrorCode
from dsh_core.model import (
    ApprovalOutcome,
    ContextMessage,
    ExecutionToken,
    ImageBlock,
    PostDecision,
    PreDecision,
    TextBlock,
    ToolExecution,
    ToolExecutionInput,
    ToolResult,
)

from .helpers import Recorder, Stack, body_calls, register, tool

pytestmark = pytest.mark.anyio


async def test_stages_run_in_the_fixed_order_and_emit_one_result() -> None:
    stack = Stack()
    order: list[str] = []

    class Plugin:
        @hookimpl
        def dsh_pre_execute(self, execution: ToolExecution) -> None:
            order.append("pre")

        @hookimpl
        def dsh_guard(self, execution: ToolExecution) -> None:
            order.append("guard")

        @hookimpl
        def dsh_around_dispatch(self, execution: ToolExecution) -> Any:
            async def middleware(call: ToolExecution, proceed: Any) -> ToolResult:
                order.append("around:in")
                result = await proceed(call)
                order.append("around:out")
                return result  # type: ignore[no-any-return]

            return middleware

        @hookimpl
        def dsh_post_execute(self) -> None:
            order.append("post")

        @hookimpl
        def dsh_tool_result(self) -> None:
            order.append("result")

    stack.registry.register(tool("echo", body=lambda a, c: order.append("body") or {"ok": True}))
    register(stack.hooks, Plugin())
    result = await stack.call("echo")
    assert not result.is_error
    assert order == ["pre", "guard", "around:in", "body", "around:out", "post", "result"]


async def test_non_lossless_arguments_are_invalid_before_anything_else() -> None:
    stack = Stack()
    echo = tool("echo")
    stack.registry.register(echo)
    recorder = register(stack.hooks, Recorder())
    for bad in ({"text": (1, 2)}, {1: "x"}, {"text": float("inf")}, {"a": {"b": [set()]}}):
        result = await stack.call("echo", bad)
        assert result.code == "INVALID_ARGS", bad
    assert body_calls(echo) == []
    assert set(recorder.stages()) == {"result"}


async def test_schema_violations_are_all_reported_with_paths() -> None:
    stack = Stack()
    params = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    }
    echo = tool("strict", parameters=params)
    stack.registry.register(echo)
    result = await stack.call("strict", {"a": "x", "z": 1})
    assert result.code == "INVALID_ARGS"
    assert "/a: 'x' is not of type 'integer'" in result.text
    assert "'b' is a required property" in result.text
    assert "'z' was unexpected" in result.text
    assert body_calls(echo) == []


async def test_output_is_validated_and_must_be_lossless() -> None:
    stack = Stack()
    stack.registry.register(tool("bad", output_schema={"type": "integer"}, body=lambda a, c: "text"))
    stack.registry.register(tool("lossy", body=lambda a, c: {"x": (1,)}))
    bad = await stack.call("bad")
    assert bad.code == "INVALID_TOOL_OUTPUT" and 'tool "bad" returned invalid output' in bad.text
    lossy = await stack.call("lossy")
    assert lossy.code == "INVALID_TOOL_OUTPUT" and "/x" in lossy.text


async def test_an_execute_that_returns_no_awaitable_fails_naming_the_tool_and_the_fix() -> None:
    # A synchronous `def execute` ran, then failed as "object dict can't be used in 'await' expression",
    # which names neither the tool nor what to change.
    stack = Stack()

    def execute(args: Any, ctx: Any) -> Any:
        return {"done": True}

    stack.registry.register(
        define_tool(name="sync", description="A sync body.", parameters={"type": "object"}, execute=execute)
    )
    result = await stack.call("sync")
    assert result.code == "TOOL_FAILED"
    assert result.text == (
        'Error: tool "sync": its execute returned dict, not an awaitable: '
        "define it with async def (or return an awaitable)"
    )


async def test_pre_aborted_call_never_runs_the_body_and_keeps_the_finalizer() -> None:
    stack = Stack()
    echo = tool("echo", finalize=lambda e, r: [TextBlock(f"final:{r.code}")])
    stack.registry.register(echo)
    recorder = register(stack.hooks, Recorder())
    result = await stack.call("echo", signal=AbortSignal.aborted_with("user"))
    assert result.code == "ABORTED_BEFORE_DISPATCH" and result.text == "final:ABORTED_BEFORE_DISPATCH"
    assert body_calls(echo) == [] and recorder.stages() == ["result"]


async def test_cancellation_after_the_body_started_is_aborted_and_the_body_is_awaited() -> None:
    stack = Stack()
    controller = AbortController()
    finished: list[str] = []

    async def slow(args: Any, ctx: Any) -> Any:
        controller.abort("user")
        await asyncio.sleep(0.05)  # an uncooperative body: it ignores the signal
        finished.append("done")
        return {"late": True}

    stack.registry.register(tool("slow", body=slow))
    result = await stack.call("slow", signal=controller.signal)
    assert result.code == "ABORTED"
    assert finished == ["done"]


async def test_abort_during_approval_is_aborted_before_dispatch() -> None:
    stack = Stack()
    controller = AbortController()
    echo = tool("echo")
    stack.registry.register(echo)

    class Channel:
        @hookimpl
        def dsh_pre_execute(self) -> PreDecision:
            return PreDecision.ask("check")

        @hookimpl
        def dsh_approve(self, request: Any) -> Any:
            async def wait() -> ApprovalOutcome:
                controller.abort("user")
                await asyncio.sleep(10)
                return ApprovalOutcome.ALLOWED

            return wait()

    register(stack.hooks, Channel())
    result = await stack.call("echo", signal=controller.signal)
    assert result.code == "ABORTED_BEFORE_DISPATCH" and body_calls(echo) == []


@pytest.mark.parametrize("stage", ["pre", "guard"])
async def test_a_policy_hook_is_awaited_to_its_end_then_the_aborted_call_is_never_dispatched(stage: str) -> None:
    """Pre-execute votes and guards are not raced against the abort signal (the hookspecs say
    so): the hook finishes, and the call aborted meanwhile settles without its body."""
    stack = Stack()
    controller = AbortController()
    echo = tool("echo")
    stack.registry.register(echo)
    finished: list[str] = []

    async def slow() -> None:
        controller.abort("user")
        await asyncio.sleep(0.05)
        finished.append(stage)

    class Slow:
        @hookimpl
        def dsh_pre_execute(self) -> Any:
            return slow() if stage == "pre" else None

        @hookimpl
        def dsh_guard(self) -> Any:
            return slow() if stage == "guard" else None

    register(stack.hooks, Slow())
    result = await stack.call("echo", signal=controller.signal)
    assert finished == [stage]
    assert result.code == "ABORTED_BEFORE_DISPATCH" and body_calls(echo) == []


async def test_a_call_aborted_between_prepare_and_dispatch_is_final_without_middleware_or_post() -> None:
    # A scheduler prepares a call and dispatches it later (a body task, a slot freeing up):
    # an abort in between is still "aborted before dispatch", which post-execute never sees.
    stack = Stack()
    echo = tool("echo", finalize=lambda e, r: [TextBlock(f"final:{r.code}")])
    stack.registry.register(echo)
    wrapped: list[str] = []

    class Wrapper:
        @hookimpl
        def dsh_around_dispatch(self) -> Any:
            async def middleware(call: ToolExecution, proceed: Any) -> ToolResult:
                wrapped.append(call.call_id)
                return await proceed(call)  # type: ignore[no-any-return]

            return middleware

    register(stack.hooks, Wrapper())
    recorder = register(stack.hooks, Recorder(post=PostDecision.replace_content("all good, file written")))
    controller = AbortController()
    staged = await stack.runtime.prepare(
        ToolExecutionInput(call_id="c1", name="echo", arguments={}, signal=controller.signal)
    )
    assert staged.kind == "dispatch"
    controller.abort("run_code settled")
    staged = await stack.runtime.dispatch(staged)
    assert staged.kind == "final-result"
    result = await stack.runtime.finish(staged)
    assert result.code == "ABORTED_BEFORE_DISPATCH" and result.text == "final:ABORTED_BEFORE_DISPATCH"
    assert recorder.stages() == ["pre", "guard", "result"]  # type: ignore[attr-defined]
    assert wrapped == [] and body_calls(echo) == []


async def test_finalize_never_post_executes_a_result_the_core_settled() -> None:
    # A custom scheduler that ignores the staged kind still cannot let post-execute
    # rewrite a denial or an abort before dispatch.
    stack = Stack()
    echo = tool("echo")
    stack.registry.register(echo)
    recorder = register(
        stack.hooks, Recorder(pre=PreDecision.deny("writes are off"), post=PostDecision.replace_content("all good"))
    )
    staged = await stack.runtime.prepare(ToolExecutionInput(call_id="c1", name="echo", arguments={}))
    assert staged.kind == "final-result"
    result = await stack.runtime.finalize(staged)
    assert result.code == "DENIED" and "all good" not in result.text
    assert recorder.stages() == ["pre", "result"]  # type: ignore[attr-defined]
    assert body_calls(echo) == []


async def test_a_second_finalize_runs_no_post_execute_and_leaves_the_emitted_result() -> None:
    # A custom scheduler that finalizes twice (or while the first is awaiting post-execute) must not
    # run post-execute again on a call whose one result was emitted, nor rewrite the result it holds.
    stack = Stack()
    stack.registry.register(tool("echo"))
    gate = asyncio.Event()
    posts: list[str] = []

    class Post:
        @hookimpl
        async def dsh_post_execute(self, execution: ToolExecution, result: ToolResult) -> PostDecision:
            posts.append(execution.call_id)
            await gate.wait()
            return PostDecision.replace_content(f"post #{len(posts)}")

    recorder = register(stack.hooks, Recorder())
    register(stack.hooks, Post())
    staged = await stack.runtime.dispatch(
        await stack.runtime.prepare(ToolExecutionInput(call_id="c1", name="echo", arguments={}))
    )
    assert staged.kind == "post-result"
    first = asyncio.get_running_loop().create_task(stack.runtime.finalize(staged))
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="finaliz"):
        await stack.runtime.finalize(staged)  # while the first is in post-execute
    gate.set()
    result = await first
    assert result.text == "post #1" and staged.result is result
    with pytest.raises(RuntimeError, match="already finished"):
        await stack.runtime.finalize(staged)  # once it is finished
    assert posts == ["c1"] and staged.result is result
    assert recorder.stages().count("result") == 1  # type: ignore[attr-defined]


async def test_a_disposed_agent_leaves_no_call_to_run_without_its_policy() -> None:
    # Disposing an agent drops its layer (restrictions, guards, mode) and its scoped hooks: a call
    # still naming it must be refused, not run under the deployment's defaults.
    stack = Stack(mode="native")
    bash, read = tool("bash"), tool("read")
    stack.registry.register(bash)
    stack.registry.register(read)
    agent = stack.agent()
    stack.registry.restrict(agent, deny=["bash"])
    stack.registry.guard(lambda execution: "no reads" if execution.name == "read" else None, scope=agent)
    recorder = register(stack.hooks, Recorder())
    assert (await stack.call("bash", agent=agent)).code == "UNKNOWN_TOOL"
    assert (await stack.call("read", agent=agent)).code == "DENIED"
    # Prepared while the agent lives (an unknown name passes policy), dispatched once it is gone.
    pending = await stack.runtime.prepare(ToolExecutionInput(call_id="c1", name="bash", arguments={}, agent=agent))
    assert pending.kind == "dispatch"
    await agent.dispose()
    pending = await stack.runtime.dispatch(pending)
    assert pending.kind == "final-result" and pending.result is not None
    assert pending.result.code == "ABORTED_BEFORE_DISPATCH" and "disposed" in pending.result.text
    recorder.seen.clear()
    for name in ("bash", "read"):
        result = await stack.call(name, agent=agent)
        assert result.code == "ABORTED_BEFORE_DISPATCH" and "disposed" in result.text
    assert recorder.stages() == ["result", "result"]  # type: ignore[attr-defined]
    assert body_calls(bash) == [] and body_calls(read) == []


async def test_dispatch_never_runs_the_body_of_a_settled_or_dispatched_call() -> None:
    # A custom scheduler that ignores the staged kind cannot run a denied call's body, or a body twice.
    stack = Stack()
    write = tool("write")
    stack.registry.register(write)
    recorder = register(
        stack.hooks, Recorder(pre=PreDecision.deny("writes are off"), post=PostDecision.replace_content("ok: written"))
    )
    staged = await stack.runtime.prepare(ToolExecutionInput(call_id="c1", name="write", arguments={}))
    assert staged.kind == "final-result"
    staged = await stack.runtime.dispatch(staged)
    assert staged.kind == "final-result" and body_calls(write) == []
    result = await stack.runtime.finalize(staged)
    assert result.code == "DENIED" and "ok: written" not in result.text
    assert recorder.stages() == ["pre", "result"]  # type: ignore[attr-defined]

    async def slow(args: Any, ctx: Any) -> Any:
        await asyncio.sleep(0.01)  # a body that waits: a second dispatch can come meanwhile
        return {}

    other = tool("other", body=slow)
    allowed = Stack()
    allowed.registry.register(other)
    staged = await allowed.runtime.prepare(ToolExecutionInput(call_id="c2", name="other", arguments={}))
    staged = await allowed.runtime.dispatch(staged)
    assert staged.kind == "post-result"
    assert (await allowed.runtime.dispatch(staged)) is staged
    assert len(body_calls(other)) == 1
    # Two dispatches at once: the second is refused before the first's body has run.
    staged = await allowed.runtime.prepare(ToolExecutionInput(call_id="c3", name="other", arguments={}))
    first, second = await asyncio.gather(
        allowed.runtime.dispatch(staged), allowed.runtime.dispatch(staged), return_exceptions=True
    )
    assert first is staged and staged.kind == "post-result"
    assert isinstance(second, RuntimeError) and "'c3' is already being dispatched" in str(second)
    assert len(body_calls(other)) == 2


async def test_a_middleware_signal_aborted_before_the_body_is_final_without_post_execute() -> None:
    stack = Stack()
    echo = tool("echo")
    stack.registry.register(echo)
    controller = AbortController()

    class Tightening:
        @hookimpl
        def dsh_around_dispatch(self) -> Any:
            async def middleware(call: ToolExecution, proceed: Any) -> ToolResult:
                controller.abort("per-call timeout")
                return await proceed(attrs.evolve(call, signal=controller.signal))  # type: ignore[no-any-return]

            return middleware

    register(stack.hooks, Tightening())
    recorder = register(stack.hooks, Recorder(post=PostDecision.replace_content("all good, file written")))
    result = await stack.call("echo")
    assert result.code == "ABORTED_BEFORE_DISPATCH" and result.text == "Error: tool call aborted before dispatch"
    assert "post" not in recorder.stages()  # type: ignore[attr-defined]
    assert body_calls(echo) == []


@pytest.mark.parametrize(
    ("outcome", "message"),
    [
        ("rejected", 'the user rejected tool "echo"'),
        ("cancelled", 'approval for tool "echo" was cancelled'),
        ("unavailable", 'tool "echo" requires approval, but no approval channel is available (why)'),
        (None, 'tool "echo" requires approval, but no approval channel is available (why)'),
    ],
)
async def test_approval_outcomes_deny_with_a_message(outcome: str | None, message: str) -> None:
    stack = Stack()
    echo = tool("echo")
    stack.registry.register(echo)
    recorder = register(stack.hooks, Recorder(pre=PreDecision.ask("why"), approval=outcome))
    result = await stack.call("echo")
    assert result.code == "DENIED" and result.error is not None and result.error.message == message
    assert body_calls(echo) == []
    assert recorder.stages() == ["pre", "approve", "result"]  # never dispatched: no post-execute


async def test_an_allowed_approval_continues_to_guards_and_the_body() -> None:
    stack = Stack()
    echo = tool("echo")
    stack.registry.register(echo)
    recorder = register(stack.hooks, Recorder(pre=PreDecision.ask(), approval="allowed"))
    assert not (await stack.call("echo")).is_error
    assert recorder.stages() == ["pre", "approve", "guard", "post", "result"]


async def test_pre_execute_deny_wins_over_allow_and_ask() -> None:
    stack = Stack()
    echo = tool("echo")
    stack.registry.register(echo)
    register(stack.hooks, Recorder(pre=PreDecision.allow()))
    register(stack.hooks, Recorder(pre=PreDecision.deny("no way")))
    register(stack.hooks, Recorder(pre=PreDecision.ask()))
    result = await stack.call("echo")
    assert result.code == "DENIED" and result.error is not None and result.error.message == "no way"
    assert body_calls(echo) == []


async def test_a_throwing_pre_execute_settles_without_post_execute() -> None:
    stack = Stack()
    stack.registry.register(tool("echo"))
    recorder = register(stack.hooks, Recorder())

    class Broken:
        @hookimpl
        def dsh_pre_execute(self) -> None:
            raise ToolError("policy store offline", code="POLICY_OFFLINE")

    register(stack.hooks, Broken())
    result = await stack.call("echo")
    assert result.code == "POLICY_OFFLINE" and "policy store offline" in result.text
    assert "post" not in recorder.stages()


async def test_guards_are_monotonic_first_denial_wins_and_errors_deny() -> None:
    stack = Stack()
    echo = tool("echo")
    stack.registry.register(echo)
    agent = stack.agent()
    seen: list[str] = []

    def global_guard(execution: ToolExecution) -> str | None:
        seen.append("global")
        return None

    def agent_guard(execution: ToolExecution) -> str:
        seen.append("agent")
        return "agent says no"

    stack.registry.guard(global_guard)
    stack.registry.guard(agent_guard, scope=agent)
    after = register(stack.hooks, Recorder())  # a later hook guard that would pass
    result = await stack.call("echo", agent=agent)
    assert result.error is not None and result.error.message == "agent says no"
    assert seen == ["global", "agent"]
    assert "guard" not in after.stages()  # nothing after a denial runs, nothing can allow

    class Raising:
        @hookimpl
        def dsh_guard(self) -> None:
            raise RuntimeError("boom")

    register(stack.hooks, Raising())
    result = await stack.call("echo")
    assert result.code == "DENIED" and "boom" in result.text
    assert body_calls(echo) == []


async def test_post_execute_block_replaces_the_result_and_keeps_only_its_contexts() -> None:
    stack = Stack()

    def body(args: Any, ctx: Any) -> Any:
        ctx.defer_context("from body")
        return {"secret": 1}

    stack.registry.register(tool("echo", body=body))
    register(stack.hooks, Recorder(post=PostDecision.accept([ContextMessage("accepted")])))
    register(stack.hooks, Recorder(post=PostDecision.block("redacted by policy", [ContextMessage("why")])))
    result = await stack.call("echo")
    assert result.code == "BLOCKED" and result.text == "redacted by policy"
    assert result.value is None
    assert [c.text for c in result.additional_contexts] == ["why"]


async def test_post_execute_block_with_images_and_empty_feedback() -> None:
    stack = Stack()
    stack.registry.register(tool("echo"))
    register(stack.hooks, Recorder(post=PostDecision.block([ImageBlock("AAAA", "image/png")])))
    result = await stack.call("echo")
    assert result.error is not None and result.error.message == "[image content]"
    stack2 = Stack()
    stack2.registry.register(tool("echo"))
    register(stack2.hooks, Recorder(post=PostDecision.block([])))
    result2 = await stack2.call("echo")
    assert result2.error is not None and result2.error.message == "tool result blocked by post-execute policy"


async def test_post_execute_replaces_value_content_and_appends_contexts() -> None:
    stack = Stack()

    def body(args: Any, ctx: Any) -> Any:
        ctx.defer_context("body context")
        return {"n": 1}

    stack.registry.register(tool("echo", body=body, output_schema={"type": "object"}))
    register(stack.hooks, Recorder(post=PostDecision.replace_value({"n": 2}, [ContextMessage("policy")])))
    result = await stack.call("echo")
    assert result.value == {"n": 2} and '"n": 2' in result.text
    assert [c.text for c in result.additional_contexts] == ["body context", "policy"]

    stack2 = Stack()
    stack2.registry.register(tool("echo"))
    register(stack2.hooks, Recorder(post=PostDecision.replace_content("shown instead")))
    result2 = await stack2.call("echo")
    assert result2.text == "shown instead" and result2.value == {"echo": ""}


async def test_post_execute_replacement_errors() -> None:
    stack = Stack()
    stack.registry.register(tool("echo", output_schema={"type": "object"}))
    register(stack.hooks, Recorder(post=PostDecision.replace_value("not an object")))
    assert (await stack.call("echo")).code == "INVALID_TOOL_OUTPUT"

    stack2 = Stack()
    stack2.registry.register(tool("fails", body=lambda a, c: (_ for _ in ()).throw(ToolError("nope"))))
    register(stack2.hooks, Recorder(post=PostDecision.replace_value({"x": 1})))
    failed = await stack2.call("fails")
    assert failed.is_error and "cannot replace the value of a failed result" in failed.text

    stack3 = Stack()
    stack3.registry.register(tool("echo"))
    register(stack3.hooks, Recorder(post=PostDecision.replace_content("a")), name="first")
    register(stack3.hooks, Recorder(post=PostDecision.replace_content("b")), name="second")
    conflict = await stack3.call("echo")
    assert conflict.is_error and "conflicting replacements" in conflict.text
    assert "'first'" in conflict.text and "'second'" in conflict.text


async def test_execution_mode_is_parallel_only_for_exactly_true() -> None:
    stack = Stack()

    def boom(args: Any) -> bool:
        raise RuntimeError("classifier crashed")

    cases = {"yes": True, "no": False, "truthy": lambda a: 1, "raises": boom, "undeclared": None}
    for name, safe in cases.items():
        stack.registry.register(tool(name, safe=safe))
    modes = {
        name: stack.runtime.execution_mode(ToolExecutionInput(call_id="c", name=name, arguments={}))
        for name in [*cases, "unknown"]
    }
    assert modes == {
        "yes": "parallel",
        "no": "exclusive",
        "truthy": "exclusive",
        "raises": "exclusive",
        "undeclared": "exclusive",
        "unknown": "exclusive",
    }
    lossy = ToolExecutionInput(call_id="c", name="yes", arguments={"x": float("nan")})
    assert stack.runtime.execution_mode(lossy) == "exclusive"
    assert "is_concurrency_safe" not in str(stack.registry.schemas()[0].to_json())


async def test_around_dispatch_cannot_change_what_runs_but_can_tighten_the_signal() -> None:
    stack = Stack()
    echo = tool("echo")
    other = tool("other")
    stack.registry.register(echo)
    stack.registry.register(other)
    controller = AbortController()

    class Sneaky:
        @hookimpl
        def dsh_around_dispatch(self) -> Any:
            async def middleware(call: ToolExecution, proceed: Any) -> ToolResult:
                swapped = attrs.evolve(call, name="other", arguments={"text": "forged"})
                return await proceed(swapped)  # type: ignore[no-any-return]

            return middleware

    register(stack.hooks, Sneaky())
    result = await stack.call("echo", {"text": "real"})
    assert result.value == {"echo": "real"}
    assert body_calls(other) == []

    class Tightening:
        @hookimpl(tryfirst=True)
        def dsh_around_dispatch(self) -> Any:
            async def middleware(call: ToolExecution, proceed: Any) -> ToolResult:
                controller.abort("timeout policy")
                return await proceed(attrs.evolve(call, signal=controller.signal))  # type: ignore[no-any-return]

            return middleware

    register(stack.hooks, Tightening())
    assert (await stack.call("echo", {"text": "x"})).code == "ABORTED_BEFORE_DISPATCH"


async def test_a_middleware_narrowing_the_signal_leaves_no_listener_on_the_callers_signal() -> None:
    stack = Stack()
    stack.registry.register(tool("echo"))
    heard: list[object] = []

    class PerCallTimeout:
        @hookimpl
        def dsh_around_dispatch(self) -> Any:
            async def middleware(call: ToolExecution, proceed: Any) -> ToolResult:
                timeout = AbortController()
                return await proceed(attrs.evolve(call, signal=timeout.signal))  # type: ignore[no-any-return]

            return middleware

    register(stack.hooks, PerCallTimeout())
    session = AbortController()  # one agent run's signal, shared by all its calls
    session.signal.add_listener(heard.append)
    for _ in range(50):
        assert not (await stack.call("echo", signal=session.signal)).is_error
    assert len(session.signal._listeners or []) == 1  # only our own: flat, whatever the number of calls
    session.abort("done")
    assert heard == ["done"]


async def test_middleware_order_first_in_call_order_is_outermost() -> None:
    stack = Stack()
    stack.registry.register(tool("echo"))
    trail: list[str] = []

    def make(label: str) -> Any:
        class Layer:
            @hookimpl
            def dsh_around_dispatch(self) -> Any:
                async def middleware(call: ToolExecution, proceed: Any) -> ToolResult:
                    trail.append(f"{label}>")
                    result = await proceed(call)
                    trail.append(f"<{label}")
                    return result  # type: ignore[no-any-return]

                return middleware

        return Layer()

    register(stack.hooks, make("old"))
    register(stack.hooks, make("new"))  # pluggy calls the newest registration first
    await stack.call("echo")
    assert trail == ["new>", "old>", "<old", "<new"]


async def test_a_raising_middleware_skips_post_execute() -> None:
    stack = Stack()
    stack.registry.register(tool("echo"))
    recorder = register(stack.hooks, Recorder())

    class Raising:
        @hookimpl
        def dsh_around_dispatch(self) -> Any:
            async def middleware(call: ToolExecution, proceed: Any) -> ToolResult:
                raise RuntimeError("wrapper bug")

            return middleware

    register(stack.hooks, Raising())
    result = await stack.call("echo")
    assert result.code == "TOOL_FAILED" and "wrapper bug" in result.text
    assert "post" not in recorder.stages() and recorder.stages()[-1] == "result"


async def test_a_middleware_cannot_run_the_body_twice_or_after_the_call_settled() -> None:
    stack = Stack()
    echo = tool("echo")
    stack.registry.register(echo)
    kept: list[tuple[ToolExecution, Any]] = []
    keep = False

    class Misbehaving:
        @hookimpl
        def dsh_around_dispatch(self) -> Any:
            async def middleware(call: ToolExecution, proceed: Any) -> ToolResult:
                if keep:  # keep proceed for later, answer from a cache
                    kept.append((call, proceed))
                    return ToolResult(content="cached", value={"echo": "cached"})
                await proceed(call)
                return await proceed(call)  # type: ignore[no-any-return]

            return middleware

    register(stack.hooks, Misbehaving())
    result = await stack.call("echo", {"text": "once"})
    assert len(body_calls(echo)) == 1
    assert result.code == "TOOL_FAILED" and "proceed() may be called once" in result.text

    keep = True
    settled = await stack.call("echo", {"text": "late"})
    assert settled.value == {"echo": "cached"} and len(body_calls(echo)) == 1
    call, proceed = kept[-1]
    with pytest.raises(RuntimeError, match="proceed"):
        await proceed(call)  # kept past the call's result: the body must not run now
    assert len(body_calls(echo)) == 1


async def test_a_kept_proceed_cannot_run_the_body_after_a_cancelled_call_settled() -> None:
    stack = Stack()
    echo = tool("echo")
    stack.registry.register(echo)
    recorder = register(stack.hooks, Recorder())
    kept: list[tuple[ToolExecution, Any]] = []
    entered = asyncio.Event()

    class Keeper:
        @hookimpl
        def dsh_around_dispatch(self) -> Any:
            async def middleware(call: ToolExecution, proceed: Any) -> ToolResult:
                kept.append((call, proceed))  # kept for later, not called yet
                entered.set()
                await asyncio.sleep(10)
                raise AssertionError("unreachable")

            return middleware

    register(stack.hooks, Keeper())
    task = asyncio.ensure_future(stack.call("echo", {"text": "x"}))
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert recorder.results[-1][1].code == "ABORTED_BEFORE_DISPATCH"
    call, proceed = kept[-1]
    with pytest.raises(RuntimeError, match="proceed"):
        await proceed(call)  # the call's one result was emitted: the body must not run now
    assert body_calls(echo) == []


async def test_an_authored_middleware_result_is_revalidated() -> None:
    stack = Stack()
    stack.registry.register(tool("echo", output_schema={"type": "object"}))

    class Authoring:
        @hookimpl
        def dsh_around_dispatch(self) -> Any:
            async def middleware(call: ToolExecution, proceed: Any) -> ToolResult:
                return ToolResult(content="cached", value="not an object")

            return middleware

    register(stack.hooks, Authoring())
    assert (await stack.call("echo")).code == "INVALID_TOOL_OUTPUT"


async def test_unknown_names_pass_policy_and_fail_at_dispatch() -> None:
    stack = Stack()
    recorder = register(stack.hooks, Recorder())
    result = await stack.call("missing")
    assert result.code == "UNKNOWN_TOOL"
    assert recorder.stages() == ["pre", "guard", "post", "result"]


async def test_tool_errors_are_typed_and_untyped_ones_are_tool_failed() -> None:
    stack = Stack()

    def typed(args: Any, ctx: Any) -> Any:
        raise ToolError("file not found: a.txt", code="NOT_FOUND")

    def untyped(args: Any, ctx: Any) -> Any:
        raise KeyError("x")

    stack.registry.register(tool("typed", body=typed))
    stack.registry.register(tool("untyped", body=untyped))
    typed_result = await stack.call("typed")
    assert typed_result.code == "NOT_FOUND" and typed_result.text == "Error: file not found: a.txt"
    untyped_result = await stack.call("untyped")
    assert untyped_result.code == "TOOL_FAILED" and "KeyError" in untyped_result.text


async def test_a_tool_error_raised_with_an_exception_for_its_message_keeps_that_text() -> None:
    """``raise ToolError(error)`` is common; ToolErrorInfo now refuses a non-str message, and the
    model read "TypeError: ToolErrorInfo.message must be str" instead of the error's own text."""
    stack = Stack()

    def body(args: Any, ctx: Any) -> Any:
        raise ToolError(FileNotFoundError(2, "No such file"), code="NOT_FOUND")  # type: ignore[arg-type]

    stack.registry.register(tool("opens", body=body))
    result = await stack.call("opens")
    assert result.error is not None and (result.code, result.error.message) == ("NOT_FOUND", "[Errno 2] No such file")
    assert result.text == "Error: [Errno 2] No such file"


async def test_every_execution_emits_exactly_one_result_event() -> None:
    stack = Stack(mode="code")
    stack.registry.register(tool("echo"))
    recorder = register(stack.hooks, Recorder(pre=PreDecision.ask(), approval="rejected"))
    await stack.call("echo")  # collapsed
    token = ExecutionToken()
    stack.runtime.open_nesting(token, None)
    await stack.call("echo", parent=token)  # nested, rejected by approval
    await stack.call("run_code")  # the transport
    await stack.call("echo", {"text": object()})  # invalid args
    assert [stage for stage in recorder.stages() if stage == "result"] == ["result"] * 4


async def test_observer_failures_are_contained() -> None:
    stack = Stack()
    stack.registry.register(tool("echo"))

    class Failing:
        @hookimpl
        def dsh_tool_result(self) -> None:
            raise RuntimeError("observer bug")

    register(stack.hooks, Failing())
    later = register(stack.hooks, Recorder())
    failing_after = register(stack.hooks, Failing())
    assert failing_after is not None
    result = await stack.call("echo")
    assert not result.is_error
    assert later.stages()[-1] == "result"


async def test_the_finalizer_runs_exactly_once_per_outcome() -> None:
    calls: list[str | None] = []

    def finalize(execution: ToolExecution, result: ToolResult) -> None:
        calls.append(result.code)

    stack = Stack()
    stack.registry.register(tool("echo", finalize=finalize))
    register(stack.hooks, Recorder(post=PostDecision.block("no")))
    await stack.call("echo")
    await stack.call("echo", {"text": 1})
    assert calls == ["BLOCKED", "INVALID_ARGS"]


async def test_conclude_turn_and_deferred_contexts() -> None:
    stack = Stack()

    def body(args: Any, ctx: Any) -> Any:
        ctx.defer_context("one")
        ctx.defer_context(ContextMessage("two", source="test"))
        ctx.conclude_turn()
        return {}

    stack.registry.register(tool("done", body=body))
    result = await stack.call("done")
    assert result.concludes_turn
    assert [c.text for c in result.additional_contexts] == ["one", "two"]


async def test_arguments_the_body_receives_are_frozen() -> None:
    stack = Stack()

    def body(args: Any, ctx: Any) -> Any:
        with pytest.raises(TypeError, match="immutable"):
            args["text"] = "changed"
        return {}

    stack.registry.register(tool("echo", body=body))
    assert not (await stack.call("echo", {"text": "x"})).is_error


async def test_asyncio_cancellation_still_emits_one_result_event() -> None:
    stack = Stack()
    started = asyncio.Event()

    async def body(args: Any, ctx: Any) -> Any:
        started.set()
        await asyncio.sleep(10)

    stack.registry.register(tool("hang", body=body))
    recorder = register(stack.hooks, Recorder())
    task = asyncio.ensure_future(stack.call("hang"))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert recorder.results[-1][1].code == "ABORTED"


async def test_cancelling_a_call_during_approval_emits_its_result_and_stops_the_prompt() -> None:
    stack = Stack()
    echo = tool("echo")
    stack.registry.register(echo)
    asking = asyncio.Event()
    prompt_ended: list[str] = []

    class SlowPerson:
        @hookimpl
        def dsh_pre_execute(self) -> PreDecision:
            return PreDecision.ask("check")

        @hookimpl
        def dsh_approve(self, request: Any) -> Any:
            async def wait() -> ApprovalOutcome:
                asking.set()
                try:
                    await asyncio.sleep(30)
                finally:
                    prompt_ended.append("ended")
                return ApprovalOutcome.ALLOWED

            return wait()

    register(stack.hooks, SlowPerson())
    recorder = register(stack.hooks, Recorder())
    task = asyncio.ensure_future(stack.call("echo"))
    await asking.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert prompt_ended == ["ended"]
    assert [r.code for _, r in recorder.results] == ["ABORTED_BEFORE_DISPATCH"]
    assert body_calls(echo) == []


async def test_an_unexpected_error_in_policy_still_settles_the_call_with_one_result(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """prepare() never raises for a broken stage: the staged call settles, so every caller can finish it."""
    stack = Stack()
    echo = tool("echo")
    stack.registry.register(echo)
    recorder = register(stack.hooks, Recorder())

    def broken(scope: object) -> list[object]:
        raise RuntimeError("registry state corrupted")

    monkeypatch.setattr(stack.registry, "guards_for", broken)
    staged = await stack.runtime.prepare(ToolExecutionInput(call_id="c", name="echo", arguments={}))
    assert staged.kind == "final-result" and staged.result is not None and staged.result.code == "TOOL_FAILED"
    result = await stack.runtime.finish(staged)
    assert "registry state corrupted" in result.text and recorder.results[-1][1] is result
    assert body_calls(echo) == []


class _RaisingPre:
    @hookimpl
    def dsh_pre_execute(self) -> None:
        raise KeyError("tenant")


class _RaisingPost:
    @hookimpl
    def dsh_post_execute(self) -> None:
        raise ValueError("")  # an exception with an empty message


class _RaisingAround:
    @hookimpl
    def dsh_around_dispatch(self) -> None:
        raise RuntimeError("no wrapper today")


class _RaisingMiddleware:
    @hookimpl
    def dsh_around_dispatch(self) -> Any:
        async def middleware(call: ToolExecution, proceed: Any) -> ToolResult:
            raise RuntimeError("wrapper bug")

        return middleware


class _RaisingGuard:
    @hookimpl
    def dsh_guard(self) -> None:
        raise RuntimeError("guard bug")


@pytest.mark.parametrize(
    ("plugin", "message"),
    [
        (_RaisingPre(), "dsh_pre_execute of plugin 'acme' failed: KeyError: 'tenant'"),
        (_RaisingPost(), "dsh_post_execute of plugin 'acme' failed: ValueError"),
        (_RaisingAround(), "dsh_around_dispatch of plugin 'acme' failed: RuntimeError: no wrapper today"),
        (_RaisingMiddleware(), "dsh_around_dispatch of plugin 'acme' failed: RuntimeError: wrapper bug"),
        (_RaisingGuard(), "dsh_guard of plugin 'acme' failed: RuntimeError: guard bug"),
    ],
)
async def test_a_raising_hook_names_its_hook_and_plugin_and_is_logged(
    plugin: object, message: str, caplog: pytest.LogCaptureFixture
) -> None:
    stack = Stack()
    stack.registry.register(tool("echo"))
    register(stack.hooks, plugin, name="acme")
    with caplog.at_level("WARNING", logger="dsh"):
        result = await stack.call("echo", call_id="c-7")
    assert result.error is not None and result.error.message == message
    hook = message.split(" ", 1)[0]
    records = [r for r in caplog.records if r.name == "dsh" and r.levelname == "WARNING"]
    assert len(records) == 1 and records[0].exc_info is not None
    logged = records[0].getMessage()
    assert hook in logged and "'acme'" in logged and "'c-7'" in logged


async def test_a_failing_inner_middleware_is_blamed_not_the_outer_one_it_passed_through() -> None:
    stack = Stack()
    stack.registry.register(tool("echo"))

    class Outer:
        @hookimpl
        def dsh_around_dispatch(self) -> Any:
            async def middleware(call: ToolExecution, proceed: Any) -> ToolResult:
                return await proceed(call)  # type: ignore[no-any-return]

            return middleware

    register(stack.hooks, _RaisingMiddleware(), name="inner")
    register(stack.hooks, Outer(), name="outer")  # registered last: called first, the outermost
    result = await stack.call("echo")
    assert result.error is not None
    assert result.error.message == "dsh_around_dispatch of plugin 'inner' failed: RuntimeError: wrapper bug"


async def test_a_raising_registry_guard_is_named_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    stack = Stack()
    echo = tool("echo")
    stack.registry.register(echo)

    def tenant_guard(execution: ToolExecution) -> None:
        raise RuntimeError("quota service down")

    stack.registry.guard(tenant_guard)
    with caplog.at_level("WARNING", logger="dsh"):
        result = await stack.call("echo")
    assert result.code == "DENIED" and body_calls(echo) == []
    assert result.error is not None and result.error.message.startswith("guard ")
    assert result.error.message.endswith(
        "test_pipeline.test_a_raising_registry_guard_is_named_and_logged.<locals>.tenant_guard "
        "failed: RuntimeError: quota service down"
    )
    assert "tenant_guard" in caplog.text and "quota service down" in caplog.text


@pytest.mark.parametrize("where", ["hook guard", "registry guard"])
async def test_a_guard_raising_a_typed_error_denies_instead_of_keeping_its_code(where: str) -> None:
    # Guards fail closed: unlike the other hooks, a DshError a guard raises does not keep
    # its own code: any guard failure is a denial naming the guard.
    stack = Stack()
    echo = tool("echo")
    stack.registry.register(echo)

    def quota(execution: ToolExecution) -> None:
        raise ToolError("tenant 'acme' is over its quota", code="QUOTA_EXCEEDED")

    class Quota:
        @hookimpl
        def dsh_guard(self, execution: ToolExecution) -> None:
            quota(execution)

    if where == "hook guard":
        register(stack.hooks, Quota(), name="quota")
    else:
        stack.registry.guard(quota)
    result = await stack.call("echo")
    assert result.code == "DENIED" and body_calls(echo) == []
    assert result.error is not None
    assert result.error.message.endswith("failed: ToolError: tenant 'acme' is over its quota")
    if where == "hook guard":
        assert result.error.message.startswith("dsh_guard of plugin 'quota' failed")


@pytest.mark.parametrize("denial", ["pre-execute", "approval", "registry guard", "hook guard", "aborted"])
async def test_post_execute_never_sees_or_rewrites_a_call_denied_before_dispatch(denial: str) -> None:
    stack = Stack()
    echo = tool("echo")
    stack.registry.register(echo)
    rewriter = register(stack.hooks, Recorder(post=PostDecision.replace_content("all good, file written")))
    controller = AbortController()
    if denial == "pre-execute":
        register(stack.hooks, Recorder(pre=PreDecision.deny("policy says no")))
    elif denial == "approval":
        register(stack.hooks, Recorder(pre=PreDecision.ask("why"), approval="rejected"))
    elif denial == "registry guard":
        stack.registry.guard(lambda execution: "guard says no")
    elif denial == "hook guard":
        register(stack.hooks, Recorder(guard="guard says no"))
    else:

        class AbortInGuard:  # the call is aborted after the guards passed, before dispatch
            @hookimpl
            def dsh_guard(self) -> None:
                controller.abort("stop")

        register(stack.hooks, AbortInGuard())
    result = await stack.call("echo", signal=controller.signal)
    assert result.is_error and result.code in ("DENIED", "ABORTED_BEFORE_DISPATCH")
    assert "all good" not in result.text and body_calls(echo) == []
    assert "post" not in rewriter.stages() and rewriter.stages()[-1] == "result"


async def test_post_execute_still_sees_dispatched_failures() -> None:
    stack = Stack()
    stack.registry.register(tool("boom", body=lambda a, c: (_ for _ in ()).throw(ToolError("disk full"))))
    recorder = register(stack.hooks, Recorder())
    assert (await stack.call("boom")).code == "TOOL_FAILED"
    assert (await stack.call("missing")).code == "UNKNOWN_TOOL"  # unknown names fail at dispatch
    assert recorder.stages() == ["pre", "guard", "post", "result"] * 2


async def test_a_middleware_cannot_hand_back_a_failure_that_concludes_the_turn_or_carries_a_value() -> None:
    """A failure never has a value or concludes_turn: the agent loop ended its turn on an authored one."""
    stack = Stack()
    stack.registry.register(tool("echo"))
    authored: list[dict[str, Any]] = [{"concludes_turn": True}, {"value": {"echo": "x"}}]

    class Authoring:
        @hookimpl
        def dsh_around_dispatch(self) -> Any:
            async def middleware(call: ToolExecution, proceed: Any) -> ToolResult:
                return attrs.evolve(ToolResult.failure("NOPE", "refused"), **authored.pop(0))

            return middleware

    register(stack.hooks, Authoring(), name="authoring")
    for _ in range(2):
        result = await stack.call("echo", {"text": "x"})
        assert result.is_error and not result.concludes_turn and result.value is None
        assert result.code == "TOOL_FAILED" and "'authoring'" in result.text


@pytest.mark.parametrize("ending", ["returns", "raises"])
async def test_a_body_a_middleware_detached_is_awaited_before_the_call_settles(ending: str) -> None:
    """A middleware that ran proceed in a task of its own and answered early: the body kept running
    after the call's one result was emitted (and, for the transport, kept accepting nested calls)."""
    stack = Stack()
    events: list[str] = []
    started, release = asyncio.Event(), asyncio.Event()

    async def body(args: Any, ctx: Any) -> Any:
        started.set()
        await release.wait()
        events.append("body ended")
        return {"echo": "late"}

    stack.registry.register(tool("slow", body=body))
    detached: list[asyncio.Future[Any]] = []

    class Detaching:
        @hookimpl
        def dsh_around_dispatch(self) -> Any:
            async def middleware(call: ToolExecution, proceed: Any) -> ToolResult:
                detached.append(asyncio.ensure_future(proceed(call)))
                await started.wait()
                asyncio.get_running_loop().call_later(0.01, release.set)
                if ending == "raises":
                    raise ToolError("gave up")
                return ToolResult(content="early", value={"echo": "early"})

            return middleware

    class Observer:
        @hookimpl
        def dsh_tool_result(self, result: ToolResult) -> None:
            events.append(f"result {result.code or result.value}")

    register(stack.hooks, Detaching())
    register(stack.hooks, Observer())
    result = await stack.call("slow", {})
    assert events == ["body ended", f"result {result.code or result.value}"]
    assert result.value == {"echo": "early"} if ending == "returns" else result.text == "Error: gave up"
    assert (await detached[0]).value == {"echo": "late"}


async def test_a_cancelled_call_cuts_a_body_a_middleware_detached_and_ends_after_it() -> None:
    """Cancelled while a middleware awaits (shielded) the body it runs in a task of its own: the
    cancellation reaches that body as it would one run in the call's own task, and the call's
    result is emitted once the body has ended, not while it still runs."""
    stack = Stack()
    events: list[str] = []
    started, cut, cleaned_up = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def body(args: Any, ctx: Any) -> Any:
        started.set()
        try:
            await asyncio.Event().wait()  # ignores its signal: only a cut stops it
        except asyncio.CancelledError:
            events.append("body cut")
            cut.set()
            await cleaned_up.wait()
            events.append("body ended")
            raise
        return {"echo": "never"}

    stack.registry.register(tool("slow", body=body))

    class Detaching:
        @hookimpl
        def dsh_around_dispatch(self) -> Any:
            async def middleware(call: ToolExecution, proceed: Any) -> ToolResult:
                return await asyncio.shield(asyncio.ensure_future(proceed(call)))  # type: ignore[no-any-return]

            return middleware

    class Observer:
        @hookimpl
        def dsh_tool_result(self, result: ToolResult) -> None:
            events.append(f"result {result.code}")

    register(stack.hooks, Detaching())
    register(stack.hooks, Observer())
    call = asyncio.ensure_future(stack.call("slow", {}))
    await started.wait()
    call.cancel()
    try:
        # Cut, the body cleans up while the call waits; left running, the call ends at once.
        cut_seen = asyncio.ensure_future(cut.wait())
        await asyncio.wait({call, cut_seen}, return_when=asyncio.FIRST_COMPLETED)
        cut_seen.cancel()
    finally:
        cleaned_up.set()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert events == ["body cut", "body ended", "result ABORTED"]


async def test_a_body_that_lets_out_a_cancellation_nobody_asked_for_fails_only_its_call() -> None:
    """A body awaiting a future someone else cancelled raises CancelledError: that is the tool's
    failure, not the cancellation of the caller (an agent run would end as interrupted)."""

    async def awaits_a_cancelled_future(args: Any, ctx: Any) -> Any:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        future.cancel()
        await future

    stack = Stack()
    stack.registry.register(tool("flaky", body=awaits_a_cancelled_future))
    result = await stack.call("flaky")
    assert result.error is not None and result.error.code == ErrorCode.TOOL_FAILED, result
    assert "CancelledError" in result.error.message and '"flaky"' in result.error.message


async def test_a_body_cancelling_its_own_work_on_abort_is_aborted_not_failed() -> None:
    controller = AbortController()

    async def cancels_its_subtask_on_abort(args: Any, ctx: Any) -> Any:
        work = asyncio.get_running_loop().create_task(asyncio.sleep(10))
        ctx.signal.add_listener(lambda reason: work.cancel())
        controller.abort("user")
        await work

    stack = Stack()
    stack.registry.register(tool("slow", body=cancels_its_subtask_on_abort))
    result = await stack.call("slow", signal=controller.signal)
    assert result.error is not None and result.error.code == ErrorCode.ABORTED, result


async def test_a_call_that_is_cancelled_still_raises_cancelled_error() -> None:
    started = asyncio.Event()

    async def waits(args: Any, ctx: Any) -> Any:
        started.set()
        await asyncio.sleep(10)

    stack = Stack()
    stack.registry.register(tool("waits", body=waits))
    task = asyncio.get_running_loop().create_task(stack.call("waits"))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def _lets_out_a_stray_cancellation() -> None:
    """Await a future something else cancelled: a CancelledError although nobody cancelled the caller."""
    future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    future.cancel()
    await future


class _StrayPre:
    @hookimpl
    def dsh_pre_execute(self, execution: ToolExecution) -> Any:
        return _lets_out_a_stray_cancellation()


class _StrayGuard:
    @hookimpl
    def dsh_guard(self, execution: ToolExecution) -> Any:
        return _lets_out_a_stray_cancellation()


class _StrayApproval:
    @hookimpl
    def dsh_pre_execute(self, execution: ToolExecution) -> PreDecision:
        return PreDecision.ask("check")

    @hookimpl
    def dsh_approve(self, request: Any) -> Any:
        return _lets_out_a_stray_cancellation()


class _StrayMiddleware:
    @hookimpl
    def dsh_around_dispatch(self, execution: ToolExecution) -> Any:
        async def middleware(call: ToolExecution, proceed: Any) -> ToolResult:
            await _lets_out_a_stray_cancellation()
            return await proceed(call)  # pragma: no cover - never reached

        return middleware


class _StrayPost:
    @hookimpl
    def dsh_post_execute(self, execution: ToolExecution, result: ToolResult) -> Any:
        return _lets_out_a_stray_cancellation()


@pytest.mark.parametrize(
    ("plugin", "code", "body_runs"),
    [
        (_StrayPre, ErrorCode.TOOL_FAILED, False),
        (_StrayGuard, ErrorCode.DENIED, False),
        (_StrayApproval, ErrorCode.DENIED, False),
        (_StrayMiddleware, ErrorCode.TOOL_FAILED, False),
        (_StrayPost, ErrorCode.TOOL_FAILED, True),
    ],
)
async def test_a_hook_that_lets_out_a_cancellation_nobody_asked_for_fails_only_its_call(
    plugin: type, code: str, body_runs: bool
) -> None:
    """As for a body: a hook's stray CancelledError is that plugin's failure (a denial, fail closed, for a
    security stage), never the cancellation of the caller, which would end a whole agent run as interrupted."""
    stack = Stack()
    echo = tool()
    stack.registry.register(echo)
    seen: list[ToolResult] = []

    class Observer:
        @hookimpl
        def dsh_tool_result(self, result: ToolResult) -> None:
            seen.append(result)

    register(stack.hooks, Observer())
    stack.hooks.register(plugin(), name="stray")
    result = await stack.call("echo", {"text": "x"})
    assert result.error is not None and result.error.code == code, result
    assert seen == [result]
    assert len(body_calls(echo)) == (1 if body_runs else 0)
    if plugin is not _StrayApproval:  # the approval channel's failure reads "no approval channel is available"
        assert "'stray'" in result.error.message and "CancelledError" in result.error.message, result


async def test_a_registry_guard_that_lets_out_a_cancellation_nobody_asked_for_denies_the_call() -> None:
    stack = Stack()
    echo = tool()
    stack.registry.register(echo)

    async def stray_guard(execution: ToolExecution) -> None:
        await _lets_out_a_stray_cancellation()

    stack.registry.guard(stray_guard)
    result = await stack.call("echo", {"text": "x"})
    assert result.error is not None and result.error.code == ErrorCode.DENIED, result
    assert "stray_guard" in result.error.message and "CancelledError" in result.error.message
    assert body_calls(echo) == []


async def test_an_invalid_argument_error_stays_short_however_large_the_arguments() -> None:
    # jsonschema's messages quote the offending value, and there is one per offending item: a model
    # sending a huge value (or many bad items) must not get all of it back in its error message.
    stack = Stack()
    stack.registry.register(
        tool(
            "sum",
            parameters={
                "type": "object",
                "properties": {"label": {"type": "string"}, "numbers": {"type": "array", "items": {"type": "integer"}}},
            },
        )
    )
    result = await stack.call("sum", {"label": list(range(100_000))})
    assert result.error is not None and result.error.code == ErrorCode.INVALID_ARGS
    assert len(result.error.message) < 2_000, len(result.error.message)
    assert "/label: [0, 1, 2" in result.error.message and "is not of type 'string'" in result.error.message
    result = await stack.call("sum", {"numbers": ["x"] * 10_000})
    assert result.error is not None and result.error.code == ErrorCode.INVALID_ARGS
    assert len(result.error.message) < 2_000, len(result.error.message)
    assert "/numbers/0: 'x' is not of type 'integer'" in result.error.message
    assert "9990 more" in result.error.message


async def test_a_value_too_deep_to_check_is_blamed_on_its_depth_not_on_the_schema() -> None:
    """A plain schema meeting a very deep value fails validation (jsonschema recurses to quote
    the value): the message says the value is too deep, not that the schema has a $ref cycle."""
    stack = Stack()
    echo = tool("echo", parameters={"type": "object", "properties": {"text": {"type": "string"}}})
    stack.registry.register(echo)
    deep: list[Any] = []
    inner = deep
    for _ in range(3000):
        inner.append([])
        inner = inner[0]
    result = await stack.call("echo", {"text": deep})
    assert result.code == "INVALID_ARGS" and body_calls(echo) == []
    assert "the value is too deep to check" in result.text and "$ref cycle" not in result.text, result.text


async def test_an_approval_channel_that_lets_out_a_stray_cancellation_is_its_failure_not_a_cancelled_ask(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Like every other hook: the channel failed (logged, naming it; the ask is unavailable), and the
    observers are not told the ask was cancelled, which nobody did."""
    stack = Stack()
    echo = tool()
    stack.registry.register(echo)
    heard: list[ApprovalOutcome] = []

    class Journal:
        @hookimpl
        def dsh_approval_resolved(self, request: Any, outcome: ApprovalOutcome) -> None:
            heard.append(outcome)

    register(stack.hooks, Journal())
    stack.hooks.register(_StrayApproval(), name="stray")
    with caplog.at_level("WARNING", logger="dsh"):
        result = await stack.call("echo", {"text": "x"})
    assert result.error is not None and result.error.code == ErrorCode.DENIED, result
    assert "no approval channel is available" in result.error.message, result
    assert heard == [ApprovalOutcome.UNAVAILABLE]
    assert "approval channel of plugin 'stray' failed" in caplog.text
    assert body_calls(echo) == []
