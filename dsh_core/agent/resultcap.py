"""How much of one tool result the model sees (an agent's ``max_tool_result_chars``).

Built-in tools cap their own output, but nothing stops a third-party tool from
returning megabytes; sent whole, the next model request fails as
``context-length`` and the run dies of one plugin's verbosity. The agent loop
therefore sends a result longer than the cap as its head and its tail around a
marker saying how many characters were left out and how to get less (the
shape every cut of a text the model reads shows, :mod:`dsh_core.textcut`).

A result's context messages (``ContextMessage``, sent as user messages after
the results) are a second way to flood the conversation, so they are capped
too, and by the same budget: the cap bounds what one tool call adds to the
conversation, the result's text and all its context messages together
(:func:`cap_call_texts`). A cap per message would not: a plugin deferring a
thousand contexts would still add a thousand caps. The budget is split
max-min fairly (water-filling): a text within its fair share is sent whole
and the longer ones split what it leaves equally, so a small context next to
a huge result is untouched and a flood of contexts cannot starve the result.

The cut never separates a surrogate pair, and it is moved into the left-out
part (so the result is never longer than the cap) rather than start or end
a kept part inside a grapheme of the common kinds: a character and its
combining marks, a zero-width-joiner sequence, an emoji modifier, a
variation selector, a flag's two regional indicators, ``\\r\\n``. This
approximates UAX #29, it does not implement it: Hangul jamo, emoji tag
sequences (a subdivision flag) and Indic conjuncts may still be cut, which
leaves valid text all the same.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable, Sequence
from typing import Final

from attrs import frozen

from dsh_core.textcut import left_out_marker

__all__ = ["DEFAULT_MAX_TOOL_RESULT_CHARS", "CappedText", "cap_call_texts", "cap_tool_text", "cut_marker", "shares"]

#: The cap of an agent whose row sets no ``max_tool_result_chars``: about 25,000 tokens (4 characters a
#: token), a fraction of the context of every current model (the smallest in common use hold 128k tokens),
#: leaving room for the system prompt, the tool schemas and several such results in one conversation.
DEFAULT_MAX_TOOL_RESULT_CHARS: Final = 100_000

_ZWJ: Final = "\u200d"
_MARKS: Final = frozenset(("Mn", "Me", "Mc"))
#: How far a cut moves to keep a grapheme whole (past this, e.g. in "Zalgo" text, it cuts between marks:
#: still valid text). A surrogate pair is never split, whatever the distance.
_MAX_SHIFT: Final = 64


@frozen
class CappedText:
    """What the model sees of a result: ``text``, and how many characters of the original it lacks."""

    text: str
    #: 0 when the result was sent whole.
    left_out: int = 0

    @property
    def cut(self) -> bool:
        """True when part of the result was left out."""
        return self.left_out > 0


def cut_marker(left_out: int, limit: int, *, context: bool = False, shared: bool = False) -> str:
    """The line that replaces the middle of a result longer than ``limit`` (blank lines around it).

    ``context`` names a context message of the result instead of the result; ``shared`` says that
    ``limit`` is one budget for the result and its context messages.
    """
    what = "this context message of a tool result" if context else "this tool result"
    budget = f"max_tool_result_chars = {limit}" + (", shared by the result and its context messages" if shared else "")
    note = f"of {what} ({budget}); ask for less, e.g. a narrower query, a range or a limit"
    return f"\n\n{left_out_marker(left_out, 'character', note)}\n\n"


def _short_marker(left_out: int, limit: int) -> str:
    # For a cap too small for the full wording.
    return f"\n{left_out_marker(left_out, 'character')}\n"


def _is_ri(char: str) -> bool:
    return "\U0001f1e6" <= char <= "\U0001f1ff"


def _pair_split(text: str, index: int) -> bool:
    """True when ``index`` falls between a high and a low surrogate."""
    return 0 < index < len(text) and "\ud800" <= text[index - 1] <= "\udbff" and "\udc00" <= text[index] <= "\udfff"


def _joined(text: str, index: int) -> bool:
    """True when a cut at ``index`` (between ``text[index - 1]`` and ``text[index]``) splits a grapheme."""
    before, char = text[index - 1], text[index]
    if _pair_split(text, index) or (before == "\r" and char == "\n") or _ZWJ in (before, char):
        return True
    if "\U0001f3fb" <= char <= "\U0001f3ff":  # an emoji modifier (skin tone)
        return True
    if _is_ri(char) and _is_ri(before):
        # Regional indicators pair up from the start of their run: split only inside a pair.
        run = 0
        while index - run - 1 >= 0 and _is_ri(text[index - run - 1]):
            run += 1
        return run % 2 == 1
    return unicodedata.category(char) in _MARKS


def _head_end(text: str, index: int) -> int:
    """``index`` moved back until ``text[:index]`` ends on a grapheme boundary."""
    for _ in range(_MAX_SHIFT):
        if index <= 0 or not _joined(text, index):
            break
        index -= 1
    return index - 1 if _pair_split(text, index) else index


def _tail_start(text: str, index: int) -> int:
    """``index`` moved forward until ``text[index:]`` starts on a grapheme boundary."""
    for _ in range(_MAX_SHIFT):
        if index >= len(text) or not _joined(text, index):
            break
        index += 1
    return index + 1 if _pair_split(text, index) else index


def cap_tool_text(text: str, limit: int) -> CappedText:
    """``text`` itself when it has at most ``limit`` characters; else its head and tail around a marker.

    The result never has more than ``limit`` characters. Below the room a marker
    needs (a cap of a few dozen characters) only the head is kept.
    """
    if limit < 1:
        raise ValueError(f"max_tool_result_chars must be at least 1, got {limit}")
    return _cap(text, limit, lambda left_out: cut_marker(left_out, limit))


def shares(lengths: Sequence[int], limit: int) -> list[int]:
    """How many characters each of texts of ``lengths`` may keep of one budget of ``limit``, max-min fairly.

    All of them when they fit. Otherwise, shortest first, a text within an equal share of what is left
    keeps its length; the rest split what remains equally (the first ones one character more), so the
    shares add up to ``limit`` exactly. A share is 0 only when there are more texts than characters.
    """
    if sum(lengths) <= limit:
        return list(lengths)
    budgets = list(lengths)
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    remaining = limit
    for rank, index in enumerate(order):
        count = len(order) - rank
        share = remaining // count
        if lengths[index] > share:
            for position, rest in enumerate(order[rank:]):
                budgets[rest] = share + (1 if position < remaining % count else 0)
            break
        remaining -= lengths[index]
    return budgets


def cap_call_texts(text: str, contexts: Sequence[str], limit: int) -> tuple[CappedText, list[CappedText]]:
    """What the model sees of one call: its result's ``text`` and its ``contexts``, within ``limit`` together.

    Each text longer than its share (:func:`shares`) is cut as :func:`cap_tool_text` cuts, around a marker
    naming what it cut (the result or a context message of it) and, when there are contexts, that the cap
    is shared. A text whose share is 0 is sent empty.
    """
    if limit < 1:
        raise ValueError(f"max_tool_result_chars must be at least 1, got {limit}")
    shared = bool(contexts)
    budgets = shares([len(text), *map(len, contexts)], limit)

    def cap(piece: str, budget: int, context: bool) -> CappedText:
        if budget < 1:
            return CappedText("", len(piece))
        return _cap(piece, budget, lambda left_out: cut_marker(left_out, limit, context=context, shared=shared))

    return (
        cap(text, budgets[0], False),
        [cap(piece, budget, True) for piece, budget in zip(contexts, budgets[1:], strict=True)],
    )


def _cap(text: str, limit: int, marker_of: Callable[[int], str]) -> CappedText:
    """``text`` within ``limit`` (at least 1), its middle replaced by ``marker_of(left_out)`` when cut."""
    if len(text) <= limit:
        return CappedText(text)
    for marker in (marker_of, lambda left_out: _short_marker(left_out, limit)):
        # The marker for the most that could be left out is the longest it can be: what remains is safe.
        keep = limit - len(marker(len(text)))
        if keep >= 0:
            head = _head_end(text, (keep + 1) // 2)
            tail = _tail_start(text, len(text) - keep // 2)
            left_out = tail - head
            return CappedText(text[:head] + marker(left_out) + text[tail:], left_out)
    head = _head_end(text, limit)
    return CappedText(text[:head], len(text) - head)
