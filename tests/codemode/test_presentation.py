"""Presentation (issue 4 items 1-2) and CODEMODE-TEST-PRESENTATION: wire, prompt sections, per-agent modes."""

from __future__ import annotations

from typing import Any

import pytest
from codemode_kit import Env, FakeCodeRuntime, tool

from dsh_core import PromptSection, hookimpl
from dsh_core.abort import AbortSignal
from dsh_core.codemode.prompt import CODE_ONLY_SECTION, SDK_SECTION, CodeModeUnavailableError, code_mode_sections
from dsh_core.errors import ErrorCode, RegistrationError
from dsh_core.model import ToolExecutionInput
from dsh_core.prompt import PromptAssembler
from dsh_core.registry import ToolRegistry
from dsh_core.scope import Scope
from dsh_plugins.code_mode import CodeModePromptFilter
from dsh_plugins.code_mode import plugin as code_mode_plugin


class Guidance:
    """A plugin contributing per-tool guidance and a general section."""

    @hookimpl
    def dsh_prompt_sections(self, context: Any) -> Any:
        return [
            PromptSection("tool:read", "Call read to read files.", 110),
            PromptSection("persona", "You are careful.", 10),
        ]


def assembler(env: Env) -> PromptAssembler:
    return PromptAssembler(env.hooks, env.registry, core=code_mode_sections(env.registry, lambda: env.code_runtime))


def names(env: Env, agent: Scope | None = None) -> list[str]:
    return [s.name for s in assembler(env).sections(agent if agent is not None else env.agent)]


def setup(mode: str, **kwargs: Any) -> Env:
    env = Env(mode=mode, **kwargs)
    env.add(tool("read"), tool("write"))
    env.plug(Guidance())
    return env


def test_native_sends_every_schema_no_run_code_no_sdk_and_needs_no_runtime() -> None:
    env = setup("native", code_runtime=None)
    assert [s.name for s in env.registry.wire_schemas(env.agent)] == ["read", "write"]
    assert names(env) == ["persona", "tool:read"]


def test_code_sends_only_run_code_and_the_sdk_declares_the_other_tools() -> None:
    env = setup("code")
    assert [s.name for s in env.registry.wire_schemas(env.agent)] == ["run_code"]
    sections = {s.name: s for s in assembler(env).sections(env.agent)}
    sdk = sections[SDK_SECTION].text
    assert "async def read(self, args: dict[str, Any]) -> Any:" in sdk and "async def write(" in sdk
    assert "run_code(" not in sdk and "RunCode" not in sdk
    assert sections[SDK_SECTION].order == 150


def test_code_renders_the_code_only_rule_before_the_per_tool_guidance() -> None:
    env = setup("code")
    ordered = names(env)
    assert ordered == ["persona", CODE_ONLY_SECTION, "tool:read", SDK_SECTION]
    rule = next(s for s in assembler(env).sections(env.agent) if s.name == CODE_ONLY_SECTION)
    assert rule.order == 99 and "only tool you can call directly" in rule.text


def test_the_code_mode_plugin_removes_tool_guidance_under_code_and_keeps_the_sdk() -> None:
    env = setup("code")
    env.plug(code_mode_plugin(Scope("plugin"), {}))
    assert names(env) == ["persona", CODE_ONLY_SECTION, SDK_SECTION]


@pytest.mark.parametrize("mode", ["native", "both"])
def test_the_code_mode_plugin_keeps_tool_guidance_outside_code(mode: str) -> None:
    env = setup(mode)
    env.plug(CodeModePromptFilter())
    assert "tool:read" in names(env)


def test_both_omits_the_rule_and_sends_all_schemas_plus_run_code_plus_the_sdk() -> None:
    env = setup("both")
    assert [s.name for s in env.registry.wire_schemas(env.agent)] == ["read", "run_code", "write"]
    assert names(env) == ["persona", "tool:read", SDK_SECTION]
    sdk = next(s for s in assembler(env).sections(env.agent) if s.name == SDK_SECTION).text
    assert "async def read(" in sdk and "run_code" not in sdk.split("```python")[1]


def test_the_sdk_text_is_byte_identical_across_assemblies() -> None:
    env = setup("code")
    first = assembler(env).assemble(env.agent)
    assert assembler(env).assemble(env.agent) == first
    # Registration order does not matter either.
    other = Env(mode="code")
    other.add(tool("write"), tool("read"))
    other.plug(Guidance())
    assert assembler(other).assemble(other.agent) == first


def test_the_sdk_is_rerendered_from_the_live_visible_set() -> None:
    env = setup("code")
    before = assembler(env).assemble(env.agent)
    env.add(tool("search"))
    after = assembler(env).assemble(env.agent)
    assert "async def search(" not in before and "async def search(" in after


@pytest.mark.parametrize("mode", ["code", "both"])
def test_a_non_native_mode_without_a_runtime_fails_every_assembly(mode: str) -> None:
    env = setup(mode, code_runtime=None)
    for _ in range(2):
        with pytest.raises(CodeModeUnavailableError, match=f'mode "{mode}" of agent .* requires a code runtime'):
            assembler(env).assemble(env.agent)


@pytest.mark.parametrize("mode", ["code", "both"])
def test_an_unknown_language_fails_every_assembly(mode: str) -> None:
    env = setup(mode, code_runtime=FakeCodeRuntime("cobol"))
    for _ in range(2):
        with pytest.raises(CodeModeUnavailableError, match='no SDK renderer for code runtime language "cobol"'):
            assembler(env).sections(env.agent)


@pytest.mark.parametrize("mode", ["code", "both"])
@pytest.mark.parametrize(("language", "marker"), [("python", "```python"), ("typescript", "```ts")])
def test_the_runtime_language_selects_the_sdk_renderer(mode: str, language: str, marker: str) -> None:
    env = setup(mode, code_runtime=FakeCodeRuntime(language))
    sdk = next(s for s in assembler(env).sections(env.agent) if s.name == SDK_SECTION).text
    assert marker in sdk


def test_a_scope_can_shadow_the_default_sdk_section_and_filters_are_authoritative() -> None:
    env = setup("code")

    class Shadow:
        @hookimpl
        def dsh_prompt_sections(self, context: Any) -> Any:
            return PromptSection(SDK_SECTION, "custom SDK", 150)

    env.plug(Shadow())
    sections = {s.name: s.text for s in assembler(env).sections(env.agent)}
    assert sections[SDK_SECTION] == "custom SDK"

    class DropAll:
        @hookimpl
        def dsh_prompt_filter(self, context: Any, sections: Any) -> Any:
            return [s for s in sections if s.name != SDK_SECTION]

    env.plug(DropAll())
    assert SDK_SECTION not in names(env)


def test_deep_output_schemas_project_into_the_sdk() -> None:
    env = Env(mode="code")
    schema: Any = {"type": "string"}
    for _ in range(60):  # as deep as define_tool's own schema check allows comfortably
        schema = {"type": "object", "properties": {"child": schema}, "required": ["child"]}
    env.add(tool("deep", output=schema))
    sdk = next(s for s in assembler(env).sections(env.agent) if s.name == SDK_SECTION).text
    assert "DeepOutputChildChild" in sdk and "async def deep(" in sdk


# -- the collapse at the executor ------------------------------------------------------------------------


async def test_a_model_direct_native_call_under_code_is_unknown_tool_with_the_rerouting_message() -> None:
    env = setup("code")
    result = await env.direct("read", {})
    assert result.code == ErrorCode.UNKNOWN_TOOL
    assert result.error is not None and result.error.message == (
        'unknown tool "read": only `run_code` is callable directly — call `read` from inside a `run_code` '
        "program instead"
    )


async def test_a_pre_aborted_collapsed_call_is_aborted_before_dispatch() -> None:
    env = setup("code")
    result = await env.direct("read", {}, signal=AbortSignal.aborted_with("stop"))
    assert result.code == ErrorCode.ABORTED_BEFORE_DISPATCH


# -- per-agent presentation --------------------------------------------------------------------------------


def test_one_agent_can_be_code_while_the_deployment_stays_native() -> None:
    env = setup("native")
    coder = env.root.child("agent:coder", layered=True)
    env.registry.present_as("code", coder)
    assert [s.name for s in env.registry.wire_schemas(coder)] == ["run_code"]
    assert [s.name for s in env.registry.wire_schemas(env.agent)] == ["read", "write"]
    assert SDK_SECTION in names(env, coder) and SDK_SECTION not in names(env, env.agent)
    assert env.registry.get("run_code", env.agent) is None  # a native agent has no run_code to dispatch


async def test_a_native_agent_cannot_call_run_code() -> None:
    env = setup("native")
    result = await env.run("print(1)")
    assert result.code == ErrorCode.UNKNOWN_TOOL


def test_a_preset_mode_is_inherited_down_the_chain_and_siblings_are_unaffected() -> None:
    env = setup("native")
    preset = env.root.child("preset:coding", layered=True)
    env.registry.present_as("code", preset)
    child = preset.child("agent:a", layered=True)
    sibling = env.root.child("agent:b", layered=True)
    assert env.registry.mode_for(child) == "code" and env.registry.mode_for(sibling) == "native"


async def test_an_agent_can_opt_out_of_a_code_deployment_and_the_default_returns_on_unload() -> None:
    env = setup("code")
    native = env.root.child("agent:plain", layered=True)
    env.registry.present_as("native", native)
    assert [s.name for s in env.registry.wire_schemas(native)] == ["read", "write"]
    assert names(env, native) == ["persona", "tool:read"]
    coder = env.root.child("agent:coder", layered=True)
    env.registry.present_as("both", coder)
    assert env.registry.mode_for(coder) == "both"
    await coder.dispose()
    assert env.registry.mode_for(coder) == "code"


async def test_disposing_the_declaring_scope_removes_run_code_and_the_sdk_section() -> None:
    env = setup("native")
    coder = env.root.child("agent:coder", layered=True)
    env.registry.present_as("code", coder)
    assert SDK_SECTION in names(env, coder) and env.registry.get("run_code", coder) is not None
    await coder.dispose()
    assert SDK_SECTION not in names(env, coder) and env.registry.get("run_code", coder) is None


def test_a_second_or_unscoped_declaration_is_refused() -> None:
    env = setup("native")
    agent = env.root.child("agent:x", layered=True)
    env.registry.present_as("code", agent)
    with pytest.raises(RegistrationError, match="conflicts"):
        env.registry.present_as("both", agent)
    with pytest.raises(RegistrationError, match="scoped"):
        env.registry.present_as("code", Scope("loose"))


def test_run_code_is_reserved_and_outside_restrictions() -> None:
    env = setup("code")
    with pytest.raises(RegistrationError, match="reserved"):
        env.registry.register(tool("run_code"))
    agent = env.root.child("agent:y", layered=True)
    with pytest.raises(RegistrationError, match="reserved"):
        env.registry.register(tool("run_code"), scope=agent)
    with pytest.raises(RegistrationError, match="not a restriction target"):
        env.registry.restrict(agent, deny=["run_code"])
    env.registry.restrict(agent, allow=["read"])
    assert [s.name for s in env.registry.wire_schemas(agent)] == ["run_code"]
    assert env.registry.names(agent) == ["read", "run_code"]
    assert [d.name for d in env.registry.definitions(agent)] == ["read"]


async def test_the_missing_runtime_error_names_the_agents_own_mode() -> None:
    env = setup("native", code_runtime=None)
    coder = env.root.child("agent:coder", layered=True)
    env.registry.present_as("both", coder)
    with pytest.raises(CodeModeUnavailableError, match="mode \"both\" of agent 'root/agent:coder'"):
        assembler(env).assemble(coder)
    result = await env.run("print(1)", agent=coder)
    assert result.error is not None and 'mode "both" requires a code runtime' in result.error.message


def test_direct_construction_defaults() -> None:
    assert ToolRegistry().default_mode == "native"


async def test_execution_mode_is_parallel_only_for_an_exact_true() -> None:
    env = Env(mode="native")

    def boom(args: Any) -> Any:
        raise RuntimeError("classifier broke")

    classifiers: dict[str, Any] = {
        "yes": lambda a: True,
        "no": lambda a: False,
        "truthy": lambda a: 1,
        "none": None,
        "throws": boom,
    }
    for name, classifier in classifiers.items():
        env.add(tool(name, safe=classifier))

    def mode(name: str) -> str:
        return env.runtime.execution_mode(ToolExecutionInput(call_id="c", name=name, arguments={}, agent=env.agent))

    assert mode("yes") == "parallel"
    assert [mode(n) for n in ("no", "truthy", "none", "throws", "missing")] == ["exclusive"] * 5
    assert "is_concurrency_safe" not in str([s.to_json() for s in env.registry.schemas(env.agent)])
