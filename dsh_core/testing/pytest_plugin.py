"""The ``dsh`` pytest plugin (``pytest11`` entry point): the conformance kit's command line.

``pytest --dsh-conformance=NAME`` (repeatable) runs the shipped suite on the
installed plugin entry point ``NAME``; with no test paths on the command line
only the suite runs. Authors may instead subclass
:class:`dsh_core.testing.ToolPluginConformance` in their own tests.

This module is imported by every pytest run in an environment where dsh is
installed, so it defines no autouse fixture, changes nothing unless its
options are given, and imports dsh lazily. Opt out with ``-p no:dsh``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pytest

SUITE_MODULE = "dsh_core.testing.suite"
BASE_CLASS = ("dsh_core.testing.conformance", "ToolPluginConformance")


def pytest_addoption(parser: pytest.Parser) -> None:
    """Register the ``--dsh-conformance*`` options."""
    group = parser.getgroup("dsh", "dsh plugin conformance kit")
    group.addoption("--dsh-conformance", action="append", default=[], metavar="NAME",
                    dest="dsh_conformance",
                    help="run the dsh conformance suite on the installed plugin entry point NAME (repeatable)")
    group.addoption("--dsh-conformance-config", default=None, metavar="JSON", dest="dsh_conformance_config",
                    help="the plugin config as a JSON object; '{tmp}' in strings becomes a temporary directory")
    group.addoption("--dsh-conformance-abort-bound", default=2.0, type=float, metavar="SECONDS",
                    dest="dsh_conformance_abort_bound",
                    help="seconds a tool body may take to return after an abort (default 2)")


def pytest_configure(config: pytest.Config) -> None:
    """Register the marker and, with ``--dsh-conformance``, add the shipped suite to the collection."""
    config.addinivalue_line("markers", "dsh_conformance: a dsh plugin conformance check (dsh_core.testing)")
    if not config.getoption("dsh_conformance"):
        return
    import importlib.util

    import pytest

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
    """Mark every conformance test (shipped suite or subclass) with ``dsh_conformance``."""
    marker = None
    for item in items:
        cls = getattr(item, "cls", None)
        if cls is None or not any((c.__module__, c.__name__) == BASE_CLASS for c in cls.__mro__):
            continue
        if marker is None:
            import pytest

            marker = pytest.mark.dsh_conformance
        item.add_marker(marker)
