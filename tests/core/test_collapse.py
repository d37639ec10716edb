"""The Code Mode collapse, pinned through the executor (not through get()/schemas())."""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from dsh_core.abort import AbortSignal
from dsh_core.errors import RegistrationError
from dsh_core.model import ExecutionToken, PreDecision, ToolExecutionInput
from dsh_core.runtime import collapsed_message

from .helpers import Recorder, Stack, body_calls, register, tool

pytestmark = pytest.mark.anyio


async def test_model_direct_native_call_under_code_is_unknown_and_no_hook_sees_it() -> None:
    """A collapsed call ends at creation: UNKNOWN_TOOL with the rerouting message; no policy hook sees it."""
    stack = Stack(mode="code")
    echo = tool("echo")
    stack.registry.register(echo)
    recorder = register(stack.hooks, Recorder(pre=PreDecision.ask("would ask a person"), approval="allowed"))
    result = await stack.call("echo", {"text": "hi"})
    assert result.code == "UNKNOWN_TOOL"
    assert result.error is not None and result.error.message == collapsed_message("echo")
    assert "from inside a `run_code` program" in result.text
    assert body_calls(echo) == []
    assert recorder.stages() == ["result"]  # only the one result event; pre/approve/guard never ran


async def test_nested_call_with_parent_token_passes_the_collapse() -> None:
    """The same tool from inside a program (a live parent token) runs, through policy."""
    stack = Stack(mode="code")
    echo = tool("echo")
    stack.registry.register(echo)
    recorder = register(stack.hooks, Recorder())
    token = ExecutionToken()
    close = stack.runtime.open_nesting(token, None)
    result = await stack.call("echo", {"text": "hi"}, parent=token)
    close()
    assert not result.is_error and result.value == {"echo": "hi"}
    assert recorder.stages() == ["pre", "guard", "post", "result"]
    assert recorder.results[-1][0].parent is token


async def test_a_forged_or_stale_parent_token_does_not_pass_the_collapse() -> None:
    """Only the token of a run_code body that is running now makes a call nested."""
    stack = Stack(mode="code")
    echo = tool("echo")
    stack.registry.register(echo)
    recorder = register(stack.hooks, Recorder())
    forged = await stack.call("echo", parent=ExecutionToken())
    assert forged.code == "UNKNOWN_TOOL" and body_calls(echo) == []
    assert recorder.results[-1][0].parent is None  # treated, and shown, as model-direct
    stale = ExecutionToken()
    stack.runtime.open_nesting(stale, None)()
    assert (await stack.call("echo", parent=stale)).code == "UNKNOWN_TOOL"
    assert body_calls(echo) == []


async def test_a_live_parent_token_presented_with_another_agents_scope_is_model_direct() -> None:
    """A program's token makes its own agent's calls nested, not another agent's: presented with a
    different scope, the call gets exactly what a forged token gets (that agent's collapse)."""
    stack = Stack(mode="code")
    echo = tool("echo", safe=True)
    stack.registry.register(echo)
    recorder = register(stack.hooks, Recorder())
    owner, other = stack.agent("owner"), stack.agent("other")
    outcomes: dict[str, tuple[Any, Any, Any]] = {}

    async def program(args: object, ctx: Any) -> object:
        token = ctx.execution.token
        for label, agent in (("other", other), ("root", None), ("own", owner)):
            request = ToolExecutionInput(
                call_id=f"in-{label}", name="echo", arguments={"text": label}, agent=agent, parent=token
            )
            mode = stack.runtime.execution_mode(request)
            result = await stack.runtime.execute(request)
            outcomes[label] = (mode, result, recorder.results[-1][0].parent)
        return {}

    stack.registry._transport = attrs.evolve(tool("run_code_body", body=program), name="run_code")
    assert not (await stack.call("run_code", agent=owner)).is_error
    forged = await stack.call("echo", {"text": "other"}, agent=other, parent=ExecutionToken())
    for label in ("other", "root"):
        mode, result, parent = outcomes[label]
        assert mode == "exclusive", label  # classified as a collapsed call, as execute treats it
        assert result.code == forged.code == "UNKNOWN_TOOL" and result.text == forged.text, label
        assert result.error is not None and result.error.message == collapsed_message("echo"), label
        assert parent is None, label  # shown to observers as model-direct
    mode, result, parent = outcomes["own"]
    assert mode == "parallel"
    assert not result.is_error and result.value == {"echo": "own"}
    assert parent is not None  # nested under the program
    assert body_calls(echo) == [{"text": "own"}]


async def test_a_token_opened_by_hand_is_tied_to_the_agent_it_was_opened_for() -> None:
    """The contract for custom transports: the scope given to open_nesting is the only one nested."""
    stack = Stack(mode="code")
    echo = tool("echo")
    stack.registry.register(echo)
    owner = stack.agent("owner")
    for opened_for, presented in ((owner, None), (None, owner), (owner, stack.agent("owner"))):
        token = ExecutionToken()
        close = stack.runtime.open_nesting(token, opened_for)
        try:
            assert (await stack.call("echo", agent=presented, parent=token)).code == "UNKNOWN_TOOL"
            assert not (await stack.call("echo", agent=opened_for, parent=token)).is_error
        finally:
            close()
    assert len(body_calls(echo)) == 3


async def test_opening_a_live_token_for_a_different_agent_is_refused() -> None:
    """A token is one execution's: opened again for another agent is a bug, refused, and the first
    opening stands (still nested for its own agent, still closed once by its own opener)."""
    stack = Stack(mode="code")
    stack.registry.register(tool("echo"))
    owner, other = stack.agent("owner"), stack.agent("other")
    token = ExecutionToken()
    close = stack.runtime.open_nesting(token, owner)
    with pytest.raises(ValueError, match="already open for another agent"):
        stack.runtime.open_nesting(token, other)
    with pytest.raises(ValueError, match="already open for another agent"):
        stack.runtime.open_nesting(token, None)
    assert (await stack.call("echo", agent=other, parent=token)).code == "UNKNOWN_TOOL"
    assert not (await stack.call("echo", agent=owner, parent=token)).is_error
    stack.runtime.open_nesting(token, owner)()  # the same agent again: counted, as before
    assert not (await stack.call("echo", agent=owner, parent=token)).is_error
    close()
    assert (await stack.call("echo", agent=owner, parent=token)).code == "UNKNOWN_TOOL"
    stack.runtime.open_nesting(token, other)()  # closed, it may be opened afresh


async def test_the_transport_body_opens_nesting_for_exactly_its_own_run() -> None:
    """Calls naming the running run_code execution as parent are nested; after it returns they are not."""
    stack = Stack(mode="code")
    echo = tool("echo")
    stack.registry.register(echo)
    seen: list[object] = []

    async def program(args: object, ctx: Any) -> object:
        inner = await stack.call("echo", {"text": "in"}, parent=ctx.execution.token)
        seen.append(ctx.execution.token)
        return {"inner": inner.code}

    stack.registry._transport = attrs.evolve(tool("run_code_body", body=program), name="run_code")
    result = await stack.call("run_code")
    assert result.value == {"inner": None}
    assert (await stack.call("echo", parent=seen[0])).code == "UNKNOWN_TOOL"  # the run is over


@pytest.mark.parametrize("mode", ["native", "both"])
async def test_native_and_both_modes_run_direct_calls(mode: str) -> None:
    stack = Stack(mode=mode)
    stack.registry.register(tool("echo"))
    assert (await stack.call("echo", {"text": "x"})).value == {"echo": "x"}


@pytest.mark.parametrize("mode", ["code", "both"])
async def test_run_code_is_reachable_in_every_non_native_mode(mode: str) -> None:
    stack = Stack(mode=mode)
    result = await stack.call("run_code", {"text": "program"})
    assert not result.is_error
    assert body_calls(stack.transport) == [{"text": "program"}]


async def test_native_agent_has_no_run_code_in_its_dispatch_table() -> None:
    stack = Stack(mode="native")
    result = await stack.call("run_code", {"text": "x"})
    assert result.code == "UNKNOWN_TOOL"
    assert body_calls(stack.transport) == []


async def test_one_agent_in_code_while_the_deployment_stays_native() -> None:
    stack = Stack(mode="native")
    stack.registry.register(tool("echo"))
    coder, plain = stack.agent("coder"), stack.agent("plain")
    stack.registry.present_as("code", coder)
    assert (await stack.call("echo", agent=coder)).code == "UNKNOWN_TOOL"
    assert not (await stack.call("echo", agent=plain)).is_error
    assert not (await stack.call("run_code", agent=coder)).is_error
    assert (await stack.call("run_code", agent=plain)).code == "UNKNOWN_TOOL"


async def test_an_agent_opts_out_of_a_code_deployment() -> None:
    stack = Stack(mode="code")
    stack.registry.register(tool("echo"))
    native = stack.agent("native")
    stack.registry.present_as("native", native)
    assert not (await stack.call("echo", agent=native)).is_error
    assert (await stack.call("echo")).code == "UNKNOWN_TOOL"


async def test_a_preset_mode_is_inherited_and_siblings_are_unaffected() -> None:
    stack = Stack(mode="native")
    stack.registry.register(tool("echo"))
    preset = stack.root.child("preset:code", layered=True)
    stack.registry.present_as("code", preset)
    inside, sibling = stack.agent("inside", parent=preset), stack.agent("sibling")
    assert (await stack.call("echo", agent=inside)).code == "UNKNOWN_TOOL"
    assert not (await stack.call("echo", agent=sibling)).is_error


async def test_a_second_mode_declaration_in_one_scope_is_refused() -> None:
    stack = Stack()
    agent = stack.agent()
    stack.registry.present_as("code", agent)
    with pytest.raises(RegistrationError, match="conflicts with mode 'code'"):
        stack.registry.present_as("both", agent)
    with pytest.raises(RegistrationError, match="requires a scoped context"):
        stack.registry.present_as("code", stack.root)


async def test_disposing_the_agent_restores_the_default() -> None:
    stack = Stack(mode="native")
    stack.registry.register(tool("echo"))
    agent = stack.agent()
    stack.registry.present_as("code", agent)
    assert (await stack.call("echo", agent=agent)).code == "UNKNOWN_TOOL"
    await agent.dispose()
    assert stack.registry.mode_for(agent) == "native"
    # The layer is gone, but a disposed agent's calls do not run under the default instead.
    assert (await stack.call("echo", agent=agent)).code == "ABORTED_BEFORE_DISPATCH"
    live = stack.agent("live")
    restore = stack.registry.present_as("code", live)
    assert (await stack.call("echo", agent=live)).code == "UNKNOWN_TOOL"
    restore()
    assert not (await stack.call("echo", agent=live)).is_error


async def test_restrictions_cannot_remove_run_code_and_no_registration_shadows_it() -> None:
    stack = Stack(mode="code")
    stack.registry.register(tool("echo"))
    agent = stack.agent()
    with pytest.raises(RegistrationError, match="reserved transport"):
        stack.registry.restrict(agent, deny=["run_code"])
    stack.registry.restrict(agent, allow=["echo"])
    with pytest.raises(RegistrationError, match="reserved"):
        stack.registry.register(tool("run_code"), scope=agent)
    with pytest.raises(RegistrationError, match="reserved"):
        stack.registry.register(tool("run_code"))
    assert not (await stack.call("run_code", agent=agent)).is_error
    assert body_calls(stack.transport) == [{}]


async def test_a_pre_aborted_collapsed_call_is_aborted_before_dispatch_with_the_finalizer() -> None:
    finalized: list[str] = []

    def finalize(execution: object, result: object) -> str:
        finalized.append("x")
        return "finalized"

    stack = Stack(mode="code")
    stack.registry.register(tool("echo", finalize=finalize))
    recorder = register(stack.hooks, Recorder())
    result = await stack.call("echo", signal=AbortSignal.aborted_with("stop"))
    assert result.code == "ABORTED_BEFORE_DISPATCH"
    assert result.text == "finalized" and finalized == ["x"]
    assert recorder.stages() == ["result"]


async def test_the_collapsed_unknown_tool_drops_the_finalizer() -> None:
    stack = Stack(mode="code")
    stack.registry.register(tool("echo", finalize=lambda e, r: "finalized"))
    result = await stack.call("echo")
    assert result.code == "UNKNOWN_TOOL" and "only `run_code`" in result.text


async def test_invalid_arguments_win_over_the_collapse() -> None:
    stack = Stack(mode="code")
    echo = tool("echo")
    stack.registry.register(echo)
    recorder = register(stack.hooks, Recorder())
    result = await stack.call("echo", {"text": float("nan")})
    assert result.code == "INVALID_ARGS"
    assert "/text" in result.text
    assert recorder.stages() == ["result"] and body_calls(echo) == []


async def test_a_collapsed_call_is_exclusive() -> None:
    stack = Stack(mode="code")
    stack.registry.register(tool("echo", safe=True))
    request = ToolExecutionInput(call_id="c", name="echo", arguments={})
    assert stack.runtime.execution_mode(request) == "exclusive"
    token = ExecutionToken()
    stack.runtime.open_nesting(token, None)
    nested = ToolExecutionInput(call_id="c", name="echo", arguments={}, parent=token)
    assert stack.runtime.execution_mode(nested) == "parallel"


async def test_an_unregistered_name_under_code_still_passes_policy_and_fails_at_dispatch() -> None:
    stack = Stack(mode="code")
    recorder = register(stack.hooks, Recorder())
    result = await stack.call("nope")
    assert result.code == "UNKNOWN_TOOL" and result.error is not None
    assert result.error.message == 'unknown tool "nope"'
    assert recorder.stages() == ["pre", "guard", "post", "result"]
