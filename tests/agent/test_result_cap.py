"""What one tool result puts into the conversation is capped (``max_tool_result_chars``)."""

from __future__ import annotations

import re

import pytest

from dsh_core.agent.resultcap import DEFAULT_MAX_TOOL_RESULT_CHARS, cap_tool_text

MARKER = re.compile(r"\[\.\.\. ([\d,]+) characters of this tool result left out \(max_tool_result_chars = (\d+)\); "
                    r"ask for less, e.g\. a narrower query, a range or a limit \.\.\.\]")


def left_out(text: str) -> int:
    found = MARKER.search(text)
    assert found is not None, text[-300:]
    return int(found.group(1).replace(",", ""))


# -- the cut itself -----------------------------------------------------------------------------------------


def test_a_huge_text_keeps_its_head_and_tail_around_a_marker_within_the_cap() -> None:
    text = "".join(f"line {n}\n" for n in range(300_000))  # ≈3.4 M characters
    capped = cap_tool_text(text, 10_000)
    assert len(capped.text) <= 10_000
    head, _, rest = capped.text.partition("\n\n[...")
    marker, _, tail = rest.partition("...]\n\n")
    assert len(head) > 4_000 and len(tail) > 4_000  # both ends are kept, not just the head
    assert text.startswith(head) and text.endswith(tail) and tail.endswith("line 299999\n")
    assert capped.left_out == left_out(capped.text) == len(text) - len(head) - len(tail)
    assert f"{capped.left_out:,} characters" in marker and "max_tool_result_chars = 10000" in marker


@pytest.mark.parametrize("size", [1, 9_999, 10_000])
def test_a_text_up_to_the_cap_is_untouched(size: int) -> None:
    text = "é" * size
    capped = cap_tool_text(text, 10_000)
    assert capped.text is text and capped.left_out == 0


def test_one_character_over_the_cap_is_cut() -> None:
    capped = cap_tool_text("a" * 10_001, 10_000)
    assert capped.left_out > 0 and len(capped.text) <= 10_000 and "[..." in capped.text


@pytest.mark.parametrize("limit", range(150, 420))
def test_the_cut_fits_every_cap_exactly_and_reports_what_it_left_out(limit: int) -> None:
    text = "0123456789" * 1_000
    capped = cap_tool_text(text, limit)
    assert len(capped.text) <= limit
    marker = MARKER.search(capped.text)
    assert marker is not None and left_out(capped.text) == capped.left_out
    kept = len(capped.text) - len(marker.group(0)) - 4
    assert kept + capped.left_out == len(text)
    assert limit - len(capped.text) <= 2  # the cap is used, not wasted (a digit or a comma of slack)


@pytest.mark.parametrize("limit", [1, 5, 40, 100])
def test_a_cap_too_small_for_the_marker_still_holds(limit: int) -> None:
    capped = cap_tool_text("x" * 1_000, limit)
    assert 0 < len(capped.text) <= limit and capped.left_out >= 1_000 - limit


@pytest.mark.parametrize("unit", [
    "\U0001f600",                  # one code point
    "\ud83d\ude00",                # a surrogate pair held as two code points (JSON text decoded by a plugin)
    "e\u0301",                     # a combining accent
    "\U0001f469\u200d\U0001f4bb",  # a ZWJ sequence
    "\U0001f44d\U0001f3fd",        # an emoji with a skin-tone modifier
    "\U0001f1eb\U0001f1f7",        # a flag: two regional indicators
    "\r\n",
    "\u2764\ufe0f",                # a variation selector
])
@pytest.mark.parametrize("limit", [997, 1_000, 1_001, 1_002, 1_003])
def test_the_cut_never_splits_a_surrogate_pair_or_a_grapheme(unit: str, limit: int) -> None:
    text = unit * 2_000
    capped = cap_tool_text(text, limit)
    assert len(capped.text) <= limit
    head, _, rest = capped.text.partition("\n\n[...")
    tail = rest.partition("...]\n\n")[2]
    assert head and tail
    assert len(head) % len(unit) == 0 and head == unit * (len(head) // len(unit))
    assert len(tail) % len(unit) == 0 and tail == unit * (len(tail) // len(unit))
    assert capped.left_out == len(text) - len(head) - len(tail)


def test_endless_marks_or_lone_surrogates_are_cut_a_bounded_distance_from_the_middle() -> None:
    """A grapheme never ends in "Zalgo" text: the cut moves a bounded distance, then cuts between marks."""
    for text in ("\u0301" * 50_000, "\udc00" * 50_000, "\u200d" * 50_000, "\U0001f1eb" * 50_001):
        capped = cap_tool_text(text, 1_000)
        head, _, rest = capped.text.partition("\n\n[...")
        tail = rest.partition("...]\n\n")[2]
        assert len(capped.text) <= 1_000 and capped.left_out == len(text) - len(head) - len(tail)
        assert len(head) > 300 and len(tail) > 300


def test_the_default_is_about_25k_tokens() -> None:
    assert DEFAULT_MAX_TOOL_RESULT_CHARS == 100_000

