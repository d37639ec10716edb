"""Throwaway tools and plugins for core tests (no installed plugin is ever needed)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from typing import Any

from dsh_core import define_tool, hookimpl
from dsh_core.abort import AbortSignal
from dsh_core.hooks import Hooks
from dsh_core.model import (
    ExecutionToken,
    PostDecision,
    PreDecision,
    ToolDefinition,
    ToolExecution,
    ToolExecutionInput,
    ToolResult,
)
from dsh_core.registry import ToolRegistry
from dsh_core.runtime import ToolRuntime
from dsh_core.scope import Scope

_ids = itertools.count(1)


def tool(
    name: str = "echo",
    *,
    safe: object = None,
    body: Callable[..., Any] | None = None,
    output_schema: dict[str, Any] | None = None,
    finalize: Any = None,
    parameters: dict[str, Any] | None = None,
) -> ToolDefinition:
    """A tool whose body records its calls in ``tool.calls`` (an attribute of the returned definition's body)."""
    calls: list[Any] = []

    async def execute(args: Any, ctx: Any) -> Any:
        calls.append(args)
        if body is not None:
            outcome = body(args, ctx)
            if asyncio.iscoroutine(outcome):
                outcome = await outcome
            return outcome
        return {"echo": args.get("text", "")}

    definition = define_tool(
        name=name,
        description=f"The {name} tool.",
        parameters=parameters or {"type": "object", "properties": {"text": {"type": "string"}}},
        output_schema=output_schema if output_schema is not None else {},
        execute=execute,
        is_concurrency_safe=safe,  # type: ignore[arg-type]
        finalize_content=finalize,
    )
    execute.calls = calls  # type: ignore[attr-defined]
    return definition


def body_calls(definition: ToolDefinition) -> list[Any]:
    """The argument objects the tool body received."""
    return definition.execute.calls  # type: ignore[attr-defined, no-any-return]


class Stack:
    """A bare registry + hooks + runtime, with a root scope."""

    def __init__(
        self,
        mode: str = "native",
        transport: ToolDefinition | None = None,
        *,
        approval_timeout_s: float | None = None,
        approval_grace_s: float | None = None,
    ) -> None:
        self.root = Scope("root")
        self.hooks = Hooks()
        self.transport = transport or tool("run_code_impl")
        self.registry = ToolRegistry(default_mode=mode, transport=_as_transport(self.transport))  # type: ignore[arg-type]
        grace = {} if approval_grace_s is None else {"approval_grace_s": approval_grace_s}
        self.runtime = ToolRuntime(self.registry, self.hooks, approval_timeout_s=approval_timeout_s, **grace)

    def agent(self, name: str = "agent", parent: Scope | None = None) -> Scope:
        return (parent or self.root).child(f"agent:{name}", layered=True)

    async def call(
        self,
        name: str,
        arguments: Any = None,
        *,
        agent: Scope | None = None,
        parent: ExecutionToken | None = None,
        signal: AbortSignal | None = None,
        call_id: str | None = None,
    ) -> ToolResult:
        return await self.runtime.execute(
            ToolExecutionInput(
                call_id=call_id or f"call-{next(_ids)}",
                name=name,
                arguments={} if arguments is None else arguments,
                signal=signal or AbortSignal.never(),
                agent=agent,
                parent=parent,
            )
        )


def _as_transport(definition: ToolDefinition) -> ToolDefinition:
    """Give a stand-in body the reserved name (the real transport is dsh_core.codemode's)."""
    import attrs

    return attrs.evolve(definition, name="run_code")


class Recorder:
    """A throwaway plugin recording every policy stage it sees."""

    def __init__(
        self,
        *,
        pre: PreDecision | None = None,
        approval: Any = None,
        guard: str | None = None,
        post: PostDecision | None = None,
    ) -> None:
        self.seen: list[tuple[str, str]] = []
        self.results: list[tuple[ToolExecution, ToolResult]] = []
        self._pre = pre
        self._approval = approval
        self._guard = guard
        self._post = post

    @hookimpl
    def dsh_pre_execute(self, execution: ToolExecution) -> PreDecision | None:
        self.seen.append(("pre", execution.name))
        return self._pre

    @hookimpl
    def dsh_approve(self, request: Any) -> Any:
        self.seen.append(("approve", request.execution.name))
        return self._approval

    @hookimpl
    def dsh_guard(self, execution: ToolExecution) -> str | None:
        self.seen.append(("guard", execution.name))
        return self._guard

    @hookimpl
    def dsh_post_execute(self, execution: ToolExecution, result: ToolResult) -> PostDecision | None:
        self.seen.append(("post", execution.name))
        return self._post

    @hookimpl
    def dsh_tool_result(self, execution: ToolExecution, result: ToolResult) -> None:
        self.seen.append(("result", execution.name))
        self.results.append((execution, result))

    def stages(self) -> list[str]:
        return [stage for stage, _ in self.seen]


def register(hooks: Hooks, plugin: object, name: str | None = None, scope: Scope | None = None) -> object:
    hooks.register(plugin, name=name or f"plugin-{next(_ids)}", scope=scope)
    return plugin
