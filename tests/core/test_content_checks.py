"""No result whose content cannot be read is emitted: bad content is an INVALID_TOOL_OUTPUT naming its source."""

from __future__ import annotations

from typing import Any

import pytest

from dsh_core import define_tool, hookimpl
from dsh_core.model import (
    ImageBlock,
    PostDecision,
    TextBlock,
    ToolDefinition,
    ToolExecution,
    ToolResult,
    converter,
)

from .helpers import Recorder, Stack, register, tool

pytestmark = pytest.mark.anyio


def _altered(block: Any, **fields: object) -> Any:
    """A block changed after it was built, around its checks."""
    for name, value in fields.items():
        object.__setattr__(block, name, value)
    return block


def _rendering(render: Any) -> ToolDefinition:
    async def execute(args: Any, ctx: Any) -> Any:
        return {"rows": 3}

    return define_tool(
        name="count", description="Count rows.", parameters={"type": "object"}, execute=execute, render=render
    )


def _readable(result: ToolResult) -> None:
    """Everything a consumer does with a result works: its text, and the wire shape of its content."""
    assert isinstance(result.text, str)
    for block in converter.unstructure(list(result.content)):
        assert converter.structure(block, TextBlock | ImageBlock) is not None  # type: ignore[arg-type]


def test_blocks_refuse_fields_that_are_not_text() -> None:
    with pytest.raises(TypeError, match=r"TextBlock\.text must be str, got int"):
        TextBlock(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"ImageBlock\.data must be str, got bytes"):
        ImageBlock(b"\x89PNG", "image/png")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"ImageBlock\.mime_type must be str, got NoneType"):
        ImageBlock("AAAA", None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("render", "message"),
    [
        (
            lambda args, value: [TextBlock(value["rows"])],
            'tool "count": output.render failed: TextBlock.text must be str, got int',
        ),
        (
            lambda args, value: [_altered(TextBlock("3"), text=3)],
            'tool "count" produced invalid content: block 0: TextBlock.text is int, expected str',
        ),
        (
            lambda args, value: [TextBlock("ok"), _altered(ImageBlock("AAAA", "image/png"), data=b"AAAA")],
            'tool "count" produced invalid content: block 1: ImageBlock.data is bytes, expected str',
        ),
    ],
)
async def test_a_render_giving_bad_blocks_is_invalid_output_naming_the_tool(render: Any, message: str) -> None:
    stack = Stack()
    stack.registry.register(_rendering(render))
    recorder = register(stack.hooks, Recorder())
    result = await stack.call("count")
    assert result.code == "INVALID_TOOL_OUTPUT" and result.error is not None and result.error.message == message
    assert result.value is None
    _readable(result)
    assert recorder.results[-1][1] is result  # observers see the checked result, not the unreadable one


@pytest.mark.parametrize(
    ("returned", "problem"),
    [
        (lambda: [_altered(TextBlock("x"), text=None)], "block 0: TextBlock.text is NoneType, expected str"),
        (lambda: [3], "TypeError: content blocks must be TextBlock or ImageBlock, got int"),
        (lambda: 3, "TypeError: 'int' object is not iterable"),
    ],
)
async def test_a_finalizer_returning_bad_content_is_invalid_output_naming_the_tool(returned: Any, problem: str) -> None:
    def finalize(execution: ToolExecution, result: ToolResult) -> Any:
        return returned()

    stack = Stack()
    stack.registry.register(tool("echo", finalize=finalize))
    result = await stack.call("echo")
    assert result.code == "INVALID_TOOL_OUTPUT" and result.error is not None
    assert result.error.message == f'tool "echo": finalize_content returned invalid content: {problem}'
    _readable(result)


@pytest.mark.parametrize(
    "make",
    [
        lambda: PostDecision.replace_content([_altered(TextBlock("[redacted]"), text=["redacted"])]),
        lambda: PostDecision.block([_altered(TextBlock("[redacted]"), text=["redacted"])]),
        lambda: _altered(PostDecision.replace_content("x"), content="[redacted]"),
    ],
)
async def test_post_execute_content_that_cannot_be_read_is_invalid_output_naming_plugin_and_tool(make: Any) -> None:
    class Redact:
        @hookimpl
        def dsh_post_execute(self, execution: ToolExecution, result: ToolResult) -> PostDecision:
            return make()  # type: ignore[no-any-return]

    stack = Stack()
    stack.registry.register(tool("echo"))
    register(stack.hooks, Redact(), name="redact")
    result = await stack.call("echo")
    assert result.code == "INVALID_TOOL_OUTPUT" and result.error is not None
    assert result.error.message.startswith(
        "dsh_post_execute of plugin 'redact' returned invalid content for tool \"echo\": "
    )
    _readable(result)


async def test_a_middleware_result_whose_content_cannot_be_read_is_invalid_output() -> None:
    class Shortcut:
        @hookimpl
        def dsh_around_dispatch(self, execution: ToolExecution) -> Any:
            async def middleware(call: ToolExecution, proceed: Any) -> ToolResult:
                return ToolResult.failure("CACHED", "cached", content=[_altered(TextBlock("cached"), text=7)])

            return middleware

    stack = Stack()
    stack.registry.register(tool("echo"))
    register(stack.hooks, Shortcut())
    result = await stack.call("echo")
    assert result.code == "INVALID_TOOL_OUTPUT" and result.error is not None
    assert result.error.message == 'tool "echo" produced invalid content: block 0: TextBlock.text is int, expected str'
    _readable(result)


def test_context_messages_refuse_what_is_not_text() -> None:
    from dsh_core.model import ContextMessage

    with pytest.raises(TypeError, match=r"ContextMessage\.text must be str, got int"):
        ContextMessage(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"ContextMessage\.source must be str, got bytes"):
        ContextMessage("note", b"plugin")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"additional_contexts holds str, expected ContextMessage"):
        PostDecision.accept(additional_contexts=["note"])  # type: ignore[list-item]


async def test_a_post_execute_context_that_is_a_plain_string_fails_the_plugin_not_the_reader() -> None:
    """Before, the string rode the result and the agent loop crashed reading its ``.text``."""

    class Noter:
        @hookimpl
        def dsh_post_execute(self, execution: ToolExecution, result: ToolResult) -> PostDecision:
            return PostDecision.accept(additional_contexts=["remember this"])  # type: ignore[list-item]

    stack = Stack()
    stack.registry.register(tool("echo"))
    register(stack.hooks, Noter(), name="noter")
    result = await stack.call("echo")
    assert result.code == "TOOL_FAILED" and result.error is not None
    assert result.error.message == (
        "dsh_post_execute of plugin 'noter' failed: TypeError: additional_contexts "
        "holds str, expected ContextMessage (wrap text in ContextMessage(text))"
    )
    assert all(context.text for context in result.additional_contexts)


def test_an_error_refuses_a_code_or_message_that_is_not_text() -> None:
    from dsh_core.model import ToolErrorInfo

    with pytest.raises(TypeError, match=r"ToolErrorInfo\.code must be str, got int"):
        ToolErrorInfo(5, "five")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"ToolErrorInfo\.message must be str, got NoneType"):
        ToolResult.failure("CACHED", None)  # type: ignore[arg-type]


async def test_a_middleware_result_with_an_error_that_is_not_error_info_fails_that_plugin() -> None:
    """Before, ``error="boom"`` escaped the executor as an AttributeError, naming no plugin."""

    class Shortcut:
        @hookimpl
        def dsh_around_dispatch(self, execution: ToolExecution) -> Any:
            async def middleware(call: ToolExecution, proceed: Any) -> ToolResult:
                return ToolResult(content="cached", error="boom")  # type: ignore[arg-type]

            return middleware

    stack = Stack()
    stack.registry.register(tool("echo"))
    register(stack.hooks, Shortcut(), name="shortcut")
    result = await stack.call("echo")
    assert result.code == "TOOL_FAILED" and result.error is not None
    assert result.error.message.startswith(
        "dsh_around_dispatch of plugin 'shortcut' failed: "
        "TypeError: ToolResult.error must be ToolErrorInfo or None, got str"
    )
    _readable(result)


def test_shown_text_joins_a_surrogate_pair_written_as_two_code_points_into_its_character() -> None:
    """Text is shown, not a value: a pair held as two code points (text a plugin decoded with
    ``surrogatepass``, say) becomes the character it spells, as every JSON hop made it, so the session
    event recording the result stays lossless JSON. Lone surrogates, and a low one first, are kept."""
    import json

    from dsh_core.model import ContextMessage
    from dsh_core.sessions.events import encode_payload

    result = ToolResult(
        content="smile \ud83d\ude00 \udc80 \ude00\ud83d",
        additional_contexts=[ContextMessage("note \ud800\udc00", "p\ud83d\ude00")],
    )
    assert result.text == "smile \U0001f600 \udc80 \ude00\ud83d"
    assert result.additional_contexts[0] == ContextMessage("note \U00010000", "p\U0001f600")
    failed = ToolResult.failure("TOOL_FAILED", "boom \udbff\udfff")
    assert failed.error is not None and failed.error.message == "boom \U0010ffff" == failed.text[len("Error: ") :]
    payload = {"content": result.text, "context": result.additional_contexts[0].text, "error": failed.error.message}
    assert json.loads(encode_payload(payload)) == payload
