"""The run_code definition (issue 4 item 1): schema, rendering, failures, missing runtime, exclusivity."""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import pytest
from codemode_kit import Env, FakeCodeRuntime, tool

from dsh_core import hookimpl
from dsh_core.abort import AbortSignal
from dsh_core.codemode.cli import run_code_json
from dsh_core.codemode.transport import (
    NO_OUTPUT,
    RunCodeTransport,
    present_call,
    pretty_json,
    render_run_output,
)
from dsh_core.errors import CodeRunFailedError, DshError, ErrorCode
from dsh_core.lossless import freeze, thaw
from dsh_core.model import PostDecision, ToolExecutionInput, ToolResult


def test_the_schema_has_two_required_strings_and_a_closed_output() -> None:
    env = Env()
    definition = env.registry.transport
    assert definition is not None and definition.name == "run_code"
    params = definition.parameters
    assert params["required"] == ["code", "description"]
    assert params["properties"]["code"]["type"] == params["properties"]["description"]["type"] == "string"
    assert params["additionalProperties"] is False
    output = definition.output.schema
    assert output["required"] == ["logs"] and output["additionalProperties"] is False
    assert definition.is_concurrency_safe is None  # exclusive in the top-level loop
    assert (
        env.runtime.execution_mode(
            ToolExecutionInput(
                call_id="c", name="run_code", arguments={"code": "", "description": "x"}, agent=env.agent
            )
        )
        == "exclusive"
    )


def test_the_wording_follows_the_runtime_language_at_projection_time() -> None:
    python = Env()
    assert "Python program" in python.registry.wire_schemas(python.agent)[0].description
    assert "print(...)" in python.registry.transport.description  # type: ignore[union-attr]
    typescript = Env(code_runtime=FakeCodeRuntime("typescript"))
    assert "TypeScript program" in typescript.registry.wire_schemas(typescript.agent)[0].description
    # With no runtime the Python wording is used (execution then reports the missing runtime).
    missing = Env(code_runtime=None)
    assert "Python program" in missing.registry.wire_schemas(missing.agent)[0].description


def test_an_unknown_language_fails_every_projection_loudly() -> None:
    env = Env(code_runtime=FakeCodeRuntime("cobol"))
    for _ in range(2):
        with pytest.raises(ValueError, match='no run_code schema flavor for code runtime language "cobol"'):
            env.registry.wire_schemas(env.agent)
    # Resolved lazily: once the runtime is fixed, projection works.
    env.code_runtime = FakeCodeRuntime("python")
    assert env.registry.wire_schemas(env.agent)[0].name == "run_code"


def test_arguments_are_validated_with_the_static_schema() -> None:
    env = Env()

    async def go() -> None:
        result = await env.runtime.execute(
            ToolExecutionInput(call_id="c", name="run_code", arguments={"code": "print(1)"}, agent=env.agent)
        )
        assert result.code == ErrorCode.INVALID_ARGS
        result = await env.runtime.execute(
            ToolExecutionInput(call_id="c", name="run_code", arguments={"code": 1, "description": "d"}, agent=env.agent)
        )
        assert result.code == ErrorCode.INVALID_ARGS

    asyncio.run(go())


@pytest.mark.parametrize("description", ["", "   ", "\n\t"])
async def test_a_blank_description_is_an_error_result(description: str) -> None:
    env = Env()
    result = await env.run("print(1)", description=description)
    assert result.code == ErrorCode.INVALID_ARGS
    assert result.error is not None and result.error.message == "invalid description: expected a non-empty string"
    assert env.fake is not None and env.fake.runs == 0


def test_present_call_titles_the_card_with_the_description() -> None:
    card = present_call({"code": "print(1)", "description": "Print one"})
    assert card == {"card": "generic", "title": "Print one", "kind": "execute", "raw_input": "print(1)"}


# -- rendering ---------------------------------------------------------------------------------------


async def test_logs_then_a_raw_string_result(env: Env) -> None:
    result = await env.run("print('a')\nprint('b', 2)\nreturn 'plain text'")
    assert result.text == "a\nb 2\nplain text"
    assert result.value == {"logs": ["a", "b 2"], "result": "plain text"}


async def test_non_string_results_are_pretty_printed(env: Env) -> None:
    result = await env.run("return {'n': 1, 'items': [True, None, 'x']}")
    assert result.text == '{\n  "n": 1,\n  "items": [\n    true,\n    null,\n    "x"\n  ]\n}'


@pytest.mark.parametrize(
    ("code", "text"),
    [
        ("pass", NO_OUTPUT),
        ("return", NO_OUTPUT),
        ("return ''", NO_OUTPUT),
        ("return None", "null"),
        ("return 0", "0"),
        ("return []", "[]"),
    ],
)
async def test_the_placeholder_and_falsy_results(env: Env, code: str, text: str) -> None:
    result = await env.run(code)
    assert result.text == text


async def test_no_value_means_no_result_key(env: Env) -> None:
    assert (await env.run("print('x')")).value == {"logs": ["x"]}
    assert (await env.run("return None")).value == {"logs": [], "result": None}


def test_deep_values_render_iteratively_with_capped_indentation() -> None:
    value: Any = "leaf"
    for _ in range(5000):
        value = {"k": [value]}
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(200)  # a recursive printer could not get past a few levels now
    try:
        text = render_run_output({}, {"logs": [], "result": value})
    finally:
        sys.setrecursionlimit(limit)
    lines = text[0].text.splitlines()
    assert lines[0] == "{" and lines[-1] == "}"
    assert max(len(line) - len(line.lstrip(" ")) for line in lines) == 10
    assert '"leaf"' in text[0].text


def test_pretty_json_matches_json_dumps_for_shallow_values() -> None:
    import json

    value = {"a": [1, 2.5, {"b": None}], "c": "é", "d": {}, "e": []}
    assert pretty_json(value) == json.dumps(value, indent=2, ensure_ascii=False)


# -- failures -------------------------------------------------------------------------------------------


async def test_a_failed_run_is_code_run_failed_with_kind_message_and_logs(env: Env) -> None:
    result = await env.run("print('step 1')\nprint('step 2')\nraise ValueError('bad input')")
    assert result.code == ErrorCode.CODE_RUN_FAILED
    assert result.error is not None
    assert result.error.message == (
        "code run failed (exception): ValueError: bad input\nCaptured output:\nstep 1\nstep 2"
    )
    assert result.value is None


async def test_a_syntax_error_is_an_exception_outcome(env: Env) -> None:
    result = await env.run("def (:")
    assert result.code == ErrorCode.CODE_RUN_FAILED
    assert result.error is not None and result.error.message.startswith("code run failed (exception): SyntaxError")


def test_code_run_failed_error_is_a_dsh_error_with_its_code() -> None:
    error = CodeRunFailedError("timeout", "wall clock budget exceeded", ["a"])
    assert isinstance(error, DshError) and error.code == "CODE_RUN_FAILED"
    assert error.kind == "timeout" and error.logs == ("a",)
    assert str(error) == "code run failed (timeout): wall clock budget exceeded\nCaptured output:\na"


async def test_a_missing_runtime_at_execution_is_an_error_result_not_a_crash() -> None:
    env = Env(code_runtime=None)
    result = await env.run("print(1)")
    assert result.code == ErrorCode.TOOL_FAILED
    assert result.error is not None
    assert 'mode "code" requires a code runtime' in result.error.message


async def test_a_pre_aborted_outer_call_never_reaches_the_runtime(env: Env) -> None:
    result = await env.run("print(1)", signal=AbortSignal.aborted_with("stop"))
    assert result.code == ErrorCode.ABORTED_BEFORE_DISPATCH
    assert env.fake is not None and env.fake.runs == 0


async def test_run_code_is_not_callable_under_native() -> None:
    env = Env(mode="native")
    result = await env.run("print(1)")
    assert result.code == ErrorCode.UNKNOWN_TOOL


async def test_the_transport_works_with_a_plain_runtime_object() -> None:
    env = Env()
    runtime = FakeCodeRuntime()
    transport = RunCodeTransport(env.runtime, runtime)
    definition = transport.definition()
    assert definition.name == "run_code"
    env.add(tool("echo"))
    with transport.watch("call-9") as record:
        from dsh_core.model import ExecutionToken, ToolContext, ToolExecution

        execution = ToolExecution(
            call_id="call-9",
            root_call_id="call-9",
            name="run_code",
            arguments={},
            signal=AbortSignal.never(),
            agent=env.agent,
            parent=None,
            token=ExecutionToken(),
        )
        # Called outside the runtime, the body's token must be opened by hand (the runtime
        # opens it for exactly as long as a run_code body runs).
        close = env.runtime.open_nesting(execution.token, execution.agent)
        try:
            value = await definition.execute(
                freeze({"code": "return await tools.echo({'a': 1})", "description": "d"}), ToolContext(execution)
            )
        finally:
            close()
    assert value == {"logs": [], "result": {"a": 1}}
    assert record.run is not None and record.run.has_value
    assert [(c.sub_call_id, c.name, c.args, c.ok, c.error_code) for c in record.calls] == [
        ("call-9:code:1", "echo", {"a": 1}, True, None)
    ]


async def test_run_code_json_of_a_run_code_answered_by_a_middleware_without_a_run() -> None:
    class Cache:
        @hookimpl
        def dsh_around_dispatch(self) -> Any:
            async def middleware(call: Any, proceed: Any) -> ToolResult:
                if call.name == "run_code":
                    return ToolResult(content="cached", value={"logs": ["from cache"], "result": {"n": 3}})
                return await proceed(call)  # type: ignore[no-any-return]

            return middleware

    env = Env()
    env.plug(Cache())
    with env.transport.watch("call-1") as record:
        result = await env.run("print('never runs')")
    assert not result.is_error and record.run is None and env.fake is not None and env.fake.runs == 0
    assert run_code_json(result, record) == {
        "outcome": "completed",
        "logs": ["from cache"],
        "result": {"n": 3},
        "error": None,
        "calls": [],
    }


class _Redactor:
    """A post-execute plugin that redacts a secret from run_code results: the value, or a failure's content."""

    @hookimpl
    def dsh_post_execute(self, execution: Any, result: ToolResult) -> PostDecision | None:
        if execution.name != "run_code":
            return None
        if result.is_error:
            return PostDecision.replace_content(result.text.replace("hunter2", "[REDACTED]"))
        value = thaw(result.value)
        value["logs"] = [line.replace("hunter2", "[REDACTED]") for line in value["logs"]]
        value["result"] = value["result"].replace("hunter2", "[REDACTED]")
        return PostDecision.replace_value(value)


async def test_run_code_json_shows_what_the_post_execute_hooks_left_not_the_raw_run() -> None:
    env = Env()
    env.plug(_Redactor())
    with env.transport.watch("call-1") as record:
        result = await env.run("print('password is hunter2')\nreturn 'hunter2'")
    assert record.run is not None and record.run.logs == ("password is hunter2",)  # the raw run had it
    assert result.text == "password is [REDACTED]\n[REDACTED]"
    assert run_code_json(result, record) == {
        "outcome": "completed",
        "logs": ["password is [REDACTED]"],
        "result": "[REDACTED]",
        "error": None,
        "calls": [],
    }
    with env.transport.watch("call-2") as record:
        failed = await env.run("print('password is hunter2')\nraise ValueError('hunter2')", call_id="call-2")
    assert failed.is_error and "hunter2" not in failed.text
    document = run_code_json(failed, record)
    assert "hunter2" not in json.dumps(document)
    assert document == {
        "outcome": "exception",
        "logs": [],
        "result": None,
        "calls": [],
        "error": {"code": "CODE_RUN_FAILED", "kind": "exception", "message": failed.text.removeprefix("Error: ")},
    }


async def test_run_code_json_of_a_run_blocked_after_it_completed_has_no_run_logs() -> None:
    class Block:
        @hookimpl
        def dsh_post_execute(self, execution: Any, result: ToolResult) -> PostDecision | None:
            return PostDecision.block("not allowed") if execution.name == "run_code" else None

    env = Env()
    env.plug(Block())
    with env.transport.watch("call-1") as record:
        result = await env.run("print('secret')\nreturn 1")
    assert record.run is not None and record.run.logs == ("secret",)
    assert run_code_json(result, record) == {
        "outcome": "BLOCKED",
        "logs": [],
        "result": None,
        "calls": [],
        "error": {"code": "BLOCKED", "kind": None, "message": "not allowed"},
    }


async def test_run_code_json_of_a_failed_run_reported_unchanged_keeps_its_logs_and_message() -> None:
    env = Env()
    with env.transport.watch("call-1") as record:
        result = await env.run("print('before')\nraise ValueError('nope')")
    assert run_code_json(result, record) == {
        "outcome": "exception",
        "logs": ["before"],
        "result": None,
        "calls": [],
        "error": {"code": "CODE_RUN_FAILED", "kind": "exception", "message": "ValueError: nope"},
    }


async def test_run_code_json_has_the_same_key_order_for_every_outcome() -> None:
    # A completed run printed "error" before "calls", a failed one "calls" before "error": `--json` output
    # compared or diffed as text (a golden file, `jq -c` less) changed shape with the outcome.
    class Block:
        @hookimpl
        def dsh_post_execute(self, execution: Any, result: ToolResult) -> PostDecision | None:
            return PostDecision.block("no") if execution.name == "run_code" and "block" in result.text else None

    env = Env()
    env.plug(Block())
    documented = ["outcome", "logs", "result", "error", "calls"]
    for number, program in enumerate(["return 1", "raise ValueError('nope')", "return 'block'"], start=1):
        call_id = f"call-{number}"
        with env.transport.watch(call_id) as record:
            result = await env.run(program, call_id=call_id)
        document = run_code_json(result, record)
        assert list(document) == documented, program
        if document["error"] is not None:
            assert list(document["error"]) == ["code", "kind", "message"]
