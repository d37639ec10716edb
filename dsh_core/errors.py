"""Stable error codes and the exception types that carry them.

Codes are upper-case strings that users, plugins and acceptance checks match
on; they never change meaning. Exceptions raised by tool bodies become error
results: a :class:`DshError` keeps its code, anything else is ``TOOL_FAILED``.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum

__all__ = [
    "describe_callable",
    "describe_exception",
    "ErrorCode",
    "DshError",
    "ToolError",
    "UnknownToolError",
    "InvalidArgsError",
    "InvalidToolOutputError",
    "CodeRunFailedError",
    "DeniedError",
    "SchemaDefinitionError",
    "RegistrationError",
    "ConfigError",
    "PluginLoadError",
    "Violation",
]


class ErrorCode(StrEnum):
    """The stable error codes of dsh results."""

    UNKNOWN_TOOL = "UNKNOWN_TOOL"
    INVALID_ARGS = "INVALID_ARGS"
    INVALID_TOOL_OUTPUT = "INVALID_TOOL_OUTPUT"
    ABORTED_BEFORE_DISPATCH = "ABORTED_BEFORE_DISPATCH"
    ABORTED = "ABORTED"
    DENIED = "DENIED"
    BLOCKED = "BLOCKED"
    TOOL_FAILED = "TOOL_FAILED"
    CODE_RUN_FAILED = "CODE_RUN_FAILED"


class DshError(Exception):
    """Base class of every dsh error that carries a stable code."""

    code: str = ErrorCode.TOOL_FAILED

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code


class ToolError(DshError):
    """Raise from a tool body for a typed, model-readable failure.

    ``raise ToolError("file not found: a.txt")`` gives an error result with
    code ``TOOL_FAILED`` and exactly that message; pass ``code=`` for a more
    specific stable code of your own (upper-case, e.g. ``"NOT_FOUND"``).
    """


class UnknownToolError(DshError):
    """No callable tool of that name for this caller."""

    code = ErrorCode.UNKNOWN_TOOL


class Violation:
    """One schema violation: where (a JSON pointer under ``root``) and what."""

    __slots__ = ("message", "path")

    def __init__(self, path: str, message: str) -> None:
        self.path = path
        self.message = message

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"

    def __repr__(self) -> str:
        return f"Violation({self.path!r}, {self.message!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Violation) and (self.path, self.message) == (other.path, other.message)

    def __hash__(self) -> int:
        return hash((self.path, self.message))


class InvalidArgsError(DshError):
    """Arguments are not lossless JSON or do not match the parameter schema."""

    code = ErrorCode.INVALID_ARGS

    def __init__(self, message: str, violations: Sequence[Violation] = ()) -> None:
        super().__init__(message)
        self.violations = tuple(violations)


class InvalidToolOutputError(DshError):
    """A tool returned a value that is not lossless or does not match its output schema."""

    code = ErrorCode.INVALID_TOOL_OUTPUT

    def __init__(self, message: str, violations: Sequence[Violation] = ()) -> None:
        super().__init__(message)
        self.violations = tuple(violations)


class CodeRunFailedError(DshError):
    """A ``run_code`` program did not complete (its kind says why)."""

    code = ErrorCode.CODE_RUN_FAILED

    def __init__(self, kind: str, message: str, logs: Sequence[str] = ()) -> None:
        text = f"code run failed ({kind}): {message}"
        if logs:
            text += "\nCaptured output:\n" + "\n".join(logs)
        super().__init__(text)
        self.kind = kind
        self.logs = tuple(logs)


class DeniedError(DshError):
    """A policy stage denied the call."""

    code = ErrorCode.DENIED


class SchemaDefinitionError(DshError, ValueError):
    """A tool's or plugin's JSON Schema is not a valid Draft 2020-12 schema."""

    code = "INVALID_SCHEMA"


class RegistrationError(DshError, ValueError):
    """A registration was refused (duplicate name, reserved name, bad definition)."""

    code = "REGISTRATION_REFUSED"


class ConfigError(DshError, ValueError):
    """The deployment configuration is invalid; the message names file, row and path."""

    code = "INVALID_CONFIG"


class PluginLoadError(DshError, RuntimeError):
    """A plugin could not be found, loaded or started; the message names its distribution."""

    code = "PLUGIN_LOAD_FAILED"


def describe_exception(error: BaseException) -> str:
    """``<Type>: <text>``, or ``<Type>`` alone when the text is empty (never raises)."""
    try:
        text = str(error)
    except Exception:
        text = "<unprintable exception>"
    name = type(error).__name__
    return f"{name}: {text}" if text else name


def describe_callable(function: object) -> str:
    """``<module>.<qualified name>`` of a function (a plugin's factory, guard or listener) for messages."""
    name = getattr(function, "__qualname__", None)
    if not isinstance(name, str):
        return repr(function)  # a partial or a callable object: its repr says what it wraps
    module = getattr(function, "__module__", None)
    return f"{module}.{name}" if module else name
