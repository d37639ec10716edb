"""``ToolPluginConformance``: the conformance suite as one base class to subclass.

::

    from dsh_core.testing import ToolPluginConformance

    class TestMyPlugin(ToolPluginConformance):
        plugin_name = "my-plugin"          # the entry-point name in group dsh.plugins

        @pytest.fixture
        def plugin_config(self, tmp_path):  # optional: the config the plugin is started with
            return {"database": str(tmp_path / "db.sqlite")}

Every test loads the installed entry point in strict mode into a fresh
pipeline that sees no other plugin, and each failure names the check, the
tool and the fix. See :mod:`dsh_core.testing.checks` for what is checked.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import pytest

from dsh_core.bounds import is_positive_seconds
from dsh_core.testing import checks
from dsh_core.testing.checks import Target
from dsh_core.testing.loader import load_factory

__all__ = ["CHECK_ATTRIBUTE", "ToolPluginConformance", "bound_problem", "make_target"]


def _substitute(value: Any, tmp: str) -> Any:
    if isinstance(value, str):
        return value.replace("{tmp}", tmp)
    if isinstance(value, list):
        return [_substitute(v, tmp) for v in value]
    if isinstance(value, dict):
        return {k: _substitute(v, tmp) for k, v in value.items()}
    return value


def bound_problem(value: object) -> str | None:
    """Why ``value`` is no positive, finite number of seconds (as the kit's ``SECONDS`` options take), or ``None``.

    A bound of 0 or less would fail every call (or body) as if the plugin were at fault, and NaN or
    infinity would bound nothing; a bool or a string is no number of seconds, whatever it spells.
    """
    # The options' own rule (:func:`~dsh_core.testing.pytest_plugin.seconds`), so a subclass and the command line agree.
    return None if is_positive_seconds(value) else f"{value!r} is not a positive, finite number of seconds"


def make_target(
    name: str,
    config: dict[str, Any],
    tmp_path: Path,
    *,
    abort_bound_s: float = checks.ABORT_BOUND_S,
    require_examples: bool = True,
    call_timeout_s: float | None = None,
) -> Target:
    """The :class:`Target` of one test: ``{tmp}`` in config strings becomes a fresh directory, and a
    plugin whose config schema has a ``root`` property gets that directory as ``root`` unless given one.

    ``abort_bound_s`` and ``call_timeout_s`` (unless ``None``) must be positive, finite numbers of
    seconds, else :class:`ValueError` names the parameter and the value.
    """
    for keyword, value in (("abort_bound_s", abort_bound_s), ("call_timeout_s", call_timeout_s)):
        problem = None if value is None and keyword == "call_timeout_s" else bound_problem(value)
        if problem is not None:
            raise ValueError(f"make_target: {keyword} = {problem}")
    tmp = tmp_path / "dsh-conformance"
    tmp.mkdir(exist_ok=True)
    prepared: dict[str, Any] = _substitute(config, os.fspath(tmp))
    if "root" not in prepared:
        try:
            _, factory = load_factory(name)
        except Exception:
            factory = None  # the entry-point check reports it
        schema = getattr(factory, "config_schema", None) or {}
        properties = schema.get("properties") if isinstance(schema, dict) else None
        if isinstance(properties, dict) and "root" in properties:
            prepared["root"] = os.fspath(tmp)
    return Target(
        name=name,
        config=prepared,
        abort_bound_s=abort_bound_s,
        require_examples=require_examples,
        call_timeout_s=call_timeout_s,
    )


#: The attribute of each test method that names its check (a ``dsh:ID`` keyword: ``-k dsh:ID`` selects it).
CHECK_ATTRIBUTE = "dsh_check"

_Test = TypeVar("_Test", bound=Callable[..., None])


def _check(check_id: str) -> Callable[[_Test], _Test]:
    def mark(test: _Test) -> _Test:
        setattr(test, CHECK_ATTRIBUTE, check_id)
        return test

    return mark


def _verify(check: Callable[[Target], list[str]], target: Target) -> None:
    failures = check(target)
    if failures:
        pytest.fail("\n".join(failures), pytrace=False)


class ToolPluginConformance:
    """Subclass with ``plugin_name = "<entry point>"`` to run every dsh conformance check on a plugin.

    Class attributes: ``abort_bound_s`` (seconds a body may take to return
    after its call is aborted, default 2), ``call_timeout_s`` (seconds a call
    may run before the kit stops it and fails the check, default ``None``:
    :data:`dsh_core.testing.checks.CALL_TIMEOUT_S`), both positive, finite
    numbers (else every test of the class errors, naming the attribute), and
    ``require_examples`` (every tool must declare examples, default ``True``). Fixtures to override:
    ``plugin_config`` (the config, default ``{}``; ``{tmp}`` in strings is
    replaced by a temporary directory, and a ``root`` property of the config
    schema defaults to it) and ``dsh_plugin_name``.

    The kit calls every tool with its examples, in registration order, then
    with variants (strings emptied, numbers zeroed): point the config at
    scratch resources only.
    """

    plugin_name: ClassVar[str | None] = None
    abort_bound_s: ClassVar[float] = checks.ABORT_BOUND_S
    call_timeout_s: ClassVar[float | None] = None
    require_examples: ClassVar[bool] = True

    @pytest.fixture
    def dsh_plugin_name(self) -> str:
        """The entry-point name under test (``plugin_name``)."""
        if not self.plugin_name:
            pytest.fail(f"{type(self).__name__}: set plugin_name = '<entry point name in dsh.plugins>'", pytrace=False)
        return self.plugin_name

    @pytest.fixture
    def plugin_config(self) -> dict[str, Any]:
        """The config the plugin is started with (override in a subclass)."""
        return {}

    def _seconds(self, attribute: str) -> Any:
        """The class attribute ``attribute``, failing the test (naming the class) unless it is a bound."""
        value = getattr(self, attribute)
        problem = bound_problem(value)
        if problem is not None:
            pytest.fail(f"{type(self).__name__}.{attribute} = {problem}", pytrace=False)
        return value

    @pytest.fixture
    def dsh_abort_bound_s(self) -> float:
        """Seconds a tool body may take to return after an abort (``abort_bound_s``, vetted)."""
        return float(self._seconds("abort_bound_s"))

    @pytest.fixture
    def dsh_call_timeout_s(self) -> float | None:
        """Seconds a call may run before the kit stops it (``call_timeout_s``, vetted; ``None``: the kit's default)."""
        return None if self.call_timeout_s is None else float(self._seconds("call_timeout_s"))

    @pytest.fixture
    def dsh_target(
        self,
        dsh_plugin_name: str,
        plugin_config: dict[str, Any],
        dsh_abort_bound_s: float,
        dsh_call_timeout_s: float | None,
        tmp_path: Path,
    ) -> Target:
        """What the checks run on."""
        return make_target(
            dsh_plugin_name,
            plugin_config,
            tmp_path,
            abort_bound_s=dsh_abort_bound_s,
            require_examples=self.require_examples,
            call_timeout_s=dsh_call_timeout_s,
        )

    @_check("entry-point")
    def test_entry_point_loads_strictly_and_alone(self, dsh_target: Target) -> None:
        """The entry point loads in strict mode and the plugin starts and stops in a fresh pipeline."""
        _verify(checks.check_entry_point, dsh_target)

    @_check("stdout")
    def test_load_writes_nothing_to_stdout(self, dsh_target: Target) -> None:
        """Import, start and dispose in a fresh interpreter print nothing on stdout."""
        _verify(checks.check_stdout, dsh_target)

    @_check("config-schema")
    def test_config_schema_is_valid(self, dsh_target: Target) -> None:
        """The config schema is valid Draft 2020-12 and the config matches it."""
        _verify(checks.check_config_schema, dsh_target)

    @_check("tool-schemas")
    def test_tool_schemas_are_valid(self, dsh_target: Target) -> None:
        """Parameter and output schemas are valid Draft 2020-12; descriptions are not blank."""
        _verify(checks.check_tool_schemas, dsh_target)

    @_check("tool-names")
    def test_tool_names_are_unique_valid_and_not_reserved(self, dsh_target: Target) -> None:
        """Names are unique, match [A-Za-z0-9_-]{1,64} and are not run_code; no refused registration is swallowed."""
        _verify(checks.check_tool_names, dsh_target)

    @_check("examples")
    def test_examples_validate_and_round_trip(self, dsh_target: Target) -> None:
        """Examples exist, validate and round-trip through freeze and the cattrs converter."""
        _verify(checks.check_examples, dsh_target)

    @_check("example-calls")
    def test_example_calls_return_lossless_json_matching_output_schema(self, dsh_target: Target) -> None:
        """Calling each tool with its examples succeeds with lossless JSON matching its output schema."""
        _verify(checks.check_example_calls, dsh_target)

    @_check("pre-abort")
    def test_pre_aborted_call_never_runs_the_body(self, dsh_target: Target) -> None:
        """A pre-aborted call gives ABORTED_BEFORE_DISPATCH without running the body."""
        _verify(checks.check_pre_abort, dsh_target)

    @_check("abort")
    def test_abort_mid_call_is_honoured(self, dsh_target: Target) -> None:
        """A body returns within the bound after its call is aborted."""
        _verify(checks.check_abort, dsh_target)

    @_check("concurrency-safe")
    def test_is_concurrency_safe_is_pure_and_boolean(self, dsh_target: Target) -> None:
        """is_concurrency_safe is declared, returns a bool, and is stable."""
        _verify(checks.check_concurrency_safe, dsh_target)

    @_check("typed-errors")
    def test_errors_are_typed(self, dsh_target: Target) -> None:
        """Bodies raise only typed errors and return valid output, for examples and edge variants."""
        _verify(checks.check_typed_errors, dsh_target)

    @_check("dispose")
    def test_dispose_unregisters_everything_and_quiesces(self, dsh_target: Target) -> None:
        """After dispose nothing stays registered and no task, thread or process runs."""
        _verify(checks.check_dispose, dsh_target)

    @_check("hookimpls")
    def test_hookimpls_are_well_formed(self, dsh_target: Target) -> None:
        """Hook implementations: known hooks, no defaults, no wrappers, no async on first-result hooks."""
        _verify(checks.check_hookimpls, dsh_target)
