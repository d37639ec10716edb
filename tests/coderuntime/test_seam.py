"""Seam-level contracts: config validation, binding misuse, reserved names, run context."""

from __future__ import annotations

import types
from typing import Any

import pytest

from dsh_core.coderuntime import (
    BindingNamespace,
    CodeRuntime,
    CodeRuntimeConfig,
    ErrorClassSpec,
    PythonCodeRuntime,
    RuntimeDisposedError,
    current_run,
)
from dsh_core.coderuntime.seam import PYTHON_RESERVED_WORDS, RESERVED_BINDING_GLOBALS, validate_bindings

from .conftest import arun, echo


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("timeout_s", 0),
        ("timeout_s", -1.0),
        ("timeout_s", float("inf")),
        ("timeout_s", float("nan")),
        ("cpu_s", 0.0),
        ("cpu_s", float("inf")),
        ("memory_mb", 0),
        ("memory_mb", 1.5),
        ("memory_mb", True),
        ("max_output_bytes", 3),
        ("max_frame_bytes", 10),
        ("isolation", "L4"),
        ("isolation", "strong"),
        ("preload", ("not a module",)),
    ],
)
def test_config_is_validated_naming_the_field(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=field):
        CodeRuntimeConfig(**{field: value})


def test_config_defaults() -> None:
    config = CodeRuntimeConfig()
    assert (config.isolation, config.timeout_s, config.cpu_s, config.memory_mb) == ("auto", 600.0, 60.0, 512)
    assert config.max_output_bytes == 64 * 1024 * 1024
    assert config.max_frame_bytes > config.max_output_bytes
    assert CodeRuntimeConfig(preload=["json"]).preload == ("json",)  # type: ignore[arg-type]


_DEFAULT = ErrorClassSpec()


def _ns(name: str, error: ErrorClassSpec | None = _DEFAULT) -> BindingNamespace:
    return BindingNamespace(name, {"f": echo}, error)


@pytest.mark.parametrize(
    "bindings",
    [
        [_ns("1tools")],
        [_ns("my-tools")],
        [_ns("")],
        [_ns("class")],
        [_ns("match")],
        [_ns("type")],
        [_ns("_")],
        [_ns("console")],
        [_ns("print")],
        [_ns("__builtins__")],
        [_ns("__dsh_main__")],
        [_ns("__name__")],
        [_ns("__debug__")],
        [_ns("tools"), _ns("tools")],
        [_ns("tools", ErrorClassSpec("tools"))],
        [_ns("a"), _ns("tools", ErrorClassSpec("a"))],
        [_ns("tools", ErrorClassSpec("for"))],
        [_ns("tools", ErrorClassSpec("console"))],
        [_ns("tools", ErrorClassSpec(member=""))],
        [_ns("tools", ErrorClassSpec(member="__x__"))],
        [_ns("tools", ErrorClassSpec(member="args"))],
        [_ns("tools", ErrorClassSpec(member="message"))],
        [_ns("tools", ErrorClassSpec(member="name"))],
        [_ns("tools", ErrorClassSpec(member="with_traceback"))],
        [_ns("tools", ErrorClassSpec(member="add_note"))],
        [_ns("a", ErrorClassSpec("E", "x")), _ns("b", ErrorClassSpec("E", "y"))],
    ],
)
def test_invalid_bindings_raise_from_run(bindings: list[BindingNamespace]) -> None:
    with pytest.raises(ValueError):
        validate_bindings(bindings)

    async def go() -> None:
        runtime = PythonCodeRuntime(CodeRuntimeConfig(isolation="L0"))
        try:
            await runtime.run("return 1", bindings)
        finally:
            await runtime.aclose()

    with pytest.raises(ValueError):
        arun(go())


def test_valid_bindings_share_the_default_error_class() -> None:
    snap = validate_bindings([_ns("tools"), _ns("more"), _ns("plain", None)])
    assert [name for name, _, _ in snap] == ["tools", "more", "plain"]


def test_reserved_sets() -> None:
    assert {"match", "type", "_", "class", "await", "None"} <= PYTHON_RESERVED_WORDS
    assert {"console", "print", "__dsh_main__", "__builtins__", "__debug__"} <= RESERVED_BINDING_GLOBALS
    # Every global of the __main__ module the program runs as: a namespace must not replace one.
    assert set(types.ModuleType("__main__").__dict__) <= RESERVED_BINDING_GLOBALS
    for name in ("__spec__", "__loader__", "__doc__", "__package__"):
        with pytest.raises(ValueError, match=f"'{name}' is reserved by the code runtime"):
            validate_bindings([_ns(name)])


def test_descriptors_and_protocol() -> None:
    runtime = PythonCodeRuntime(CodeRuntimeConfig(isolation="L0"))
    assert isinstance(runtime, CodeRuntime)
    assert runtime.language == "python"
    assert runtime.isolation.startswith("L0 ") and "[host-verified kuid=" in runtime.isolation
    assert current_run() is None


def test_disposed_runtime_raises() -> None:
    async def go() -> None:
        runtime = PythonCodeRuntime(CodeRuntimeConfig(isolation="L0"))
        await runtime.aclose()
        with pytest.raises(RuntimeDisposedError):
            await runtime.run("return 1", [])

    arun(go())


def test_start_describes_the_isolation_without_blocking_and_serves_the_first_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def go() -> None:
        runtime = PythonCodeRuntime(CodeRuntimeConfig(isolation="L1"))

        def no_blocking_detection() -> None:
            raise AssertionError("isolation was detected in a blocking thread")

        monkeypatch.setattr(runtime, "_detect_blocking", no_blocking_detection)
        try:
            described = await runtime.start()
            assert described.startswith("L1 ") and "[host-verified kuid=" in described
            assert runtime.isolation == described and runtime.level == 1
            zygote = runtime._zygote
            assert zygote is not None and zygote.alive
            assert await runtime.start() == described  # idempotent: the same zygote
            assert runtime._zygote is zygote
            result = await runtime.run("return 1", [])
            assert result.value == 1 and runtime._zygote is zygote
        finally:
            await runtime.aclose()
        with pytest.raises(RuntimeDisposedError):
            await runtime.start()

    arun(go())


def test_program_warnings_are_captured_and_foreign_ones_given_back(recwarn: pytest.WarningsRecorder) -> None:
    # build() captures the program's compile warnings for the worker to show; a warning
    # that is not the program's (another thread, same process-wide filters) is re-issued.
    import threading
    import warnings as warnings_module

    from dsh_core.coderuntime.worker import program as programs

    warned: list[str] = []
    original = compile
    foreign = threading.Event()

    def compile_and_warn(*args: Any, **kwargs: Any) -> Any:
        if not foreign.is_set():
            foreign.set()
            warnings_module.warn_explicit("host-side", UserWarning, "host.py", 7)
        return original(*args, **kwargs)

    programs.__dict__["compile"] = compile_and_warn  # shadows the builtin inside the module only
    try:
        programs.build("x = 1\nif x is 1:\n    pass", warned)
    finally:
        del programs.__dict__["compile"]
    assert len(warned) == 1 and warned[0].startswith('<program>:2: SyntaxWarning: "is" with a literal')
    assert [str(w.message) for w in recwarn.list] == ["host-side"]
