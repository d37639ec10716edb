"""Every place that cuts the middle out of a text the model reads marks it the same way."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest

from dsh_core.agent.resultcap import cap_call_texts, cap_tool_text
from dsh_core.errors import Violation
from dsh_core.schema import MAX_VIOLATION_CHARS, format_violations
from dsh_core.textcut import left_out_marker
from dsh_plugins.bash import _Output

#: ``[... 1,234 bytes left out ...]``, a note allowed before the closing ``...]``.
SHAPE = re.compile(r"\[\.\.\. (\d{1,3}(?:,\d{3})*) (byte|character)s? left out(?: [^\]]+)? \.\.\.\]")


def bash_output() -> tuple[str, int, str]:
    output = _Output(100)
    output.feed(b"a" * 5_000)
    return output.text(), 4_900, "byte"


def tool_result() -> tuple[str, int, str]:
    capped = cap_tool_text("a" * 5_000, 1_000)
    return capped.text, capped.left_out, "character"


def tool_result_at_a_tiny_cap() -> tuple[str, int, str]:
    capped = cap_tool_text("a" * 5_000, 60)  # too small for the full wording: the short marker
    return capped.text, capped.left_out, "character"


def context_message() -> tuple[str, int, str]:
    _, (capped,) = cap_call_texts("short", ["a" * 5_000], 1_000)
    return capped.text, capped.left_out, "character"


def schema_violation() -> tuple[str, int, str]:
    text = format_violations([Violation("/x", "a" * 5_000)])
    return text, len("/x: ") + 5_000 - MAX_VIOLATION_CHARS, "character"


@pytest.mark.parametrize(
    "cut", [bash_output, tool_result, tool_result_at_a_tiny_cap, context_message, schema_violation]
)
def test_every_cut_shows_one_marker_shape_naming_its_count_and_unit(cut: Callable[[], tuple[str, int, str]]) -> None:
    text, left_out, unit = cut()
    found = SHAPE.findall(text)
    assert len(found) == 1, text
    count, named = found[0]
    assert int(count.replace(",", "")) == left_out and named == unit
    assert left_out_marker(left_out, unit)[: -len(" ...]")] in text


@pytest.mark.parametrize(
    ("count", "unit", "note", "marker"),
    [
        (1, "byte", "", "[... 1 byte left out ...]"),
        (0, "byte", "", "[... 0 bytes left out ...]"),
        (1_234_567, "character", "", "[... 1,234,567 characters left out ...]"),
        (42, "character", "of this tool result", "[... 42 characters left out of this tool result ...]"),
    ],
)
def test_the_marker_names_the_count_and_its_unit(count: int, unit: str, note: str, marker: str) -> None:
    assert left_out_marker(count, unit, note) == marker


def test_a_larger_count_never_gives_a_shorter_marker() -> None:
    """What lets a cap that counts its marker size it for the most that could be left out."""
    lengths = [len(left_out_marker(count, "character")) for count in range(1, 20_000)]
    assert lengths == sorted(lengths)
