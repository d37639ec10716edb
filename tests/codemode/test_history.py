"""Two history layers (issue 4 item 5): session events of nested calls, the durable-copy hook."""

from __future__ import annotations

import asyncio
from typing import Any

from codemode_kit import Env, MemorySink, tool

from dsh_core import TextBlock, ToolError, hookimpl
from dsh_core.codemode.history import CODE_DISPATCH, CODE_DISPATCH_START, CodeDispatchLog, find_sink
from dsh_core.model import render_json
from dsh_core.scope import Scope


async def test_one_event_pair_per_dispatch_with_exact_correlation(env: Env) -> None:
    async def fails(args: Any, ctx: Any) -> Any:
        raise ToolError("nope")

    env.add(tool("echo"), tool("fail", fails))
    program = "await tools.echo({'a': 1})\ntry:\n    await tools.fail({})\nexcept ToolCallError:\n    pass"
    result = await env.run(program, call_id="call-5", root_call_id="turn-2")
    assert not result.is_error
    assert env.sink is not None
    assert env.sink.events == [
        {
            "kind": CODE_DISPATCH_START,
            "payload": {"name": "echo", "arguments": {"a": 1}},
            "root_call_id": "turn-2",
            "parent_call_id": "call-5",
            "sub_call_id": "call-5:code:1",
        },
        {
            "kind": CODE_DISPATCH,
            "payload": {
                "name": "echo",
                "arguments": {"a": 1},
                "is_error": False,
                "error_code": None,
                "content": [{"type": "text", "text": rendered({"a": 1})}],
            },
            "root_call_id": "turn-2",
            "parent_call_id": "call-5",
            "sub_call_id": "call-5:code:1",
        },
        {
            "kind": CODE_DISPATCH_START,
            "payload": {"name": "fail", "arguments": {}},
            "root_call_id": "turn-2",
            "parent_call_id": "call-5",
            "sub_call_id": "call-5:code:2",
        },
        {
            "kind": CODE_DISPATCH,
            "payload": {
                "name": "fail",
                "arguments": {},
                "is_error": True,
                "error_code": "TOOL_FAILED",
                "content": [{"type": "text", "text": "Error: nope"}],
            },
            "root_call_id": "turn-2",
            "parent_call_id": "call-5",
            "sub_call_id": "call-5:code:2",
        },
    ]


async def test_the_complete_sub_result_content_is_logged_verbatim(env: Env) -> None:
    big = "line\n" * 5000
    env.add(tool("big", lambda a, c: _value(big)))
    result = await env.run("r = await tools.big({})\nprint(len(r))")
    assert result.text == str(len(big))
    assert env.sink is not None
    assert env.sink.events[1]["payload"]["content"] == [{"type": "text", "text": big}]


def rendered(value: Any) -> str:
    """What the default renderer shows the model for ``value``."""
    return render_json({}, value)[0].text  # type: ignore[union-attr]


async def _value(value: Any) -> Any:
    return value


async def test_the_log_hook_reshapes_only_the_durable_copy(env: Env) -> None:
    seen: list[CodeDispatchLog] = []

    class Spill:
        @hookimpl
        def dsh_code_dispatch_log(self, dispatch: CodeDispatchLog) -> Any:
            seen.append(dispatch)
            return [TextBlock(f"[spilled {len(dispatch.content[0].text)} chars]")]  # type: ignore[union-attr]

    env.add(tool("echo"))
    env.plug(Spill())
    result = await env.run("return await tools.echo({'k': 'v'})")
    assert result.value["result"] == {"k": "v"}  # the program saw the real value
    assert env.sink is not None
    size = len(rendered({"k": "v"}))
    assert env.sink.events[1]["payload"]["content"] == [{"type": "text", "text": f"[spilled {size} chars]"}]
    assert seen[0].sub_call_id == "call-1:code:1" and seen[0].arguments == {"k": "v"} and not seen[0].is_error


async def test_a_throwing_log_hook_is_contained_and_the_original_content_logged(env: Env) -> None:
    class Broken:
        @hookimpl
        def dsh_code_dispatch_log(self, dispatch: Any) -> Any:
            raise RuntimeError("listener crashed")

    class Malformed:
        @hookimpl
        def dsh_code_dispatch_log(self, dispatch: Any) -> Any:
            return ["not a block"]

    for plugin in (Broken(), Malformed()):
        env = Env()
        env.add(tool("echo"))
        env.plug(plugin)
        result = await env.run("return await tools.echo({'k': 1})")
        assert not result.is_error
        assert env.sink is not None
        assert env.sink.events[1]["payload"]["content"] == [{"type": "text", "text": rendered({"k": 1})}]


async def test_a_failing_sink_never_changes_what_the_program_or_model_sees() -> None:
    class BrokenSink(MemorySink):
        async def append(self, kind: str, payload: Any, **ids: Any) -> None:
            raise OSError("disk full")

    env = Env(sink=BrokenSink())
    env.add(tool("echo"))
    result = await env.run("return await tools.echo({'k': 1})")
    assert result.value["result"] == {"k": 1}


async def test_the_session_event_never_becomes_a_model_message(env: Env) -> None:
    env.add(tool("echo"))
    result = await env.run("await tools.echo({'needle': 'in the log only'})\nprint('done')")
    # The model-facing result is only the curated output, with no derived context messages.
    assert result.text == "done" and result.additional_contexts == ()
    assert env.sink is not None and "in the log only" in str(env.sink.events)


def test_find_sink_looks_up_the_session_service_of_the_scope_chain() -> None:
    root = Scope("root")
    agent = root.child("agent", layered=True)
    inner = agent.child("inner")
    assert find_sink(None) is None
    assert find_sink(inner) is None
    sink = MemorySink()
    agent.provide("session", sink)
    assert find_sink(inner) is sink
    other = root.child("other")
    other.provide("session", object())  # not a sink: ignored
    assert find_sink(other) is None


def test_settle_content_is_unstructured_exactly_as_the_converter_does() -> None:
    from dsh_core.codemode.history import unstructure_blocks
    from dsh_core.model import ImageBlock, converter

    for blocks in (
        [],
        [TextBlock("a")],
        [TextBlock("")],
        [ImageBlock("ZGF0YQ==", "image/png")],
        [TextBlock("x"), ImageBlock("ZA==", "image/gif"), TextBlock("y\nz")],
    ):
        fast, general = unstructure_blocks(blocks), converter.unstructure(list(blocks))
        assert fast == general
        assert [list(entry) for entry in fast] == [list(entry) for entry in general]  # same key order


def test_ints_render_as_the_json_encoder_renders_them() -> None:
    import json

    for value in (0, 1, -1, 2**63, -(2**100), 10**50):
        assert rendered(value) == json.dumps(value)
    assert rendered(True) == "true" and rendered(None) == "null" and rendered(1.5) == "1.5"


async def test_a_log_hook_letting_out_a_stray_cancellation_is_contained(env: Env) -> None:
    # It awaited something cancelled elsewhere; nobody cancelled the run: the original content is logged.
    class Stray:
        @hookimpl
        def dsh_code_dispatch_log(self, dispatch: Any) -> Any:
            async def reshape() -> Any:
                future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                future.cancel()
                await future

            return reshape()

    env.add(tool("echo"))
    env.plug(Stray())
    result = await env.run("return await tools.echo({'k': 1})")
    assert not result.is_error, result
    assert env.sink is not None
    assert env.sink.events[1]["payload"]["content"] == [{"type": "text", "text": rendered({"k": 1})}]
