"""The ``dsh`` pytest plugin (``pytest11`` entry point): the conformance kit's command line.

``pytest --dsh-conformance=NAME`` (repeatable) runs the shipped suite on the
installed plugin entry point ``NAME``; with no test paths on the command line
only the suite runs. ``--dsh-conformance-config NAME=JSON`` (repeatable) gives
``NAME`` its config; a bare JSON object is the config of every name without one. Authors may instead subclass
:class:`dsh_core.testing.ToolPluginConformance` in their own tests.

This module is imported by every pytest run in an environment where dsh is
installed, so it defines no autouse fixture, changes nothing unless its
options are given, and imports dsh lazily. Opt out with ``-p no:dsh``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pytest

SUITE_MODULE = "dsh_core.testing.suite"
BASE_CLASS = ("dsh_core.testing.conformance", "ToolPluginConformance")
#: Mirrors :data:`dsh_core.testing.conformance.CHECK_ATTRIBUTE` (not imported: this module imports dsh lazily).
CHECK_ATTRIBUTE = "dsh_check"


def seconds(value: str) -> float:
    """An option's value as a positive, finite number of seconds; else :class:`argparse.ArgumentTypeError`.

    argparse prefixes the message with the option's name, and pytest reports it as a usage error
    before any test runs: a bound of 0 or less would fail every call as if each plugin were at
    fault, and NaN or infinity would bound nothing.
    """
    import argparse

    from dsh_core.bounds import is_positive_seconds

    try:
        number = float(value)
    except ValueError:
        number = float("nan")
    if not is_positive_seconds(number):
        raise argparse.ArgumentTypeError(f"{value!r} is not a positive, finite number of seconds")
    return number


def pytest_addoption(parser: pytest.Parser) -> None:
    """Register the ``--dsh-conformance*`` options."""
    group = parser.getgroup("dsh", "dsh plugin conformance kit")
    group.addoption(
        "--dsh-conformance",
        action="append",
        default=[],
        metavar="NAME",
        dest="dsh_conformance",
        help="run the dsh conformance suite on the installed plugin entry point NAME (repeatable)",
    )
    group.addoption(
        "--dsh-conformance-config",
        action="append",
        default=[],
        metavar="[NAME=]JSON",
        dest="dsh_conformance_config",
        help="the config of plugin NAME as a JSON object (repeatable, one per name); without NAME= "
        "the config of every name not given its own; '{tmp}' in strings becomes a temporary "
        "directory",
    )
    # Literals, not dsh_core.testing.checks.ABORT_BOUND_S and CALL_TIMEOUT_S: this module imports dsh lazily (a test
    # ties them to the constants).
    group.addoption(
        "--dsh-conformance-abort-bound",
        default=2.0,
        type=seconds,
        metavar="SECONDS",
        dest="dsh_conformance_abort_bound",
        help="seconds a tool body may take to return after an abort (default 2)",
    )
    group.addoption(
        "--dsh-conformance-call-timeout",
        default=None,
        type=seconds,
        metavar="SECONDS",
        dest="dsh_conformance_call_timeout",
        help="seconds a call may run before the kit stops it (aborts, then cancels it) and fails the check "
        "(default 60)",
    )


def parse_configs(values: list[str], names: list[str]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The ``--dsh-conformance-config`` values: the shared config and the config of each name given its own.

    A value is ``NAME=JSON`` (the config of ``NAME`` only) or a bare JSON object
    (of every name without its own; entry-point names never hold ``=`` and never
    start with ``{``, so the two cannot be confused). Raise :class:`ValueError`
    naming the value at fault: not a JSON object, given twice, or for a name
    ``names`` (the ``--dsh-conformance`` names) does not check, which would be
    silently ignored.
    """
    import json

    shared: dict[str, Any] | None = None
    own: dict[str, dict[str, Any]] = {}
    for value in values:
        name, separator, raw = value.partition("=")
        if not separator or value.lstrip().startswith("{"):
            name, raw = "", value
        name = name.strip()
        where = f"--dsh-conformance-config {value!r}"
        try:
            parsed = json.loads(raw)
        except json.JSONDecodeError as error:
            raise ValueError(f"{where}: not valid JSON ({error}); give a JSON object, or NAME=JSON object") from None
        if not isinstance(parsed, dict):
            raise ValueError(f"{where}: the config must be a JSON object, got {type(parsed).__name__}")
        if not name:
            if shared is not None:
                raise ValueError(
                    f"{where}: a config without NAME= is given twice; give each plugin its own with NAME=JSON"
                )
            shared = parsed
        elif name in own:
            raise ValueError(f"{where}: plugin {name!r} is given a config twice")
        elif name not in names:
            raise ValueError(
                f"{where}: {name!r} is not checked; add --dsh-conformance={name} or fix the name "
                f"(checked: {', '.join(names) or 'none'})"
            )
        else:
            own[name] = parsed
    return shared or {}, own


def config_for(config: pytest.Config, name: str) -> dict[str, Any]:
    """The config ``--dsh-conformance-config`` gives plugin ``name`` (``{}`` when none applies)."""
    shared, own = parse_configs(config.getoption("dsh_conformance_config"), config.getoption("dsh_conformance"))
    return own.get(name, shared)


def pytest_configure(config: pytest.Config) -> None:
    """Register the marker and, with ``--dsh-conformance``, add the shipped suite to the collection."""
    config.addinivalue_line("markers", "dsh_conformance: a dsh plugin conformance check (dsh_core.testing)")
    if not config.getoption("dsh_conformance"):
        if config.getoption("dsh_conformance_config"):
            import pytest

            # Subclass suites take their config from the plugin_config fixture; silently
            # checking with {} instead of what was given would pass or fail the wrong thing.
            raise pytest.UsageError(
                "--dsh-conformance-config applies only to plugins named with "
                "--dsh-conformance; a ConformanceTests subclass takes its config from "
                "its plugin_config fixture"
            )
        return
    import importlib.util

    import pytest

    try:
        # Refused here, before any test runs, rather than as an error in every test of the suite.
        parse_configs(config.getoption("dsh_conformance_config"), config.getoption("dsh_conformance"))
    except ValueError as error:
        raise pytest.UsageError(str(error)) from None
    spec = importlib.util.find_spec(SUITE_MODULE)
    if spec is None or spec.origin is None:
        raise pytest.UsageError(f"--dsh-conformance: cannot find {SUITE_MODULE}")
    if config.args_source == pytest.Config.ArgsSource.ARGS:
        config.args.append(spec.origin)
    else:
        # No paths were given: run only the suite, not the testpaths of the current project.
        config.args[:] = [spec.origin]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize the shipped suite with the ``--dsh-conformance`` names."""
    if metafunc.cls is None or metafunc.cls.__module__ != SUITE_MODULE:
        return
    # A name given twice is checked once (its test ids would otherwise become NAME0, NAME1).
    names = list(dict.fromkeys(metafunc.config.getoption("dsh_conformance")))
    # Without names the parameter set is empty and pytest skips the suite, saying why.
    metafunc.parametrize("dsh_plugin_name", names, ids=names)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every conformance test (shipped suite or subclass) with ``dsh_conformance``, and give it the
    keyword ``dsh:ID`` of its check, so ``-k dsh:typed-errors`` runs the check a failure names."""
    marker = None
    for item in items:
        cls = getattr(item, "cls", None)
        if cls is None or not any((c.__module__, c.__name__) == BASE_CLASS for c in cls.__mro__):
            continue
        if marker is None:
            import pytest

            marker = pytest.mark.dsh_conformance
        item.add_marker(marker)
        # Test names are sentences ("test_errors_are_typed"); the id is what every failure message shows.
        # Looked up along the MRO: a subclass that overrides a check's test (to skip it) keeps its keyword.
        name = getattr(item, "originalname", item.name)
        for owner in cls.__mro__:
            check = getattr(owner.__dict__.get(name), CHECK_ATTRIBUTE, None)
            if isinstance(check, str):
                item.extra_keyword_matches.add(f"dsh:{check}")
                break
