"""The hook facade: validation at registration, scope filtering, containment."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import attrs
import pytest

from dsh_core import hookimpl
from dsh_core.errors import PluginLoadError
from dsh_core.hooks import Hooks
from dsh_core.model import ApprovalOutcome, PreDecision, ToolExecution

from .helpers import Recorder, Stack, body_calls, register, tool

pytestmark = pytest.mark.anyio


def test_every_hookspec_has_a_docstring_contract() -> None:
    hooks = Hooks()
    for name in hooks.hook_names():
        spec = getattr(hooks.plugin_manager.hook, name).spec
        assert spec is not None and (spec.function.__doc__ or "").strip(), name


def test_wrappers_and_unknown_hooks_are_refused_and_nothing_stays_registered() -> None:
    hooks = Hooks()

    class Wrapper:
        @hookimpl(wrapper=True)
        def dsh_pre_execute(self, execution: ToolExecution) -> Generator[None, Any, Any]:
            return (yield)

    class Typo:
        @hookimpl
        def dsh_pre_exceute(self, execution: ToolExecution) -> None:
            return None

    with pytest.raises(PluginLoadError, match="wrappers are not supported"):
        hooks.register(Wrapper(), name="wrapper")
    with pytest.raises(PluginLoadError, match="unknown hook 'dsh_pre_exceute' \\(did you mean 'dsh_pre_execute'"):
        hooks.register(Typo(), name="typo")
    assert not hooks.has_plugin("wrapper") and not hooks.has_plugin("typo")
    assert hooks.impls("dsh_pre_execute") == ()


def test_a_pluggy_that_validates_after_registering_leaves_nothing_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    """pluggy before 1.7 (``pluggy>=1.5`` is allowed) registered a plugin's earlier hook implementations,
    and took its name, before it raised ``PluginValidationError`` for a later one."""
    import pluggy

    hooks = Hooks()
    manager = hooks.plugin_manager
    register_whole = manager.register

    def register_then_fail(plugin: object, name: str | None = None) -> str | None:
        register_whole(plugin, name=name)  # as pluggy 1.5 did: registered first ...
        raise pluggy.PluginValidationError(plugin, "a later hookimpl is invalid")  # ... then refused

    monkeypatch.setattr(manager, "register", register_then_fail)

    class Half:
        @hookimpl
        def dsh_pre_execute(self, execution: ToolExecution) -> None:
            return None

    with pytest.raises(PluginLoadError, match="a later hookimpl is invalid"):
        hooks.register(Half(), name="half")
    assert not hooks.has_plugin("half") and hooks.impls("dsh_pre_execute") == ()
    monkeypatch.undo()
    hooks.register(Half(), name="half")  # the name is free again
    assert len(hooks.impls("dsh_pre_execute")) == 1


def test_a_rejected_misspelling_is_never_listed_as_a_known_hook() -> None:
    hooks = Hooks()
    specs = hooks.hook_names()

    class Typo:
        @hookimpl
        def dsh_pre_exceute(self, execution: ToolExecution) -> None:
            return None

    class Nonsense:
        @hookimpl
        def dsh_zzz(self) -> None:
            return None

    with pytest.raises(PluginLoadError):
        hooks.register(Typo(), name="typo")
    assert hooks.hook_names() == specs
    with pytest.raises(PluginLoadError) as raised:
        hooks.register(Nonsense(), name="nonsense")
    assert "dsh_pre_exceute" not in str(raised.value)
    assert "did you mean" not in str(raised.value)  # nothing close: no guess


def test_a_duplicate_plugin_name_is_refused() -> None:
    hooks = Hooks()
    hooks.register(Recorder(), name="same")
    with pytest.raises(PluginLoadError, match="already registered"):
        hooks.register(Recorder(), name="same")


def test_one_object_under_two_names_is_refused_naming_both() -> None:
    """pluggy's bare ValueError reached direct callers; the loader had to ask the plugin manager itself."""
    hooks = Hooks()
    shared = Recorder()
    hooks.register(shared, name="first")
    with pytest.raises(
        PluginLoadError,
        match=r"cannot register plugin 'second': the object is already "
        r"registered as plugin 'first'",
    ) as caught:
        hooks.register(shared, name="second")
    from dsh_core.hooks import PluginObjectInUse

    assert isinstance(caught.value, PluginObjectInUse)
    assert (caught.value.name, caught.value.other) == ("second", "first")
    assert hooks.has_plugin("first") and not hooks.has_plugin("second")
    assert [impl.plugin for impl in hooks.impls("dsh_pre_execute")] == ["first"]


def test_an_equal_but_distinct_object_is_refused_saying_why() -> None:
    # pluggy tells plugins apart with ==: a value-type plugin built afresh per row still collides.
    @attrs.frozen
    class Audit:
        level: str

        @hookimpl
        def dsh_tool_result(self, execution: Any, result: Any) -> None:
            return None

    from dsh_core.hooks import PluginObjectInUse

    hooks = Hooks()
    hooks.register(Audit("info"), name="audit-a")
    with pytest.raises(
        PluginObjectInUse,
        match=r"an equal object is already registered as plugin 'audit-a' "
        r"\(pluggy compares plugin objects with ==",
    ) as caught:
        hooks.register(Audit("info"), name="audit-b")
    assert caught.value.equal and not hooks.has_plugin("audit-b")


def test_arguments_not_in_the_spec_are_refused() -> None:
    hooks = Hooks()

    class Extra:
        @hookimpl
        def dsh_guard(self, execution: ToolExecution, surprise: int) -> None:
            return None

    with pytest.raises(PluginLoadError, match="surprise"):
        hooks.register(Extra(), name="extra")


async def test_agent_scoped_implementations_see_only_their_agents_calls() -> None:
    stack = Stack()
    stack.registry.register(tool("echo"))
    mine, other = stack.agent("mine"), stack.agent("other")
    scoped = Recorder(pre=PreDecision.deny("only for mine"))
    register(stack.hooks, scoped, scope=mine.child("plugin:policy"))
    assert (await stack.call("echo", agent=mine)).code == "DENIED"
    assert not (await stack.call("echo", agent=other)).is_error
    assert not (await stack.call("echo")).is_error
    await mine.dispose()
    assert not stack.hooks.has_plugin("plugin-policy")
    assert all(info.plugin != "policy" for info in stack.hooks.impls("dsh_pre_execute"))


async def test_disposing_the_owning_scope_unregisters_the_plugin() -> None:
    stack = Stack()
    stack.registry.register(tool("echo"))
    scope = stack.root.child("plugin:deny")
    stack.hooks.register(Recorder(pre=PreDecision.deny("no")), name="deny", scope=scope)
    assert (await stack.call("echo")).code == "DENIED"
    await scope.dispose()
    assert not stack.hooks.has_plugin("deny")
    assert not (await stack.call("echo")).is_error


async def test_registering_in_a_disposed_or_disposing_scope_is_refused_and_leaves_nothing() -> None:
    stack = Stack()
    stack.registry.register(tool("echo"))
    scope = stack.root.child("plugin:late")
    refused: list[str] = []

    def register_while_disposing() -> None:
        with pytest.raises(PluginLoadError) as raised:
            stack.hooks.register(Recorder(pre=PreDecision.deny("no")), name="during", scope=scope)
        refused.append(str(raised.value))

    scope.on_dispose(register_while_disposing)
    await scope.dispose()
    with pytest.raises(PluginLoadError, match=r"'late'.*'root/plugin:late' is disposed"):
        stack.hooks.register(Recorder(pre=PreDecision.deny("no")), name="late", scope=scope)
    assert len(refused) == 1 and "'during'" in refused[0] and "being disposed" in refused[0]
    assert not stack.hooks.has_plugin("late") and not stack.hooks.has_plugin("during")
    assert not (await stack.call("echo")).is_error  # no leftover implementation denies the call


async def test_async_hook_implementations_are_awaited() -> None:
    stack = Stack()
    stack.registry.register(tool("echo"))

    class AsyncPolicy:
        @hookimpl
        async def dsh_pre_execute(self, execution: ToolExecution) -> PreDecision:
            return PreDecision.deny("async deny")

    register(stack.hooks, AsyncPolicy())
    result = await stack.call("echo")
    assert result.error is not None and result.error.message == "async deny"


async def test_an_async_def_approval_channel_may_abstain_and_the_next_one_answers() -> None:
    stack = Stack()
    echo = tool("echo")
    stack.registry.register(echo)

    class Allow:
        @hookimpl
        def dsh_approve(self, request: Any) -> ApprovalOutcome:
            return ApprovalOutcome.ALLOWED

    class AsyncAbstain:
        @hookimpl
        async def dsh_approve(self, request: Any) -> None:
            return None

    register(stack.hooks, Allow())
    register(stack.hooks, AsyncAbstain())  # registered last: asked first
    register(stack.hooks, Recorder(pre=PreDecision.ask("check")))
    result = await stack.call("echo")
    assert not result.is_error and len(body_calls(echo)) == 1


async def test_pre_execute_stops_at_the_first_deny() -> None:
    stack = Stack()
    stack.registry.register(tool("echo"))
    later = register(stack.hooks, Recorder())  # registered first: called last
    register(stack.hooks, Recorder(pre=PreDecision.deny("no")))
    assert (await stack.call("echo")).code == "DENIED"
    assert "pre" not in later.stages()  # an auditor that must see every call uses dsh_tool_result
    assert later.stages() == ["result"]


def test_sees_any_follows_scope_filtering_and_registration() -> None:
    stack = Stack()
    mine, other = stack.agent("mine"), stack.agent("other")

    class Log:
        @hookimpl
        def dsh_code_dispatch_log(self, dispatch: Any) -> Any:
            return None

    assert not stack.hooks.sees_any("dsh_code_dispatch_log", mine)
    unregister = stack.hooks.register(Log(), name="log", scope=mine.child("plugin:log"))
    assert stack.hooks.sees_any("dsh_code_dispatch_log", mine)
    assert not stack.hooks.sees_any("dsh_code_dispatch_log", other)
    assert not stack.hooks.sees_any("dsh_code_dispatch_log", None)
    unregister()
    stack.hooks.register(Log(), name="global-log")
    assert stack.hooks.sees_any("dsh_code_dispatch_log", other)
    assert stack.hooks.sees_any("dsh_code_dispatch_log", None)


@pytest.mark.parametrize("hook", ["dsh_register_tools", "dsh_around_dispatch", "dsh_prompt_sections"])
def test_async_def_on_a_hook_dsh_never_awaits_is_refused_at_registration(hook: str) -> None:
    hooks = Hooks()
    arguments = {
        "dsh_register_tools": "register",
        "dsh_around_dispatch": "execution",
        "dsh_prompt_sections": "context",
    }[hook]
    namespace: dict[str, Any] = {}
    exec(f"async def {hook}(self, {arguments}):\n    return None", namespace)
    plugin_class = type("AsyncPlugin", (), {hook: hookimpl(namespace[hook])})
    with pytest.raises(PluginLoadError, match=f"plugin 'late': {hook} is async def, but dsh calls it synchronously"):
        hooks.register(plugin_class(), name="late")
    assert not hooks.has_plugin("late")


def test_a_hookimpl_with_a_default_for_a_hook_argument_is_refused_at_registration() -> None:
    # pluggy never passes an argument that has a default: ``register`` would always be None.
    received: list[object] = []

    class Defaulted:
        @hookimpl
        def dsh_register_tools(self, register: Any = None) -> None:
            received.append(register)

    hooks = Hooks()
    with pytest.raises(
        PluginLoadError,
        match="plugin 'defaulted': dsh_register_tools declares a default for "
        "register; pluggy never passes an argument that has a default",
    ):
        hooks.register(Defaulted(), name="defaulted")
    assert not hooks.has_plugin("defaulted") and not received

    class Helper:  # a default on a name the hook does not pass is the plugin's own business
        @hookimpl
        def dsh_register_tools(self, register: Any, _seen: Any = None) -> None:
            received.append(register)

    hooks.register(Helper(), name="helper")
    assert hooks.has_plugin("helper")


async def test_a_stale_unregister_function_leaves_a_later_plugin_of_the_same_name_alone() -> None:
    stack = Stack()
    echo = tool("echo")
    stack.registry.register(echo)
    first = stack.root.child("plugin:guards")
    stale = stack.hooks.register(Recorder(guard="no"), name="guards", scope=first)
    await first.dispose()  # the first instance stopped ...
    again = stack.root.child("plugin:guards")
    stack.hooks.register(Recorder(guard="still no"), name="guards", scope=again)  # ... and started again
    stale()  # the first instance's unregister, kept and called late
    assert stack.hooks.has_plugin("guards")
    assert [info.plugin for info in stack.hooks.impls("dsh_guard")] == ["guards"]
    result = await stack.call("echo")
    assert result.code == "DENIED" and result.error is not None and result.error.message == "still no"
    assert body_calls(echo) == []
    await again.dispose()  # the new instance's own unregister still works
    assert not stack.hooks.has_plugin("guards")
