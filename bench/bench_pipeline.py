"""Benchmark the tool pipeline (issue 2). Not a test: run it and copy the figures into the README.

    .venv/bin/python bench/bench_pipeline.py

1. A model-direct call of a trivial tool through the whole pipeline with 5 hook
   implementations in every stage (pre-execute, guard, around-dispatch,
   post-execute, result observers), against calling the tool body directly.
2. ``wire_schemas()`` for one agent and execution resolution with 100 / 1,000 /
   10,000 registered tools and 1,000 agent scopes.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from typing import Any

from dsh_core import define_tool, hookimpl
from dsh_core.abort import AbortSignal
from dsh_core.hooks import Hooks
from dsh_core.model import ToolExecution, ToolExecutionInput, ToolResult
from dsh_core.registry import ToolRegistry
from dsh_core.runtime import ToolRuntime
from dsh_core.scope import Scope

CALLS = 20_000


async def _body(args: Any, ctx: Any) -> Any:
    return {"ok": True}


def trivial(name: str = "trivial") -> Any:
    return define_tool(
        name=name,
        description="A trivial tool.",
        execute=_body,
        parameters={"type": "object", "properties": {"x": {"type": "integer"}}},
        output_schema={"type": "object"},
    )


class FiveStagePlugin:
    """One implementation of every per-call stage, doing nothing (the framework's own cost)."""

    @hookimpl
    def dsh_pre_execute(self, execution: ToolExecution) -> None:
        return None

    @hookimpl
    def dsh_guard(self, execution: ToolExecution) -> None:
        return None

    @hookimpl
    def dsh_around_dispatch(self, execution: ToolExecution) -> Any:
        return _passthrough

    @hookimpl
    def dsh_post_execute(self, execution: ToolExecution, result: ToolResult) -> None:
        return None

    @hookimpl
    def dsh_tool_result(self, execution: ToolExecution, result: ToolResult) -> None:
        return None


async def _passthrough(call: ToolExecution, proceed: Any) -> ToolResult:
    return await proceed(call)  # type: ignore[no-any-return]


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def bench_call() -> dict[str, float]:
    hooks, registry = Hooks(), ToolRegistry()
    runtime = ToolRuntime(registry, hooks)
    definition = trivial()
    registry.register(definition)
    for index in range(5):
        hooks.register(FiveStagePlugin(), name=f"plugin-{index}")
    signal = AbortSignal.never()
    pipeline: list[float] = []
    direct: list[float] = []
    clock = time.perf_counter_ns
    for index in range(CALLS + 1000):
        request = ToolExecutionInput(call_id=f"c{index}", name="trivial", arguments={"x": index}, signal=signal)
        started = clock()
        result = await runtime.execute(request)
        elapsed = clock() - started
        assert not result.is_error, result
        if index >= 1000:  # warm-up
            pipeline.append(elapsed / 1000)
    for index in range(CALLS + 1000):
        started = clock()
        await definition.execute({"x": index}, None)
        elapsed = clock() - started
        if index >= 1000:
            direct.append(elapsed / 1000)
    return {
        "pipeline_median_us": statistics.median(pipeline),
        "pipeline_p99_us": percentile(pipeline, 0.99),
        "direct_median_us": statistics.median(direct),
        "direct_p99_us": percentile(direct, 0.99),
    }


def bench_scale(tool_count: int, agent_count: int = 1000) -> dict[str, float]:
    registry = ToolRegistry()
    root = Scope()
    for index in range(tool_count):
        registry.register(trivial(f"tool_{index}"))
    agents = [root.child(f"agent:{index}", layered=True) for index in range(agent_count)]
    for index, agent in enumerate(agents[:100]):
        registry.register(trivial(f"own_{index}"), scope=agent)
    agent = agents[len(agents) // 2]
    registry.wire_schemas(agent)  # the first call builds and caches the view
    clock = time.perf_counter_ns
    rounds = 2000
    started = clock()
    for _ in range(rounds):
        registry.wire_schemas(agent)
    wire_us = (clock() - started) / rounds / 1000
    names = [f"tool_{index}" for index in range(0, tool_count, max(1, tool_count // 50))]
    started = clock()
    for _ in range(rounds // len(names) + 1):
        for name in names:
            registry.resolve_execution(name, agent, False)
    resolutions = (rounds // len(names) + 1) * len(names)
    resolve_us = (clock() - started) / resolutions / 1000
    started = clock()
    registry.register(trivial("late"))
    registry.wire_schemas(agent)
    rebuild_ms = (clock() - started) / 1e6
    return {"wire_schemas_us": wire_us, "resolve_us": resolve_us, "view_rebuild_ms": rebuild_ms}


def main() -> None:
    print(f"python {sys.version.split()[0]}, {CALLS} calls")
    call = asyncio.run(bench_call())
    print("\n| model-direct call, 5 hook impls per stage | median µs | p99 µs |")
    print("| --- | ---: | ---: |")
    print(f"| whole pipeline | {call['pipeline_median_us']:.1f} | {call['pipeline_p99_us']:.1f} |")
    print(f"| tool body called directly | {call['direct_median_us']:.2f} | {call['direct_p99_us']:.2f} |")
    print(f"| pipeline overhead (median) | {call['pipeline_median_us'] - call['direct_median_us']:.1f} | |")
    print(
        "\n| registered tools (1,000 agent scopes) | wire_schemas() µs | resolve_execution() µs | "
        "view rebuild after a change ms |"
    )
    print("| ---: | ---: | ---: | ---: |")
    for count in (100, 1000, 10000):
        scale = bench_scale(count)
        print(
            f"| {count:,} | {scale['wire_schemas_us']:.2f} | {scale['resolve_us']:.2f} | "
            f"{scale['view_rebuild_ms']:.2f} |"
        )


if __name__ == "__main__":
    main()
