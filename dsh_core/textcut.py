"""The marker a text the model reads shows where its middle was cut out.

Several places keep only the head and the tail of a long text: the ``bash``
plugin's output cap (bytes of a stream, captured as they come), the agent's
cap on one tool result (:mod:`dsh_core.agent.resultcap`, characters) and the
shortening of a schema violation quoted in an error (:mod:`dsh_core.schema`,
characters). Each keeps its own amounts and its own cut, since cutting a byte
stream as it arrives is not cutting a string, but the model sees one shape for
the same event, whoever cut: ``[... 1,234 bytes left out ...]``, the count and
its unit named, so it never has to learn several wordings of one thing, nor
guess whether a count is of bytes or of characters.
"""

from __future__ import annotations

__all__ = ["left_out_marker"]


def left_out_marker(count: int, unit: str, note: str = "") -> str:
    """``[... 1,234 characters left out ...]``: ``count`` (thousands separated) of ``unit`` were cut out here.

    ``unit`` is singular (``"byte"``, ``"character"``); an ``s`` is added unless ``count`` is 1.
    ``note``, when given, follows ``left out`` (after a space) inside the brackets: what was cut and how
    to get less. The marker has no line break or space around it: where it stands is the caller's.
    From 1 up, a larger ``count`` never gives a shorter marker, so a cut that counts its marker within
    its cap may size it for the most that could be left out.
    """
    noun = unit if count == 1 else f"{unit}s"
    return f"[... {count:,} {noun} left out{f' {note}' if note else ''} ...]"
