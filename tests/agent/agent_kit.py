"""Helpers for the agent-loop tests: tools, scripts, a fake run_code transport, a harness builder."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from dsh_core import ToolContext, define_tool, hookimpl
from dsh_core.config import compose
from dsh_core.harness import Harness
from dsh_core.model import ToolDefinition, ToolExecutionInput
from dsh_core.plugins import PluginCatalog
from dsh_core.sessions.recorder import SESSION_SERVICE

Body = Callable[[Any, ToolContext], Awaitable[Any]]


def tool(name: str, body: Body, *, safe: bool = False, params: Mapping[str, Any] | None = None) -> ToolDefinition:
    """A test tool (object parameters, any output)."""
    return define_tool(
        name=name,
        description=f"The {name} test tool.",
        parameters=dict(params or {"type": "object"}),
        execute=body,
        is_concurrency_safe=safe,
    )


def call(name: str, args: Any, call_id: str | None = None) -> dict[str, Any]:
    """One OpenAI tool call (``args`` as a value, or raw text when a ``str``)."""
    text = args if isinstance(args, str) else json.dumps(args)
    return {"id": call_id or f"c_{name}", "type": "function", "function": {"name": name, "arguments": text}}


def calls(
    *items: dict[str, Any], content: str | None = None, expect: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """An assistant turn with tool calls."""
    turn: dict[str, Any] = {"role": "assistant", "content": content, "tool_calls": list(items)}
    if expect:
        turn["expect"] = dict(expect)
    return turn


def final(text: str, expect: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """An assistant turn with a final answer."""
    turn: dict[str, Any] = {"role": "assistant", "content": text}
    if expect:
        turn["expect"] = dict(expect)
    return turn


def write_script(path: Path, turns: Sequence[Mapping[str, Any]]) -> Path:
    """Write a JSONL script."""
    path.write_text("".join(json.dumps(t) + "\n" for t in turns), encoding="utf-8")
    return path


def fake_run_code(harness: Harness) -> ToolDefinition:
    """A stand-in ``run_code``: ``code`` is JSON ``{"calls": [{"name", "args"}], "parallel": bool}``.

    Nested calls go through the harness runtime with the outer token as
    parent, and are logged through the run's session sink, the way the real
    transport does.
    """

    async def execute(args: Any, ctx: ToolContext) -> Any:
        program = json.loads(args["code"])
        execution = ctx.execution
        sink = execution.agent.lookup(SESSION_SERVICE) if execution.agent is not None else None

        async def one(index: int, item: Mapping[str, Any]) -> Any:
            sub = f"{execution.call_id}:code:{index}"
            if sink is not None:
                await sink.append(
                    "tool/code-dispatch-start",
                    {"name": item["name"], "arguments": item["args"]},
                    root_call_id=execution.root_call_id,
                    parent_call_id=execution.call_id,
                    sub_call_id=sub,
                )
            result = await harness.runtime.execute(
                ToolExecutionInput(
                    call_id=sub,
                    name=item["name"],
                    arguments=item["args"],
                    signal=ctx.signal,
                    agent=execution.agent,
                    parent=execution.token,
                    root_call_id=execution.root_call_id,
                )
            )
            if sink is not None:
                await sink.append(
                    "tool/code-dispatch",
                    {
                        "name": item["name"],
                        "arguments": item["args"],
                        "is_error": result.is_error,
                        "error_code": result.code,
                        "content": result.text,
                    },
                    root_call_id=execution.root_call_id,
                    parent_call_id=execution.call_id,
                    sub_call_id=sub,
                )
            return {"ok": not result.is_error, "code": result.code, "text": result.text}

        items = list(enumerate(program["calls"], start=1))
        if program.get("parallel"):
            out = await asyncio.gather(*(one(i, item) for i, item in items))
        else:
            out = [await one(i, item) for i, item in items]
        return {"logs": [], "result": list(out)}

    return define_tool(
        name="run_code",
        description="Run a test program.",
        parameters={
            "type": "object",
            "required": ["code", "description"],
            "properties": {"code": {"type": "string"}, "description": {"type": "string"}},
        },
        execute=execute,
    )


def program(*items: tuple[str, Any], parallel: bool = False) -> str:
    """A fake-run_code program text."""
    return json.dumps({"calls": [{"name": n, "args": a} for n, a in items], "parallel": parallel})


class ToolsPlugin:
    """Registers the given tools (and any extra hook methods of subclasses)."""

    def __init__(self, tools: Sequence[ToolDefinition]) -> None:
        self.tools = tools

    @hookimpl
    def dsh_register_tools(self, register: Callable[[ToolDefinition], None]) -> None:
        for definition in self.tools:
            register(definition)


async def start(
    tmp_path: Path,
    *,
    tools: Sequence[ToolDefinition] = (),
    turns: Sequence[Mapping[str, Any]] = (),
    mode: str = "native",
    max_turns: int | None = None,
    transport: bool = True,
    plugin: object | None = None,
    agent: Mapping[str, Any] | None = None,
) -> Harness:
    """Boot a harness: the test tools, the scripted provider replaying ``turns``, the SQLite store."""
    script = write_script(tmp_path / "script.jsonl", turns or [final("done")])
    instance = plugin if plugin is not None else ToolsPlugin(tools)
    if plugin is not None and tools:
        instance.tools = tools  # type: ignore[attr-defined]
    row: dict[str, Any] = {"id": "main", "provider": "scripted", **(agent or {})}
    if max_turns is not None:
        row["max_turns"] = max_turns
    deployment = compose(
        [
            (
                "test",
                {
                    "tools": {"mode": mode},
                    "sessions": {"home": str(tmp_path / "home")},
                    "agents": [row],
                    "plugins": [
                        {"id": "tools", "use": "test-tools"},
                        {"id": "scripted", "use": "scripted", "config": {"script": str(script)}},
                        {"id": "sessions", "use": "sqlite-sessions"},
                    ],
                },
            )
        ],
        env={},
    )
    catalog = PluginCatalog(extra={"test-tools": lambda scope, config: instance}, strict=True)
    return await Harness.start(deployment, catalog=catalog, transport=fake_run_code if transport else None)


def scripted(harness: Harness) -> Any:
    """The scripted provider instance of a harness (for its recorded requests)."""
    return harness.providers.get("scripted")
