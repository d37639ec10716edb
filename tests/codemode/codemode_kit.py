"""Shared helpers of the Code Mode tests: an in-process fake code runtime, tools, sinks, a builder.

The fake runtime implements the ``dsh_core.coderuntime.seam`` contract in
process (it is not a sandbox): the program becomes the body of an
``async def`` with ``tools``, ``ToolCallError`` and ``print`` in scope; values
cross the "boundary" as thawed copies, like the wire would deliver them.
Everything the transport does is exercised through the real
:class:`~dsh_core.runtime.ToolRuntime`; a few end-to-end tests use the real
worker runtime (``test_e2e_worker.py``).
"""

from __future__ import annotations

import ast
import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from dsh_core import hookimpl
from dsh_core.abort import AbortSignal
from dsh_core.codemode.transport import RunCodeTransport
from dsh_core.coderuntime.seam import (
    BindingNamespace,
    CodeRunError,
    CodeRunResult,
    RunControl,
    _set_current,
)
from dsh_core.define import define_tool
from dsh_core.hooks import Hooks
from dsh_core.lossless import JSON, freeze, thaw
from dsh_core.model import ToolDefinition, ToolExecutionInput, ToolResult
from dsh_core.registry import ToolRegistry
from dsh_core.runtime import ToolRuntime
from dsh_core.scope import Scope

# -- the fake code runtime --------------------------------------------------------------------------------


def _compile(program: str) -> Any:
    tree = ast.parse(program, "<program>", "exec")
    nested = ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef
    stack: list[ast.AST] = [node for node in tree.body if not isinstance(node, nested)]
    while stack:  # top-level returns only: nested functions keep theirs
        node = stack.pop()
        if isinstance(node, ast.Return) and node.value is not None:
            node.value = ast.copy_location(ast.List(elts=[node.value], ctx=ast.Load()), node.value)
        stack.extend(child for child in ast.iter_child_nodes(node) if not isinstance(child, nested))
    function = ast.AsyncFunctionDef(
        name="__main__",
        args=ast.arguments(posonlyargs=[], args=[], kwonlyargs=[], kw_defaults=[], defaults=[]),
        body=tree.body or [ast.Pass()],
        decorator_list=[],
        returns=None,
        type_params=[],
    )
    module = ast.Module(body=[function], type_ignores=[])
    ast.fix_missing_locations(module)
    return compile(module, "<program>", "exec")


class _Namespace:
    def __init__(self, functions: Mapping[str, Callable[..., Any]]) -> None:
        self._functions = dict(functions)

    def __getitem__(self, name: str) -> Callable[..., Any]:
        return self._functions[name]

    def __getattr__(self, name: str) -> Callable[..., Any]:
        try:
            return self._functions[name]
        except KeyError:
            raise AttributeError(name) from None


def _check_plain(value: Any) -> None:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict | list) and type(item) not in (dict, list):
            raise AssertionError(f"binding resolved to a {type(item).__name__}, not plain JSON")
        if type(item) is dict:
            stack.extend(item.values())
        elif type(item) is list:
            stack.extend(item)


class FakeCodeRuntime:
    """An in-process ``CodeRuntime`` for transport tests (seam-compatible, not isolated)."""

    isolation = "in-process (test fake)"

    def __init__(self, language: str = "python", *, raise_after_binding: bool = False) -> None:
        self.language = language
        self.raise_after_binding = raise_after_binding
        self.runs = 0
        self.paused = 0
        self.max_paused = 0
        self.binding_tasks: list[asyncio.Task[Any]] = []

    def _pause(self) -> None:
        self.paused += 1
        self.max_paused = max(self.max_paused, self.paused)

    def _resume(self) -> None:
        self.paused -= 1

    async def run(
        self, program: str, bindings: Sequence[BindingNamespace], signal: AbortSignal | None = None
    ) -> CodeRunResult:
        self.runs += 1
        signal = signal or AbortSignal.never()
        logs: list[str] = []
        control = RunControl(signal, self._pause, self._resume)
        scope: dict[str, Any] = {"print": lambda *a, **_k: logs.append(" ".join(str(x) for x in a))}
        for namespace in bindings:
            spec = namespace.error_class
            error_class = type(spec.name if spec else "ToolCallError", (Exception,), {})
            scope[error_class.__name__] = error_class
            functions = {
                name: self._wrap(name, fn, error_class, spec.member if spec else "tool_name", control)
                for name, fn in namespace.functions.items()
            }
            scope[namespace.global_name] = _Namespace(functions)
        if self.raise_after_binding:
            first = next(iter(bindings[0].functions.values()))
            self.binding_tasks.append(asyncio.ensure_future(self._call(first, {}, control)))
            await asyncio.sleep(0.02)  # the call is submitted and its body started
            raise RuntimeError("runtime broke after starting a binding")
        try:
            code = _compile(program)
        except SyntaxError as error:
            return CodeRunResult(tuple(logs), error=CodeRunError("exception", f"SyntaxError: {error}"))
        exec(code, scope)
        task = asyncio.ensure_future(scope["__main__"]())
        aborted = asyncio.ensure_future(signal.wait())
        await asyncio.wait({task, aborted}, return_when=asyncio.FIRST_COMPLETED)
        aborted.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return CodeRunResult(tuple(logs), error=CodeRunError("abort", f"run aborted: {signal.reason}"))
        error = task.exception()
        if error is not None:
            return CodeRunResult(tuple(logs), error=CodeRunError("exception", f"{type(error).__name__}: {error}"))
        value = task.result()
        if value is None:
            return CodeRunResult(tuple(logs))
        return CodeRunResult(tuple(logs), value=freeze(value[0]), has_value=True)

    async def _call(self, function: Callable[[JSON], Any], args: JSON, control: RunControl) -> Any:
        _set_current(control)
        return await function(args)

    def _wrap(
        self, name: str, function: Callable[[JSON], Any], error_class: type[Exception], member: str, control: RunControl
    ) -> Callable[..., Any]:
        async def call(*positional: Any, **kwargs: Any) -> Any:
            args = positional[0] if positional else kwargs
            try:
                # A task per call, like a bridge would: the run context is set there.
                value = await asyncio.ensure_future(self._call(function, args, control))
            except Exception as error:
                raised = error_class(str(error))
                setattr(raised, member, name)
                raise raised from None
            _check_plain(value)  # like the real wire: plain JSON only, no dict/list subclasses
            return value

        return call

    async def aclose(self) -> None:
        return None


# -- sinks and plugins --------------------------------------------------------------------------------


class MemorySink:
    """An in-memory session sink (the ``DispatchLog`` protocol)."""

    def __init__(self, delay: float = 0.0, settle_delay: float = 0.0) -> None:
        self.events: list[dict[str, Any]] = []
        self.delay = delay
        self.settle_delay = settle_delay

    async def append(
        self,
        kind: str,
        payload: Mapping[str, Any],
        *,
        root_call_id: str | None = None,
        parent_call_id: str | None = None,
        sub_call_id: str | None = None,
    ) -> None:
        delay = self.settle_delay if kind == "tool/code-dispatch" else self.delay
        if delay:
            await asyncio.sleep(delay)
        self.events.append(
            {
                "kind": kind,
                "payload": thaw(payload),
                "root_call_id": root_call_id,
                "parent_call_id": parent_call_id,
                "sub_call_id": sub_call_id,
            }
        )

    def kinds(self) -> list[tuple[str, str | None]]:
        return [(e["kind"], e["sub_call_id"]) for e in self.events]


class Recorder:
    """Records every ``dsh_tool_result`` (execution, result)."""

    def __init__(self) -> None:
        self.results: list[tuple[Any, ToolResult]] = []

    @hookimpl
    def dsh_tool_result(self, execution: Any, result: ToolResult) -> None:
        self.results.append((execution, result))


# -- tools --------------------------------------------------------------------------------------------


OBJ = {"type": "object"}


def tool(
    name: str,
    body: Callable[[JSON, Any], Any] | None = None,
    *,
    safe: Any = None,
    parameters: Mapping[str, Any] | None = None,
    output: Mapping[str, Any] | None = None,
    description: str | None = None,
) -> ToolDefinition:
    """A test tool; the default body echoes its arguments."""

    async def default(args: JSON, ctx: Any) -> JSON:
        return args

    return define_tool(
        name=name,
        description=description or f"The {name} tool.",
        parameters=parameters or OBJ,
        execute=body or default,
        output_schema=output,
        is_concurrency_safe=safe,
    )


class Env:
    """A registry, hooks, tool runtime and ``run_code`` transport over a fake (or given) code runtime."""

    def __init__(
        self,
        *,
        mode: str = "code",
        cap: int = 10,
        code_runtime: Any = "fake",
        agent: bool = True,
        sink: MemorySink | None | str = "memory",
    ) -> None:
        self.fake = FakeCodeRuntime() if code_runtime == "fake" else None
        self.code_runtime = self.fake if code_runtime == "fake" else code_runtime
        self.hooks = Hooks()
        self.transport = RunCodeTransport(lambda: self.runtime, lambda: self.code_runtime, max_parallel_sub_calls=cap)
        self.registry = ToolRegistry(default_mode=mode, transport=self.transport.definition)  # type: ignore[arg-type]
        self.runtime = ToolRuntime(self.registry, self.hooks)
        self.root = Scope("root")
        self.agent: Scope | None = self.root.child("agent:main", layered=True) if agent else None
        self.sink = MemorySink() if sink == "memory" else sink
        if self.agent is not None and self.sink is not None:
            self.agent.provide("session", self.sink)
        self._plugins = 0

    def add(self, *definitions: ToolDefinition, scope: Scope | None = None) -> None:
        for definition in definitions:
            self.registry.register(definition, scope=scope)

    def plug(self, plugin: object, scope: Scope | None = None) -> None:
        self._plugins += 1
        self.hooks.register(plugin, name=f"test-plugin-{self._plugins}", scope=scope)

    async def run(
        self,
        code: str,
        *,
        call_id: str = "call-1",
        signal: AbortSignal | None = None,
        description: str = "Run a test program",
        agent: Scope | None | str = "default",
        root_call_id: str | None = None,
    ) -> ToolResult:
        scope = self.agent if agent == "default" else agent
        return await self.runtime.execute(
            ToolExecutionInput(
                call_id=call_id,
                name="run_code",
                arguments={"code": code, "description": description},
                signal=signal or AbortSignal.never(),
                agent=scope,
                root_call_id=root_call_id,
            )
        )  # type: ignore[arg-type]

    async def direct(self, name: str, arguments: Any, *, signal: AbortSignal | None = None) -> ToolResult:
        return await self.runtime.execute(
            ToolExecutionInput(
                call_id="direct-1",
                name=name,
                arguments=arguments,
                signal=signal or AbortSignal.never(),
                agent=self.agent,
            )
        )
