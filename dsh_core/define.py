"""``define_tool``: the one way to build a :class:`~dsh_core.model.ToolDefinition`."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, overload

from dsh_core.errors import SchemaDefinitionError
from dsh_core.lossless import JSON, NotLosslessError, freeze
from dsh_core.model import (
    ContentBlock,
    ToolContext,
    ToolDefinition,
    ToolExecution,
    ToolOutput,
    ToolResult,
    render_json,
)
from dsh_core.schema import check_schema, compile_validator, fast_check, format_violations, violations

__all__ = ["define_tool"]

Execute = Callable[[JSON, ToolContext], Awaitable[JSON]]
Render = Callable[[JSON, JSON], "Sequence[ContentBlock] | str"]
Finalize = Callable[[ToolExecution, ToolResult], "Sequence[ContentBlock] | None"]


@overload
def define_tool(
    *,
    name: str,
    description: str,
    parameters: Mapping[str, Any],
    execute: Execute,
    output_schema: Mapping[str, Any] | None = ...,
    render: Render | None = ...,
    is_concurrency_safe: Callable[[JSON], object] | bool | None = ...,
    finalize_content: Finalize | None = ...,
    examples: Sequence[JSON] = ...,
    annotations: Mapping[str, JSON] | None = ...,
) -> ToolDefinition: ...


@overload
def define_tool(
    *,
    name: str,
    description: str,
    parameters: Mapping[str, Any],
    execute: None = ...,
    output_schema: Mapping[str, Any] | None = ...,
    render: Render | None = ...,
    is_concurrency_safe: Callable[[JSON], object] | bool | None = ...,
    finalize_content: Finalize | None = ...,
    examples: Sequence[JSON] = ...,
    annotations: Mapping[str, JSON] | None = ...,
) -> Callable[[Execute], ToolDefinition]: ...


def define_tool(
    *,
    name: str,
    description: str,
    parameters: Mapping[str, Any],
    execute: Execute | None = None,
    output_schema: Mapping[str, Any] | None = None,
    render: Render | None = None,
    is_concurrency_safe: Callable[[JSON], object] | bool | None = None,
    finalize_content: Finalize | None = None,
    examples: Sequence[JSON] = (),
    annotations: Mapping[str, JSON] | None = None,
) -> ToolDefinition | Callable[[Execute], ToolDefinition]:
    """Build a checked tool definition (or, without ``execute``, a decorator for the body).

    ``parameters`` and ``output_schema`` must be valid Draft 2020-12 schemas
    (``parameters`` an object schema; ``output_schema`` defaults to ``{}``,
    any JSON). Both are compiled once, here. ``render(args, value)`` makes the
    model-facing content (default: a string raw, anything else as one line of
    compact JSON). ``is_concurrency_safe`` may be ``True``/``False`` or a pure function
    of the arguments; only an exact ``True`` lets calls overlap. ``examples``
    are argument objects, checked against ``parameters`` now and used by the
    conformance kit. ``annotations`` are hints for policies (``read_only``,
    ``workspace_confined``), never shown to the model. ``render``,
    ``finalize_content`` and ``is_concurrency_safe`` are called, never
    awaited: ``async def`` ones are refused.

    >>> @define_tool(name="echo", description="Echo text.",
    ...              parameters={"type": "object", "properties": {"text": {"type": "string"}}})
    ... async def echo(args, ctx):
    ...     return args["text"]
    """
    if execute is None:

        def decorate(function: Execute) -> ToolDefinition:
            return define_tool(
                name=name,
                description=description,
                parameters=parameters,
                execute=function,
                output_schema=output_schema,
                render=render,
                is_concurrency_safe=is_concurrency_safe,
                finalize_content=finalize_content,
                examples=examples,
                annotations=annotations,
            )

        return decorate

    owner = f'tool "{name}"'
    if not isinstance(name, str) or not name:
        raise SchemaDefinitionError(f"tool name must be a non-empty string, got {name!r}")
    if not isinstance(description, str) or not description.strip():
        raise SchemaDefinitionError(f"{owner}: description must be a non-empty string")
    if not callable(execute):
        raise SchemaDefinitionError(f"{owner}: execute must be an async function")
    if inspect.isasyncgenfunction(execute):  # its call returns no awaitable: every call would fail
        raise SchemaDefinitionError(
            f"{owner}: execute is an async generator function (it yields); a tool's "
            "execute returns one value: return it instead of yielding it"
        )
    # Checked here, naming the tool: accepted, each would fail every later call of the tool instead.
    for option, value in (("render", render), ("finalize_content", finalize_content)):
        if value is not None and not callable(value):
            raise SchemaDefinitionError(f"{owner}: {option} must be a function, got {type(value).__name__}")
    if not (is_concurrency_safe is None or isinstance(is_concurrency_safe, bool) or callable(is_concurrency_safe)):
        raise SchemaDefinitionError(
            f"{owner}: is_concurrency_safe must be True, False or a function, got {type(is_concurrency_safe).__name__}"
        )
    # Called, never awaited: an async one would hand dsh a coroutine where it expects content or a verdict.
    synchronous: tuple[tuple[str, object], ...] = (
        ("render", render),
        ("finalize_content", finalize_content),
        ("is_concurrency_safe", is_concurrency_safe),
    )
    for option, hook in synchronous:
        # An object whose __call__ is async def is called the same way, and as unawaited.
        call = (
            inspect.getattr_static(type(hook), "__call__", None)
            if hook is not None and not inspect.isroutine(hook)
            else None
        )
        if any(inspect.iscoroutinefunction(f) or inspect.isasyncgenfunction(f) for f in (hook, call)):
            raise SchemaDefinitionError(
                f"{owner}: {option} is async def, but dsh calls it synchronously and "
                "never awaits what it returns: make it a plain def"
            )
    try:
        frozen_annotations = freeze(dict(annotations or {}))
    except NotLosslessError as error:
        raise SchemaDefinitionError(f"{owner} annotations: {error}") from None
    check_schema(parameters, owner=f"{owner} parameters")
    if parameters.get("type") != "object":
        raise SchemaDefinitionError(f'{owner} parameters: the root schema must have "type": "object"')
    output = {} if output_schema is None else output_schema
    check_schema(output, owner=f"{owner} output schema")
    # Everything below (validators, fast checks, the model-facing schema) comes from one detached,
    # immutable copy: a later change to the caller's dict must not change what the tool accepts.
    parameters, output = freeze(parameters), freeze(output)
    parameters_validator = compile_validator(parameters)
    frozen_examples: list[JSON] = []
    for index, example in enumerate(examples):
        try:
            frozen = freeze(example)
        except NotLosslessError as error:
            raise SchemaDefinitionError(f"{owner} examples[{index}]: {error}") from None
        found = violations(parameters_validator, frozen)
        if found:
            raise SchemaDefinitionError(
                f"{owner} examples[{index}] does not match the parameters: {format_violations(found)}"
            )
        frozen_examples.append(frozen)
    safe: Callable[[JSON], object] | None
    if isinstance(is_concurrency_safe, bool):
        constant = is_concurrency_safe
        safe = lambda _args: constant  # noqa: E731 - a constant classifier
    else:
        safe = is_concurrency_safe
    return ToolDefinition(
        name=name,
        description=description,
        parameters=parameters,
        output=ToolOutput(output, render or render_json),
        execute=execute,
        is_concurrency_safe=safe,
        finalize_content=finalize_content,
        examples=tuple(frozen_examples),
        annotations=frozen_annotations,
        parameters_validator=parameters_validator,
        output_validator=compile_validator(output),
        parameters_check=fast_check(parameters),
        output_check=fast_check(output),
    )
