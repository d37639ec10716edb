"""dsh: a tool runtime and plugin framework for LLM agents.

Plugin authors need only this module::

    from dsh_core import hookimpl, define_tool, plugin, ToolError
"""

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
