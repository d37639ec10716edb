"""Layers, restrictions, modes and the wire views of the registry."""

from __future__ import annotations

from typing import Any

import pytest

from dsh_core import hookimpl
from dsh_core.errors import ErrorCode, RegistrationError, SchemaDefinitionError
from dsh_core.registry import ToolRegistry

from .helpers import Stack, register, tool

pytestmark = pytest.mark.anyio


def test_wire_schemas_apply_the_mode() -> None:
    for mode, wire in [("native", ["a", "b"]), ("code", ["run_code"]), ("both", ["a", "b", "run_code"])]:
        stack = Stack(mode=mode)
        stack.registry.register(tool("b"))
        stack.registry.register(tool("a"))
        assert [s.name for s in stack.registry.wire_schemas()] == wire, mode
        # get() and schemas() are not collapsed: presentation and inspection see the full set
        assert stack.registry.get("a") is not None
        assert "a" in [s.name for s in stack.registry.schemas()]
        assert [d.name for d in stack.registry.definitions()] == ["a", "b"]


async def test_the_nearest_scope_wins_and_disposal_removes_its_tools() -> None:
    stack = Stack()
    global_echo = tool("echo")
    stack.registry.register(global_echo)
    agent = stack.agent()
    plugin_scope = agent.child("plugin:mine")
    agent_echo = tool("echo")
    stack.registry.register(agent_echo, scope=plugin_scope)
    assert stack.registry.get("echo", agent) is agent_echo
    assert stack.registry.get("echo") is global_echo
    await plugin_scope.dispose()
    assert stack.registry.get("echo", agent) is global_echo


def test_duplicates_in_one_layer_are_refused() -> None:
    stack = Stack()
    stack.registry.register(tool("echo"))
    with pytest.raises(RegistrationError, match="already registered globally"):
        stack.registry.register(tool("echo"))
    agent = stack.agent()
    stack.registry.register(tool("mine"), scope=agent)
    with pytest.raises(RegistrationError, match="already registered in this scope"):
        stack.registry.register(tool("mine"), scope=agent)


def test_invalid_names_and_foreign_objects_are_refused() -> None:
    registry = ToolRegistry()
    with pytest.raises(RegistrationError, match="invalid tool name"):
        registry.register(tool("has space"))
    for name in ("read\n", "\nread", "x" * 65):
        with pytest.raises(RegistrationError, match="invalid tool name"):
            registry.register(tool(name))
    assert registry.names() == []
    with pytest.raises(RegistrationError, match="define_tool"):
        registry.register(object())  # type: ignore[arg-type]


def test_define_tool_checks_schemas_and_names_the_tool_and_path() -> None:
    from dsh_core import define_tool

    async def body(args: object, ctx: object) -> None:
        return None

    with pytest.raises(SchemaDefinitionError, match=r'tool "bad" parameters: invalid JSON Schema at /properties/x'):
        define_tool(
            name="bad",
            description="d",
            execute=body,
            parameters={"type": "object", "properties": {"x": {"type": "integr"}}},
        )
    with pytest.raises(SchemaDefinitionError, match='tool "bad" output schema'):
        define_tool(name="bad", description="d", execute=body, parameters={"type": "object"}, output_schema={"type": 5})
    with pytest.raises(SchemaDefinitionError, match='root schema must have "type": "object"'):
        define_tool(name="bad", description="d", execute=body, parameters={"type": "string"})
    with pytest.raises(SchemaDefinitionError, match=r"examples\[0\] does not match"):
        define_tool(
            name="bad",
            description="d",
            execute=body,
            examples=[{"x": 1}],
            parameters={"type": "object", "properties": {"x": {"type": "string"}}},
        )


def test_define_tool_refuses_an_async_generator_execute_naming_the_tool() -> None:
    # An async def with a yield in it is an async generator function: its call returns no awaitable,
    # so every call of the tool would fail. Refused when defined, as an async render is.
    from dsh_core import define_tool

    async def streams(args: object, ctx: object) -> Any:
        yield {"part": 1}

    with pytest.raises(
        SchemaDefinitionError,
        match=r'^tool "chunks": execute is an async generator function \(it '
        r"yields\); a tool's execute returns one value: return it",
    ):
        define_tool(name="chunks", description="d", execute=streams, parameters={"type": "object"})


def test_every_schema_reference_must_resolve_inside_the_schema() -> None:
    """An unresolvable or remote $ref used to pass the metaschema check and then crash every call."""
    from dsh_core import define_tool
    from dsh_core.schema import check_schema, compile_validator, violations

    async def body(args: object, ctx: object) -> None:
        return None

    def params(**properties: object) -> dict[str, object]:
        return {"type": "object", "properties": properties}

    with pytest.raises(
        SchemaDefinitionError,
        match=r'tool "bad" parameters: unresolvable \$ref '
        r"'#/\$defs/missing' at /properties/a/\$ref: ",
    ):
        define_tool(name="bad", description="d", execute=body, parameters=params(a={"$ref": "#/$defs/missing"}))
    with pytest.raises(
        SchemaDefinitionError,
        match=r"output schema: unresolvable \$ref .* at /prefixItems/1/\$ref"
        r".*remote schemas are never retrieved",
    ):
        define_tool(
            name="bad",
            description="d",
            execute=body,
            parameters=params(),
            output_schema={"prefixItems": [{"type": "string"}, {"$ref": "https://example.com/x.json"}]},
        )
    with pytest.raises(SchemaDefinitionError, match=r"unresolvable \$dynamicRef '#nowhere' at /\$defs/d/\$dynamicRef"):
        check_schema({"$defs": {"d": {"$dynamicRef": "#nowhere"}}}, owner="x")
    # References that resolve within the schema (pointers, anchors, embedded $id resources) pass.
    for good in [
        {**params(a={"$ref": "#/$defs/s"}), "$defs": {"s": {"type": "string"}}},
        {**params(a={"$ref": "#name"}, b={"$anchor": "name", "type": "string"})},
        {
            **params(
                a={"$id": "https://x.test/sub", "$ref": "#/$defs/q", "$defs": {"q": {"type": "string"}}},
                b={"$ref": "https://x.test/sub#/$defs/q"},
            ),
            "$id": "https://x.test/root",
        },
        {"$dynamicAnchor": "node", "type": "object", "properties": {"kids": {"items": {"$dynamicRef": "#node"}}}},
        {**params(tree={"$ref": "#"})},
    ]:
        check_schema(good, owner="good")
    # A validator built without check_schema still gives violations, never a referencing exception.
    found = violations(compile_validator(params(a={"$ref": "#/$defs/missing"})), {"a": 1})
    assert len(found) == 1 and "unresolvable reference" in found[0].message


def test_a_reference_to_a_bundled_metaschema_is_accepted_and_validates_offline() -> None:
    """The reference check used an empty registry and refused the 2020-12 metaschema the validator resolves."""
    from dsh_core import define_tool
    from dsh_core.schema import check_schema, compile_validator, violations

    async def body(args: object, ctx: object) -> None:
        return None

    parameters = {"type": "object", "properties": {"schema": {"$ref": "https://json-schema.org/draft/2020-12/schema"}}}
    check_schema(parameters, owner="x")
    check_schema({"$ref": "https://json-schema.org/draft/2020-12/meta/validation"}, owner="x")
    definition = define_tool(name="define_schema", description="d", execute=body, parameters=parameters)
    assert definition.name == "define_schema"
    validator = compile_validator(parameters)
    assert violations(validator, {"schema": {"type": "string"}}) == []
    assert [v.path for v in violations(validator, {"schema": {"type": 12}})] == ["/schema/type"]
    # Anything else remote is still refused (never fetched), as is a missing pointer into a metaschema.
    with pytest.raises(
        SchemaDefinitionError,
        match=r"unresolvable \$ref 'https://json-schema.org/draft/2020-12/"
        r"nothing' .*remote schemas are never retrieved",
    ):
        check_schema({"$ref": "https://json-schema.org/draft/2020-12/nothing"}, owner="x")
    with pytest.raises(SchemaDefinitionError, match=r"'/\$defs/nope' does not exist"):
        check_schema({"$ref": "https://json-schema.org/draft/2020-12/schema#/$defs/nope"}, owner="x")


async def test_restrictions_filter_inherited_tools_intersect_and_exempt_own_tools() -> None:
    stack = Stack()
    for name in ("read", "write", "bash"):
        stack.registry.register(tool(name))
    preset = stack.root.child("preset:safe", layered=True)
    stack.registry.restrict(preset, deny=["bash"])
    agent = stack.agent("a", parent=preset)
    stack.registry.restrict(agent, allow=["read", "bash"])
    stack.registry.register(tool("own"), scope=agent)
    assert [d.name for d in stack.registry.definitions(agent)] == ["own", "read"]
    assert stack.registry.get("bash", agent) is None
    assert (await stack.call("bash", agent=agent)).code == "UNKNOWN_TOOL"
    await agent.dispose()
    assert [d.name for d in stack.registry.definitions(preset)] == ["read", "write"]


async def test_a_layers_own_tools_stay_exempt_from_its_restrictions_in_its_descendants() -> None:
    # What `dsh run-code` lends a native agent: a layered child scope. It must see what the
    # agent sees; the agent's allow list filters what the agent inherits, not the agent's own tools.
    stack = Stack()
    for name in ("read", "bash"):
        stack.registry.register(tool(name))
    agent = stack.agent("a")
    stack.registry.register(tool("agent_notes"), scope=agent)
    stack.registry.restrict(agent, allow=["read"])
    child = agent.child("cli:run-code", layered=True)
    stack.registry.present_as("both", child)
    grandchild = child.child("run")  # not layered: sees what its layered owner sees
    for scope in (agent, child, grandchild):
        assert [d.name for d in stack.registry.definitions(scope)] == ["agent_notes", "read"]
        assert stack.registry.get("agent_notes", scope) is not None
        assert stack.registry.get("bash", scope) is None
    assert (await stack.call("agent_notes", agent=child)).code is None
    assert (await stack.call("bash", agent=child)).code == "UNKNOWN_TOOL"
    # A restriction of the child still filters what the child inherits, the agent's tools included.
    stack.registry.restrict(child, deny=["agent_notes"])
    assert [d.name for d in stack.registry.definitions(child)] == ["read"]
    assert stack.registry.get("agent_notes", child) is None
    await child.dispose()
    await agent.dispose()


def test_restriction_misuse_is_refused_with_the_known_names() -> None:
    stack = Stack()
    stack.registry.register(tool("read"))
    agent = stack.agent()
    with pytest.raises(RegistrationError, match="requires a scoped context"):
        stack.registry.restrict(stack.root, deny=["read"])
    with pytest.raises(RegistrationError, match="no-op"):
        stack.registry.restrict(agent)
    with pytest.raises(RegistrationError, match=r"does not inherit: nope \(known: read\)"):
        stack.registry.restrict(agent, allow=["nope"])


def test_views_are_cached_and_invalidated_on_change() -> None:
    stack = Stack()
    stack.registry.register(tool("a"))
    first = stack.registry.wire_schemas()
    assert stack.registry.wire_schemas() == first
    stack.registry.register(tool("b"))
    assert [s.name for s in stack.registry.wire_schemas()] == ["a", "b"]
    changes: list[int] = []
    stop = stack.registry.on_change(lambda: changes.append(1))
    stack.registry.register(tool("c"))
    stop()
    stack.registry.register(tool("d"))
    assert changes == [1]


def test_a_code_mode_without_transport_fails_loudly() -> None:
    registry = ToolRegistry(default_mode="code")
    with pytest.raises(RuntimeError, match="needs the run_code transport"):
        registry.wire_schemas()
    with pytest.raises(ValueError, match="must be one of native, code, both"):
        ToolRegistry(default_mode="turbo")  # type: ignore[arg-type]


async def test_memoized_resolution_follows_every_change() -> None:
    stack = Stack()
    agent = stack.agent()
    registry = stack.registry
    assert registry.get("echo", agent) is None  # a cached miss must not outlive a registration
    unregister = registry.register(tool("echo"))
    echo = registry.get("echo", agent)
    assert echo is not None and registry.get("echo", agent) is echo
    lift = registry.restrict(agent, deny=["echo"])
    assert registry.get("echo", agent) is None and registry.get("echo") is echo
    lift()
    assert registry.get("echo", agent) is echo
    plugin_scope = agent.child("plugin:own")
    own = tool("echo")
    registry.register(own, scope=plugin_scope)
    assert registry.get("echo", agent) is own
    await plugin_scope.dispose()
    assert registry.get("echo", agent) is echo
    unregister()
    assert registry.get("echo", agent) is None
    assert registry.get("run_code", agent) is None  # native: no transport
    registry.present_as("code", agent)
    assert registry.get("run_code", agent) is registry.transport


async def test_nothing_is_left_behind_when_registering_on_a_disposed_scope() -> None:
    """guard/restrict/present_as used to change the layer first and fail in on_dispose() after."""
    stack = Stack()
    stack.registry.register(tool("read"))
    agent = stack.agent("gone")
    await agent.dispose()
    changes: list[int] = []
    stack.registry.on_change(lambda: changes.append(1))

    def deny_all(execution: object) -> str:
        return "no"

    with pytest.raises(RegistrationError, match=r"cannot add a guard: scope '.*gone' is disposed"):
        stack.registry.guard(deny_all, scope=agent)
    assert deny_all not in stack.registry.guards_for(agent)
    with pytest.raises(RegistrationError, match=r"cannot restrict tools: scope '.*gone' is disposed"):
        stack.registry.restrict(agent, deny=["read"])
    assert stack.registry.names(agent) == ["read"]
    with pytest.raises(RegistrationError, match=r"cannot present_as\('code'\): scope '.*gone' is disposed"):
        stack.registry.present_as("code", agent)
    assert stack.registry.mode_for(agent) == "native"
    with pytest.raises(RegistrationError, match=r'cannot register tool "late": scope .* is disposed'):
        stack.registry.register(tool("late"), scope=agent)
    assert stack.registry.names(agent) == ["read"] and changes == []


async def test_changing_the_callers_schema_dicts_after_definition_changes_nothing() -> None:
    """The validators were compiled from the caller's dicts: mutating them changed what the tool accepted,
    while the model was still shown the frozen schema."""
    from dsh_core.errors import ErrorCode

    parameters: dict[str, Any] = {
        "type": "object",
        "required": ["path"],
        "additionalProperties": False,
        "properties": {"path": {"type": "string", "pattern": "^[^/]"}},
    }
    simple: dict[str, Any] = {"type": "object", "properties": {"n": {"type": "integer"}}}  # the fast-check path
    output: dict[str, Any] = {"type": "object", "properties": {"n": {"type": "integer"}}}
    stack = Stack()
    stack.registry.register(
        tool("read", parameters=parameters, output_schema=output, body=lambda args, ctx: {"n": args["path"]})
    )
    stack.registry.register(tool("count", parameters=simple))
    shown = stack.registry.get("read").schema.to_json()["parameters"]  # type: ignore[union-attr]
    parameters["properties"]["path"].pop("pattern")
    parameters["properties"]["content"] = {"type": "string"}
    parameters["additionalProperties"] = True
    output["properties"]["n"] = {"type": "string"}
    simple["properties"]["n"]["type"] = "string"
    assert stack.registry.get("read").schema.to_json()["parameters"] == shown  # type: ignore[union-attr]
    assert "content" not in shown["properties"] and shown["properties"]["path"]["pattern"] == "^[^/]"
    refused = await stack.call("read", {"path": "/etc/shadow", "content": "x"})
    assert refused.code == ErrorCode.INVALID_ARGS
    assert (await stack.call("read", {"path": "/etc/shadow"})).code == ErrorCode.INVALID_ARGS
    assert (await stack.call("count", {"n": "one"})).code == ErrorCode.INVALID_ARGS
    # the output schema too: a string n is still refused
    assert (await stack.call("read", {"path": "etc"})).code == ErrorCode.INVALID_TOOL_OUTPUT


def test_a_schema_too_deep_to_check_is_refused_with_a_schema_error() -> None:
    """jsonschema's metaschema check recurses: a deep schema escaped as a raw RecursionError."""
    from dsh_core.schema import check_schema

    schema: dict[str, object] = {"type": "string"}
    for _ in range(3000):
        schema = {"type": "array", "items": schema}
    with pytest.raises(SchemaDefinitionError, match=r'tool "deep" parameters: .*nests too deeply .*3001 levels'):
        check_schema(schema, owner='tool "deep" parameters')


def test_validation_that_recurses_without_end_gives_a_violation_not_an_exception() -> None:
    """A recursive schema met a deep value (or a $ref cycle any value) with a raw RecursionError at call time."""
    from dsh_core.schema import check_schema, compile_validator, violations

    tree = {"type": "object", "properties": {"c": {"$ref": "#"}}}
    cycle = {"type": "object", "$defs": {"a": {"$ref": "#"}}, "$ref": "#/$defs/a"}
    value: dict[str, object] = {}
    for _ in range(5000):
        value = {"c": value}
    for schema, instance in ((tree, value), (cycle, {})):
        check_schema(schema, owner="x")
        found = violations(compile_validator(schema), instance)
        assert len(found) == 1 and found[0].path == "/" and "cannot be evaluated" in found[0].message
    assert violations(compile_validator(tree), {"c": {"c": {}}}) == []


async def test_a_validator_that_cannot_compute_gives_an_error_result_not_an_exception() -> None:
    """jsonschema's multipleOf divides: a huge int against a float divisor raised a raw OverflowError out of execute."""
    from dsh_core.model import PostDecision

    class Replace:
        @hookimpl
        def dsh_post_execute(self) -> PostDecision:
            return PostDecision.replace_value(10**400)

    stack = Stack()
    stack.registry.register(
        tool(
            "step",
            parameters={"type": "object", "properties": {"n": {"multipleOf": 0.5}}},
            output_schema={"multipleOf": 0.5},
            body=lambda args, ctx: args.get("v", 1),
        )
    )
    refused = await stack.call("step", {"n": 10**400})
    assert refused.code == ErrorCode.INVALID_ARGS and "cannot be evaluated" in refused.text
    assert "OverflowError" in refused.text
    assert (await stack.call("step", {"v": 10**400})).code == ErrorCode.INVALID_TOOL_OUTPUT
    register(stack.hooks, Replace())
    assert (await stack.call("step", {})).code == ErrorCode.INVALID_TOOL_OUTPUT


@pytest.mark.parametrize("action", ["register", "guard"])
async def test_nothing_registered_during_an_agents_disposal_leaves_its_layer_behind(action: str) -> None:
    """A still-active child of a disposing agent created the agent's layer, then failed on the agent's
    on_dispose: the layer stayed in the registry forever, and the error was not a RegistrationError."""
    stack = Stack()
    agent = stack.agent("a")
    older = agent.child("plugin:older")
    newer = agent.child("plugin:newer")  # unwound first: its disposer runs while `older` is still active
    errors: list[BaseException] = []

    def late() -> None:
        try:
            if action == "register":
                stack.registry.register(tool("late"), scope=older)
            else:
                stack.registry.guard(lambda execution: None, scope=older)
        except Exception as error:
            errors.append(error)

    newer.on_dispose(late)
    await agent.dispose()
    assert stack.registry.inventory() == []
    assert len(errors) == 1 and isinstance(errors[0], RegistrationError)
    assert "'root/agent:a' is being disposed" in str(errors[0])


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("render", "json", r'tool "t": render must be a function, got str'),
        ("finalize_content", [], r'tool "t": finalize_content must be a function, got list'),
        ("is_concurrency_safe", "yes", r'tool "t": is_concurrency_safe must be True, False or a function, got str'),
        ("annotations", {"cost": float("nan")}, r'tool "t" annotations: not lossless JSON at /cost'),
    ],
)
def test_define_tool_refuses_a_malformed_option_naming_the_tool(option: str, value: object, message: str) -> None:
    """A non-callable render or finalizer was accepted and failed every later call; lossy annotations
    raised a bare NotLosslessError that named no tool."""
    from dsh_core import define_tool

    async def execute(args: Any, ctx: Any) -> Any:
        return None

    with pytest.raises(SchemaDefinitionError, match=message):
        define_tool(name="t", description="A tool.", parameters={"type": "object"}, execute=execute, **{option: value})  # type: ignore[arg-type]


@pytest.mark.parametrize("option", ["render", "finalize_content", "is_concurrency_safe"])
async def test_define_tool_refuses_an_async_hook_that_dsh_calls_synchronously(option: str) -> None:
    """render, finalize_content and is_concurrency_safe are called, never awaited: an ``async def`` one
    was accepted, and then every call failed (INVALID_TOOL_OUTPUT), or ran exclusive, with a
    'coroutine was never awaited' warning."""
    from dsh_core import define_tool

    async def execute(args: Any, ctx: Any) -> Any:
        return "ok"

    async def asynchronous(*args: Any) -> Any:
        return "content"

    class AsyncCallable:  # an object whose __call__ is async def is as asynchronous
        async def __call__(self, *args: Any) -> Any:
            return "content"

    for hook in (asynchronous, AsyncCallable()):
        with pytest.raises(
            SchemaDefinitionError,
            match=rf'tool "t": {option} is async def, but dsh calls it '
            r"synchronously",
        ):
            define_tool(
                name="t", description="A tool.", parameters={"type": "object"}, execute=execute, **{option: hook}
            )  # type: ignore[arg-type]


@pytest.mark.parametrize("option", ["allow", "deny"])
def test_restrict_refuses_a_bare_tool_name_string(option: str) -> None:
    """restrict(deny="ab") read the string as the set of its characters: it denied tools "a" and "b",
    not "ab" (or failed naming single letters the caller never wrote)."""
    stack = Stack()
    for name in ("a", "b", "ab"):
        stack.registry.register(tool(name))
    agent = stack.agent()
    with pytest.raises(
        RegistrationError,
        match=rf"restrict\(\) {option} must be a collection of tool names, "
        rf"not a str \(write {option}=\['ab'\]\)",
    ):
        stack.registry.restrict(agent, **{option: "ab"})
    assert stack.registry.names(agent) == ["a", "ab", "b"]


def _listener_that_raises() -> None:
    raise ValueError("the listener's own bug")


def _failures_named(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        record.getMessage() for record in caplog.records if f"{__name__}._listener_that_raises" in record.getMessage()
    ]


async def test_a_raising_change_listener_neither_aborts_nor_orphans_a_scoped_registration(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """register() stored the tool, then let the listener's error out before handing the undo to the scope:
    the caller saw a failure, and the tool (a restriction, a mode too) outlived the scope that owned it."""
    stack = Stack()
    registry = stack.registry
    registry.register(tool("shared"))
    agent = stack.agent()
    plugin_scope = agent.child("plugin:p")
    heard: list[str] = []
    registry.on_change(_listener_that_raises)
    registry.on_change(lambda: heard.append("changed"))  # a later listener still hears of every change
    registry.register(tool("own"), scope=plugin_scope)
    registry.restrict(plugin_scope, deny=["shared"])
    registry.present_as("code", plugin_scope)
    assert registry.names(agent) == ["own", "run_code"]
    assert heard == ["changed"] * 3
    failures = _failures_named(caplog)
    assert len(failures) == 3 and 'register tool "own"' in failures[0], failures
    await plugin_scope.dispose()
    assert registry.names(agent) == ["shared"]  # the tool, the restriction and the mode went with their scope
    assert not any(
        entry.startswith(('tool "own"', "restriction", "presentation mode")) for entry in registry.inventory()
    )
    assert heard == ["changed"] * 6 and len(_failures_named(caplog)) == 6


def test_a_raising_change_listener_does_not_abort_an_unregister(caplog: pytest.LogCaptureFixture) -> None:
    """unregister() removed the tool, then raised the listener's error: the caller saw its undo fail, and the
    listeners after the raising one never heard that the tool was gone."""
    stack = Stack()
    registry = stack.registry
    unregister = registry.register(tool("gone"))
    heard: list[str] = []
    registry.on_change(_listener_that_raises)
    registry.on_change(lambda: heard.append("changed"))
    unregister()
    assert registry.names() == [] and heard == ["changed"]
    (failure,) = _failures_named(caplog)
    assert 'unregister tool "gone"' in failure, failure
    assert any(record.exc_info and isinstance(record.exc_info[1], ValueError) for record in caplog.records)
