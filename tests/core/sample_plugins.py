"""Throwaway plugin factories, loaded through fake entry points by the plugin tests."""

from __future__ import annotations

import sys
from typing import Any

from dsh_core import AbortedError, PreDecision, define_tool, hookimpl, plugin
from dsh_core.model import ToolExecution
from dsh_core.scope import Scope


def _echo(name: str) -> Any:
    async def execute(args: Any, ctx: Any) -> Any:
        return {"said": args.get("text", ""), "by": name}

    return define_tool(
        name=name,
        description=f"Echo through {name}.",
        execute=execute,
        parameters={"type": "object", "properties": {"text": {"type": "string"}}},
        output_schema={"type": "object"},
        is_concurrency_safe=True,
        annotations={"read_only": True},
    )


class EchoPlugin:
    def __init__(self, config: Any) -> None:
        self.tool_name = config.get("tool", "echo")

    @hookimpl
    def dsh_register_tools(self, register: Any) -> None:
        register(_echo(self.tool_name))


@plugin(config_schema={"type": "object", "properties": {"tool": {"type": "string"}}, "additionalProperties": False})
def echo(scope: Scope, config: Any) -> EchoPlugin:
    return EchoPlugin(config)


class DenyPlugin:
    def __init__(self, names: list[str]) -> None:
        self.names = names

    @hookimpl
    def dsh_pre_execute(self, execution: ToolExecution) -> PreDecision | None:
        if execution.name in self.names:
            return PreDecision.deny(f"{execution.name} is denied by config")
        return None


@plugin(
    config_schema={
        "type": "object",
        "properties": {"names": {"type": "array", "items": {"type": "string"}}},
        "required": ["names"],
        "additionalProperties": False,
    }
)
def deny(scope: Scope, config: Any) -> DenyPlugin:
    return DenyPlugin(list(config["names"]))


class HalfBroken:
    """Registers one tool, then fails: nothing may stay registered."""

    @hookimpl
    def dsh_register_tools(self, register: Any) -> None:
        register(_echo("first"))
        register(_echo("first"))


@plugin()
def half_broken(scope: Scope, config: Any) -> HalfBroken:
    scope.on_dispose(lambda: DISPOSED.append("half_broken"))
    return HalfBroken()


DISPOSED: list[str] = []


@plugin()
def noisy(scope: Scope, config: Any) -> None:
    print("hello from a plugin factory", file=sys.stderr)


def not_a_factory_value() -> None:
    raise AssertionError("never called")


raise_on_import = False


@plugin()
async def async_factory(scope: Scope, config: Any) -> DenyPlugin:
    """A plausible mistake: an ``async def`` factory returns a coroutine, not the plugin."""
    return DenyPlugin(["echo"])


class SlowPlugin:
    """A ``slow`` tool that waits for its abort, then reports whether its plugin was still open."""

    def __init__(self, scope: Scope, events: list[str]) -> None:
        self.scope = scope
        self.events = events
        self.open = True
        self.started = 0
        scope.on_dispose(self._close)

    def _close(self) -> None:
        self.open = False
        self.events.append("disposed")

    @hookimpl
    def dsh_register_tools(self, register: Any) -> None:
        async def execute(args: Any, ctx: Any) -> Any:
            self.started += 1
            self.events.append("started")
            await ctx.signal.wait()
            self.events.append(f"aborted: {ctx.signal.reason} (plugin open: {self.open})")
            raise AbortedError(ctx.signal.reason)

        async def close_harness(args: Any, ctx: Any) -> Any:
            await self.scope.lookup("harness").aclose()
            return {"closed": True}

        register(
            define_tool(
                name="slow",
                description="Wait until aborted.",
                execute=execute,
                parameters={"type": "object"},
                output_schema={"type": "object"},
                is_concurrency_safe=True,
            )
        )
        register(
            define_tool(
                name="close_harness",
                description="Close the harness this tool runs in.",
                execute=close_harness,
                parameters={"type": "object"},
                output_schema={"type": "object"},
            )
        )


SLOW_EVENTS: list[str] = []
SLOW_PLUGINS: list[SlowPlugin] = []


@plugin()
def slow(scope: Scope, config: Any) -> SlowPlugin:
    instance = SlowPlugin(scope, SLOW_EVENTS)
    SLOW_PLUGINS.append(instance)
    return instance


class ExitingPlugin:
    """Registers one tool, then calls ``sys.exit(0)`` from its registration hook."""

    @hookimpl
    def dsh_register_tools(self, register: Any) -> None:
        register(_echo("exiting"))
        sys.exit(0)


@plugin()
def exiting(scope: Scope, config: Any) -> ExitingPlugin:
    scope.on_dispose(lambda: DISPOSED.append("exiting"))
    return ExitingPlugin()


class ChattyPlugin:
    """Prints to stdout from every hook it has, as a plugin with debugging left in might."""

    @hookimpl
    def dsh_register_tools(self, register: Any) -> None:
        print("chatty registers its tool")

        async def execute(args: Any, ctx: Any) -> Any:
            print("chatty tool runs")
            return {"said": "hi"}

        register(
            define_tool(
                name="chatty",
                description="Print, then answer.",
                execute=execute,
                parameters={"type": "object"},
                output_schema={"type": "object"},
            )
        )


@plugin()
def chatty(scope: Scope, config: Any) -> ChattyPlugin:
    print("chatty factory runs")
    scope.on_dispose(lambda: print("chatty disposed"))
    return ChattyPlugin()
