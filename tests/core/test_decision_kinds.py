"""Policy answers the core does not recognise fail closed, naming the plugin (or guard) that gave them."""

from __future__ import annotations

from typing import Any

import pytest

from dsh_core import hookimpl
from dsh_core.model import PostDecision, PreDecision, ToolExecution, ToolResult

from .helpers import Recorder, Stack, body_calls, register, tool

pytestmark = pytest.mark.anyio


def _bypassed(decision: Any, **fields: object) -> Any:
    """A decision changed after construction, around its validators (as a careless plugin might)."""
    for name, value in fields.items():
        object.__setattr__(decision, name, value)
    return decision


def test_decisions_of_unknown_kinds_are_refused_when_built() -> None:
    with pytest.raises(ValueError, match=r"PreDecision kind must be one of 'allow', 'deny', 'ask', got 'Deny'"):
        PreDecision("Deny", "rm is forbidden")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"PostDecision kind must be one of .*got 'blocked'"):
        PostDecision("blocked", content="[redacted]")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"PreDecision\.reason must be str or None, got int"):
        PreDecision("deny", 3)  # type: ignore[arg-type]


class _Pre:
    def __init__(self, make: Any) -> None:
        self.make = make

    @hookimpl
    def dsh_pre_execute(self, execution: ToolExecution) -> Any:
        return self.make()


class _Post:
    def __init__(self, make: Any) -> None:
        self.make = make

    @hookimpl
    def dsh_post_execute(self, execution: ToolExecution, result: ToolResult) -> Any:
        return self.make()


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda: PreDecision("Deny", "no rm"),  # type: ignore[arg-type]
            "dsh_pre_execute of plugin 'policy' failed: ValueError: PreDecision kind must be one of 'allow', 'deny', "
            "'ask', got 'Deny'",
        ),
        (
            lambda: _bypassed(PreDecision.allow(), kind="block"),
            "dsh_pre_execute of plugin 'policy' failed: ValueError: returned a PreDecision of unknown kind 'block', "
            "expected one of allow, deny, ask",
        ),
        (
            lambda: _bypassed(PreDecision.deny("no"), reason={"why": "no"}),
            "dsh_pre_execute of plugin 'policy' failed: TypeError: returned a PreDecision whose reason is dict, "
            "expected str or None",
        ),
        (
            lambda: {"kind": "allow"},
            "dsh_pre_execute of plugin 'policy' failed: TypeError: returned dict, expected PreDecision or None",
        ),
    ],
)
async def test_an_unrecognised_pre_execute_vote_fails_the_call_naming_the_plugin(make: Any, message: str) -> None:
    stack = Stack()
    rm = tool("rm")
    stack.registry.register(rm)
    recorder = register(stack.hooks, Recorder())
    register(stack.hooks, _Pre(make), name="policy")
    result = await stack.call("rm")
    assert result.code == "TOOL_FAILED" and result.error is not None and result.error.message == message
    assert body_calls(rm) == [] and "approve" not in recorder.stages() and "post" not in recorder.stages()


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda: PostDecision("blocked", content="[redacted]"),  # type: ignore[arg-type]
            "dsh_post_execute of plugin 'redact' failed: ValueError: PostDecision kind must be one of 'accept', "
            "'replace-value', 'replace-content', 'block', got 'blocked'",
        ),
        (
            lambda: _bypassed(PostDecision.block("[redacted]"), kind="blocked"),
            "dsh_post_execute of plugin 'redact' failed: ValueError: returned a PostDecision of unknown kind "
            "'blocked', expected one of accept, replace-value, replace-content, block",
        ),
    ],
)
async def test_an_unrecognised_post_execute_decision_fails_the_call_naming_the_plugin(make: Any, message: str) -> None:
    stack = Stack()
    stack.registry.register(tool("secret", body=lambda args, ctx: {"secret": "s3cr3t"}))
    register(stack.hooks, _Post(make), name="redact")
    result = await stack.call("secret")
    assert result.code == "TOOL_FAILED" and result.error is not None and result.error.message == message
    assert result.value is None and "s3cr3t" not in result.text


async def test_the_runtime_itself_fails_closed_on_a_decision_of_unknown_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    # Defence in depth behind the facade: whatever hands the runtime a decision, only an exact
    # allow dispatches and only an exact replace-value replaces the value.
    stack = Stack()
    echo = tool("echo")
    stack.registry.register(echo)

    async def pre_execute(execution: ToolExecution) -> PreDecision:
        return _bypassed(PreDecision.allow(), kind="Allow")  # type: ignore[no-any-return]

    monkeypatch.setattr(stack.hooks, "pre_execute", pre_execute)
    result = await stack.call("echo")
    assert result.code == "TOOL_FAILED" and "unknown kind 'Allow'" in result.text and body_calls(echo) == []

    stack2 = Stack()
    stack2.registry.register(tool("echo"))

    async def post_execute(execution: ToolExecution, result: ToolResult) -> list[tuple[str, PostDecision]]:
        return [("redact", _bypassed(PostDecision.accept(), kind="blocked"))]

    monkeypatch.setattr(stack2.hooks, "post_execute", post_execute)
    result2 = await stack2.call("echo")
    assert result2.code == "TOOL_FAILED" and result2.value is None
    assert result2.error is not None and "plugin 'redact'" in result2.error.message
    assert "unknown kind 'blocked'" in result2.error.message


class _Unhashable:
    __hash__ = None  # type: ignore[assignment]

    def __eq__(self, other: object) -> bool:
        raise RuntimeError("cannot compare")


@pytest.mark.parametrize("answer", ["ALLOWED", "yes", True, 1, {"outcome": "allowed"}, _Unhashable()])
async def test_an_approval_answer_that_is_not_an_outcome_never_allows(answer: object) -> None:
    stack = Stack()
    echo = tool("echo")
    stack.registry.register(echo)
    recorder = register(stack.hooks, Recorder(pre=PreDecision.ask("why"), approval=answer))
    result = await stack.call("echo")
    assert result.code == "DENIED" and body_calls(echo) == []
    assert result.error is not None and "no approval channel is available" in result.error.message
    assert recorder.stages() == ["pre", "approve", "result"]


@pytest.mark.parametrize("verdict", [False, True, 0, {"deny": True}])
async def test_a_hook_guard_returning_no_reason_and_not_none_denies_naming_the_plugin(verdict: object) -> None:
    stack = Stack()
    echo = tool("echo")
    stack.registry.register(echo)

    class Sloppy:
        @hookimpl
        def dsh_guard(self, execution: ToolExecution) -> Any:
            return verdict

    register(stack.hooks, Sloppy(), name="sloppy")
    result = await stack.call("echo")
    assert result.code == "DENIED" and body_calls(echo) == []
    assert result.error is not None and result.error.message == (
        f"dsh_guard of plugin 'sloppy' failed: TypeError: returned {type(verdict).__name__}, "
        "expected a denial reason (str) or None"
    )


async def test_a_registry_guard_returning_no_reason_and_not_none_denies_naming_the_guard() -> None:
    stack = Stack()
    echo = tool("echo")
    stack.registry.register(echo)

    def tenant_guard(execution: ToolExecution) -> bool:
        return False  # meant "not denied"

    stack.registry.guard(tenant_guard)  # type: ignore[arg-type]
    result = await stack.call("echo")
    assert result.code == "DENIED" and body_calls(echo) == []
    assert result.error is not None and result.error.message.startswith("guard ")
    assert result.error.message.endswith(
        ".tenant_guard failed: TypeError: returned bool, expected a denial reason (str) or None"
    )


@pytest.mark.parametrize("blank", ["", "   ", "\n"])
async def test_a_guard_denying_with_a_blank_reason_still_denies_and_says_whose_it_was(blank: str) -> None:
    stack = Stack()
    echo = tool("echo")
    stack.registry.register(echo)

    class Terse:
        @hookimpl
        def dsh_guard(self, execution: ToolExecution) -> Any:
            return blank

    register(stack.hooks, Terse(), name="terse")
    result = await stack.call("echo")
    assert result.code == "DENIED" and body_calls(echo) == []
    assert result.error is not None
    assert result.error.message == "dsh_guard of plugin 'terse' denied tool \"echo\" (it gave no reason)"

    other = Stack()
    other.registry.register(tool("echo"))

    def quiet_guard(execution: ToolExecution) -> str:
        return blank

    other.registry.guard(quiet_guard)
    result = await other.call("echo")
    assert result.code == "DENIED" and result.error is not None
    assert result.error.message.startswith("guard ") and result.error.message.endswith(
        '.quiet_guard denied tool "echo" (it gave no reason)'
    )
