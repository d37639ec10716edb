"""The kit's entry-point lookup (``dsh_core.testing.loader``) against what is installed."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsh_core.plugins import PluginLoadError
from dsh_core.testing import loader


def _installed_distribution(site: Path, name: str, entry_points: str) -> None:
    """A distribution of ``name`` 1.0 installed in ``site``, with ``entry_points`` as its entry_points.txt."""
    info = site / f"{name}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(entry_points)


def test_an_unreadable_distribution_does_not_hide_the_plugin_under_test(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One malformed entry_points.txt of an unrelated package made importlib.metadata.entry_points() raise a bare
    # TypeError: --dsh-conformance=NAME failed for every plugin, naming neither the plugin nor the package.
    site = tmp_path / "site"
    _installed_distribution(site, "unrelated-tool", "[console_scripts]\nno-equals-sign-here\n")
    _installed_distribution(site, "dsh-weather", "[dsh.plugins]\nweather = dsh_weather:plugin\n")
    monkeypatch.syspath_prepend(str(site))
    found = loader.find_entry_point("weather")
    assert (found.name, found.value) == ("weather", "dsh_weather:plugin")


def test_a_plugin_not_found_names_the_distributions_that_could_not_be_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The plugin may be shipped by the distribution whose entry points could not be read: say so.
    site = tmp_path / "site"
    _installed_distribution(site, "dsh-broken-meta", "[dsh.plugins]\nweather\n")
    monkeypatch.syspath_prepend(str(site))
    with pytest.raises(PluginLoadError) as raised:
        loader.find_entry_point("weather")
    message = str(raised.value)
    assert message.startswith("no entry point named 'weather' in group 'dsh.plugins' (installed: ")
    assert "the entry points of these distributions could not be read: dsh-broken-meta 1.0 (" in message
    assert message.endswith("; is the distribution installed?")
