"""dsh: a tool runtime and plugin framework for LLM agents.

Plugin authors need only this module::

    from dsh_core import hookimpl, define_tool, plugin, ToolError
"""

from typing import TYPE_CHECKING

from dsh_core.lazy import lazy_exports

if TYPE_CHECKING:
    from dsh_hookspecs import hookimpl

    from dsh_core.abort import AbortController, AbortedError, AbortSignal
    from dsh_core.define import define_tool
    from dsh_core.errors import DshError, ErrorCode, ToolError
    from dsh_core.model import (
        ApprovalOutcome,
        ApprovalRequest,
        ContentBlock,
        ContextMessage,
        ImageBlock,
        PostDecision,
        PreDecision,
        PromptContext,
        PromptSection,
        TextBlock,
        ToolContext,
        ToolDefinition,
        ToolExecution,
        ToolExecutionInput,
        ToolResult,
    )
    from dsh_core.plugins import plugin
    from dsh_core.scope import Scope

__all__ = [
    "AbortController",
    "AbortSignal",
    "AbortedError",
    "ApprovalOutcome",
    "ApprovalRequest",
    "ContentBlock",
    "ContextMessage",
    "DshError",
    "ErrorCode",
    "ImageBlock",
    "PostDecision",
    "PreDecision",
    "PromptContext",
    "PromptSection",
    "Scope",
    "TextBlock",
    "ToolContext",
    "ToolDefinition",
    "ToolError",
    "ToolExecution",
    "ToolExecutionInput",
    "ToolResult",
    "define_tool",
    "hookimpl",
    "plugin",
]

# Each name's module is imported when the name is first read (see dsh_core.lazy): `dsh --help`
# and the other commands that never touch them do not pay for asyncio, cattrs and jsonschema.
if not TYPE_CHECKING:
    __getattr__, __dir__ = lazy_exports(
        __name__,
        {
            "dsh_hookspecs": ["hookimpl"],
            "dsh_core.abort": ["AbortController", "AbortedError", "AbortSignal"],
            "dsh_core.define": ["define_tool"],
            "dsh_core.errors": ["DshError", "ErrorCode", "ToolError"],
            "dsh_core.model": [
                "ApprovalOutcome",
                "ApprovalRequest",
                "ContentBlock",
                "ContextMessage",
                "ImageBlock",
                "PostDecision",
                "PreDecision",
                "PromptContext",
                "PromptSection",
                "TextBlock",
                "ToolContext",
                "ToolDefinition",
                "ToolExecution",
                "ToolExecutionInput",
                "ToolResult",
            ],
            "dsh_core.plugins": ["plugin"],
            "dsh_core.scope": ["Scope"],
        },
    )
