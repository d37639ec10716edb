"""The ``CodeRuntime`` seam: value types, config, the protocol and the run context.

Code Mode (``dsh_core.codemode``) codes against these names only; the Python
backend lives in :mod:`dsh_core.coderuntime.host`. ``run`` raises only on
misuse (a disposed runtime, invalid bindings); every program outcome is a
field of :class:`CodeRunResult`.
"""

from __future__ import annotations

import contextvars
import keyword
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Final, Literal, Protocol, runtime_checkable

import attrs

from dsh_core.abort import AbortSignal
from dsh_core.bounds import is_positive_seconds
from dsh_core.lossless import JSON

__all__ = [
    "BindingFunction",
    "BindingNamespace",
    "CodeRunError",
    "CodeRunResult",
    "CodeRuntime",
    "CodeRuntimeConfig",
    "ErrorClassSpec",
    "ErrorKind",
    "ERROR_KINDS",
    "ISOLATION_LEVELS",
    "RESERVED_BINDING_GLOBALS",
    "RESERVED_ERROR_MEMBERS",
    "PYTHON_RESERVED_WORDS",
    "RunControl",
    "current_run",
    "validate_bindings",
]

ErrorKind = Literal["exception", "timeout", "abort", "worker-exit", "memory-limit", "invalid-output", "output-limit"]
#: Every terminal failure kind of a run, in a stable order.
ERROR_KINDS: tuple[str, ...] = (
    "exception",
    "timeout",
    "abort",
    "worker-exit",
    "memory-limit",
    "invalid-output",
    "output-limit",
)
#: Accepted values of ``CodeRuntimeConfig.isolation``.
ISOLATION_LEVELS: tuple[str, ...] = ("auto", "L0", "L1", "L2", "L3")

#: Globals the runtime injects itself, and those of the ``__main__`` module the program runs as;
#: a namespace or error class may not use them.
RESERVED_BINDING_GLOBALS = frozenset(
    {
        "console",
        "print",
        "__dsh_main__",
        "__builtins__",
        "__debug__",
        "__name__",
        "__doc__",
        "__package__",
        "__loader__",
        "__spec__",
    }
)
#: Attribute names an error class's member may not shadow.
RESERVED_ERROR_MEMBERS = frozenset({"name", "message", "args", "with_traceback", "add_note"})
#: Python keywords plus the soft keywords ``match``, ``type`` and ``_``.
PYTHON_RESERVED_WORDS = frozenset(keyword.kwlist) | frozenset({"match", "type", "_"})

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
_DUNDER = re.compile(r"^__.+__\Z")

#: A host binding: ``async def f(args: JSON) -> JSON``, or a plain function returning an
#: awaitable of the result. The backend calls it with the decoded arguments as soon as the call
#: arrives; an ``async def`` body then runs in a task of its own, while a plain function runs
#: right there (outside any task) and the ``asyncio.Future`` it returns is awaited without a
#: task, which saves a dispatcher that already owns its tasks two event-loop turns per call.
#: Either way :func:`current_run` names the run. The runtime cancels a call's task, or the future
#: the function returned, when the program cancels the call (its await of the call is cancelled:
#: ``asyncio.wait_for``, ``asyncio.timeout``, ``task.cancel()``; the call gets no reply then), and
#: any call still pending when the run settles (the run's :attr:`RunControl.signal` is aborted
#: first, so a binding can tell the two apart). A raise, a failed awaitable or a non-awaitable
#: return is the program's error.
BindingFunction = Callable[[JSON], Awaitable[JSON]]


def _positive_finite(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"CodeRuntimeConfig.{attribute.name} must be a number, got {value!r}")
    if not is_positive_seconds(value):
        raise ValueError(f"CodeRuntimeConfig.{attribute.name} must be positive and finite, got {value!r}")


def _positive_int(minimum: int, maximum: int | None = None) -> Callable[[Any, attrs.Attribute[Any], Any], None]:
    def check(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"CodeRuntimeConfig.{attribute.name} must be an int, got {value!r}")
        if value < minimum:
            raise ValueError(f"CodeRuntimeConfig.{attribute.name} must be >= {minimum}, got {value!r}")
        if maximum is not None and value > maximum:
            raise ValueError(f"CodeRuntimeConfig.{attribute.name} must be <= {maximum}, got {value!r}")

    return check


# Past these the worker's rlimits cannot be set (the values overflow the kernel's types), and every
# isolation level's probe failed with an exit code that did not say why.
MAX_MEMORY_MB: Final = 1 << 30  # 1 PiB
MAX_CPU_S: Final = 1e9  # about 31 years


def _cpu_budget(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    _positive_finite(instance, attribute, value)
    if value > MAX_CPU_S:
        raise ValueError(f"CodeRuntimeConfig.{attribute.name} must be <= {MAX_CPU_S:g}, got {value!r}")


def _isolation(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value not in ISOLATION_LEVELS:
        raise ValueError(f"CodeRuntimeConfig.isolation must be one of {ISOLATION_LEVELS}, got {value!r}")


def _preload(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, tuple) or not all(isinstance(v, str) for v in value):
        raise ValueError("CodeRuntimeConfig.preload must be a tuple of module names")
    for name in value:
        if not all(part.isidentifier() for part in name.split(".")):
            raise ValueError(f"CodeRuntimeConfig.preload: {name!r} is not a module name")


@attrs.frozen
class CodeRuntimeConfig:
    """Budgets and isolation of a code runtime (never carried by a request).

    ``timeout_s`` is the wall-clock ceiling, ``cpu_s`` the CPU-time budget
    (both end a run as ``timeout``); ``memory_mb`` caps the worker's memory
    (``memory-limit``); ``max_output_bytes`` caps the compact UTF-8 JSON of
    the logs plus the value or failure message (``output-limit``; at least 4,
    the size of ``[]`` plus ``""``), and allows one log entry per 64 bytes of
    it (at least 1,024); ``max_frame_bytes`` caps one inbound
    protocol frame. ``preload`` lists extra installed modules imported before
    lockdown (the config key ``code_runtime.preload``).
    """

    isolation: str = attrs.field(default="auto", validator=_isolation)
    timeout_s: float = attrs.field(default=600.0, validator=_positive_finite)
    cpu_s: float = attrs.field(default=60.0, validator=_cpu_budget)
    memory_mb: int = attrs.field(default=512, validator=_positive_int(1, MAX_MEMORY_MB))
    max_output_bytes: int = attrs.field(default=64 * 1024 * 1024, validator=_positive_int(4))
    max_frame_bytes: int = attrs.field(default=256 * 1024 * 1024 + 65536, validator=_positive_int(1024))
    preload: tuple[str, ...] = attrs.field(default=(), converter=tuple, validator=_preload)


@attrs.frozen
class ErrorClassSpec:
    """The error class a namespace's failed calls raise in the program."""

    name: str = "ToolCallError"
    member: str = "tool_name"


@attrs.frozen
class BindingNamespace:
    """One global of async host functions the program can call."""

    global_name: str
    functions: Mapping[str, BindingFunction]
    error_class: ErrorClassSpec | None = ErrorClassSpec()


@attrs.frozen
class CodeRunError:
    """The single terminal failure of a run."""

    kind: str
    message: str


@attrs.frozen
class CodeRunResult:
    """Ordered logs, the returned value (when ``has_value``), or an error."""

    logs: tuple[str, ...]
    value: JSON = None
    has_value: bool = False
    error: CodeRunError | None = None


@runtime_checkable
class CodeRuntime(Protocol):
    """Runs one program per call in a fresh worker, bridging binding calls to the host."""

    @property
    def language(self) -> str:
        """The program language (``"python"``)."""
        ...

    @property
    def isolation(self) -> str:
        """The isolation actually in force, as an honest descriptor."""
        ...

    async def run(
        self,
        program: str,
        bindings: Sequence[BindingNamespace],
        signal: AbortSignal | None = None,
    ) -> CodeRunResult:
        """Run ``program``; raise only on misuse."""
        ...

    async def aclose(self) -> None:
        """Abort every live run, await every worker; later ``run`` calls raise."""
        ...


class RunControl:
    """What a binding function can reach of the run that called it (see :func:`current_run`)."""

    __slots__ = ("_signal", "_pause", "_resume")

    def __init__(self, signal: AbortSignal, pause: Callable[[], None], resume: Callable[[], None]) -> None:
        self._signal = signal
        self._pause = pause
        self._resume = resume

    @property
    def signal(self) -> AbortSignal:
        """Aborted when the run settles for any reason (or is aborted)."""
        return self._signal

    def pause_wall_clock(self) -> AbstractContextManager[None]:
        """Stop the run's wall-clock budget while held (CPU time still counts).

        For waits that are not the program's doing, e.g. a nested tool call
        waiting for a person's approval. Nesting is allowed.
        """
        return _WallClockPause(self._pause, self._resume)


class _WallClockPause:
    """``RunControl.pause_wall_clock()``: a plain class, not a generator (it wraps each approval wait)."""

    __slots__ = ("_pause", "_resume")

    def __init__(self, pause: Callable[[], None], resume: Callable[[], None]) -> None:
        self._pause = pause
        self._resume = resume

    def __enter__(self) -> None:
        self._pause()

    def __exit__(self, *exc_info: object) -> None:
        self._resume()


_CURRENT: contextvars.ContextVar[RunControl | None] = contextvars.ContextVar("dsh_code_run", default=None)


def current_run() -> RunControl | None:
    """The :class:`RunControl` of the run whose binding call is executing, else None."""
    return _CURRENT.get()


def _set_current(control: RunControl) -> None:
    _CURRENT.set(control)


def _check_name(what: str, name: object) -> str:
    if not isinstance(name, str) or not _IDENTIFIER.match(name):
        raise ValueError(f"{what} {name!r} is not an identifier ([A-Za-z_][A-Za-z0-9_]*)")
    if name in PYTHON_RESERVED_WORDS:
        raise ValueError(f"{what} {name!r} is a Python keyword")
    if name in RESERVED_BINDING_GLOBALS:
        raise ValueError(f"{what} {name!r} is reserved by the code runtime")
    return name


def validate_bindings(
    bindings: Sequence[BindingNamespace],
) -> list[tuple[str, dict[str, BindingFunction], ErrorClassSpec | None]]:
    """Check the misuse rules and snapshot each namespace's functions (own names only)."""
    globals_seen: set[str] = set()
    classes: dict[str, str] = {}
    snapshot: list[tuple[str, dict[str, BindingFunction], ErrorClassSpec | None]] = []
    for namespace in bindings:
        if not isinstance(namespace, BindingNamespace):
            raise TypeError(f"bindings must be BindingNamespace values, got {type(namespace).__name__}")
        name = _check_name("binding global", namespace.global_name)
        if name in globals_seen:
            raise ValueError(f"duplicate binding global {name!r}")
        globals_seen.add(name)
        functions: dict[str, BindingFunction] = {}
        for key, function in dict(namespace.functions).items():
            if not isinstance(key, str):
                raise ValueError(f"binding names must be strings, got {key!r} in {name!r}")
            if not callable(function):
                raise ValueError(f"binding {name}.{key} is not callable")
            functions[key] = function
        spec = namespace.error_class
        if spec is not None:
            _check_name("error class", spec.name)
            member = spec.member
            if not isinstance(member, str) or not member or not member.isidentifier():
                raise ValueError(f"error class member {member!r} must be a non-empty identifier")
            if member in RESERVED_ERROR_MEMBERS or _DUNDER.match(member):
                raise ValueError(f"error class member {member!r} is reserved")
            # Namespaces may share one class (the default ToolCallError), but
            # only with the same member name: it is one class in the program.
            if classes.setdefault(spec.name, member) != member:
                raise ValueError(f"error class {spec.name!r} is declared with two different members")
        snapshot.append((name, functions, spec))
    for class_name in classes:
        if class_name in globals_seen:
            raise ValueError(f"error class {class_name!r} collides with a binding global")
    return snapshot
